// Arena: one buffer with named views. Blocks are laid out first (add), then the buffer is
// allocated once (allocate); a step loop only reads and writes views, never allocates.
// Arenas with the same layout (parameters, gradients, optimizer moments) share offsets, so an
// optimizer walks them as flat arrays.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "distca/core/check.h"

namespace distca::model {

template <typename T>
class Arena {
 public:
  struct Block {
    std::string name;
    int64_t offset = 0;
    int64_t count = 0;
  };

  // Reserves `count` elements under `name` (unique); returns the block's offset.
  // REQUIRES: not yet allocated.
  int64_t add(std::string name, int64_t count) {
    DISTCA_CHECK(data_.empty() && !is_allocated_) << "Arena::add after allocate";
    DISTCA_CHECK(count >= 0) << "negative block " << name;
    const int64_t offset = size_;
    blocks_.push_back({std::move(name), offset, count});
    size_ += count;
    return offset;
  }
  // One zeroed buffer for every block.
  void allocate() {
    DISTCA_CHECK(!is_allocated_) << "Arena::allocate twice";
    data_.assign(static_cast<size_t>(size_), T{});
    is_allocated_ = true;
  }
  // Another arena's layout, allocated.
  void copy_layout(const Arena& other) {
    blocks_ = other.blocks_;
    size_ = other.size_;
    is_allocated_ = false;
    data_.clear();
    allocate();
  }
  T* at(int64_t offset) { return data_.data() + offset; }
  const T* at(int64_t offset) const { return data_.data() + offset; }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  int64_t size() const { return size_; }
  const std::vector<Block>& blocks() const { return blocks_; }
  // The block named `name`, or nullptr.
  const Block* find(std::string_view name) const {
    for (const Block& b : blocks_) {
      if (b.name == name) return &b;
    }
    return nullptr;
  }
  void fill(T value) { std::fill(data_.begin(), data_.end(), value); }

 private:
  std::vector<Block> blocks_;
  int64_t size_ = 0;
  bool is_allocated_ = false;
  std::vector<T> data_;
};

}  // namespace distca::model
