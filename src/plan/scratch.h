// Memory a planner keeps between plans. glibc hands a finished plan's pages back to the kernel
// (the heap's top is trimmed) and the next plan faults them in again: for minbytes at 512 ranks
// that was 30 % of a plan's time (measured with glibc's trimming off: 9.8 ms against 6.9). So a
// planner leases a Scratch: an arena's first buffer and the planner's own lists (Lists), which go
// back to a free list when the plan ends, for the next planner to take, on whatever thread. There
// are at most as many as ever planned at once (minlink: two), each buffer as large as the largest
// plan it served (a few MB at 512 ranks) up to kMaxScratchBytes; a planner should hand back no
// list larger than that either. Private to the planners (src/plan).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <new>
#include <vector>

namespace distca::plan {

inline constexpr size_t kMinScratchBytes = size_t{1} << 16, kMaxScratchBytes = size_t{1} << 24;

// One planner's Scratch for its lifetime, and the upstream of its arena: what the arena takes
// beyond the buffer is counted, so that the next plan's buffer holds it. Declare the lease before
// the arena that uses it (so that it is destroyed after it).
template <typename Lists>
class ScratchLease final : public std::pmr::memory_resource {
 public:
  ScratchLease() {
    {
      const std::lock_guard<std::mutex> lock(free_mutex());
      if (!free_list().empty()) {
        scratch_ = std::move(free_list().back());
        free_list().pop_back();
      }
    }
    if (!scratch_) scratch_ = std::make_unique<Scratch>();
    if (scratch_->buffer.size() < kMinScratchBytes) scratch_->buffer.resize(kMinScratchBytes);
  }
  // Never throws (it runs while a planner's std::bad_alloc unwinds): out of memory, the buffer
  // keeps its size, or the scratch is freed rather than kept.
  ~ScratchLease() override {
    try {
      if (overflow_ > 0) {
        const size_t grown = std::min(kMaxScratchBytes, scratch_->buffer.size() + overflow_);
        if (grown > scratch_->buffer.size()) scratch_->buffer = std::vector<std::byte>(grown);
      }
    } catch (const std::bad_alloc&) {
    }
    try {
      const std::lock_guard<std::mutex> lock(free_mutex());
      free_list().push_back(std::move(scratch_));
    } catch (const std::bad_alloc&) {
    }
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  std::byte* buffer() { return scratch_->buffer.data(); }
  size_t buffer_size() const { return scratch_->buffer.size(); }
  Lists& lists() { return scratch_->lists; }

 private:
  struct Scratch {
    std::vector<std::byte> buffer;  // the arena's first buffer
    Lists lists;
  };
  static std::mutex& free_mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::unique_ptr<Scratch>>& free_list() {
    static std::vector<std::unique_ptr<Scratch>> list;
    return list;
  }
  void* do_allocate(size_t bytes, size_t align) override {
    overflow_ += bytes;
    return std::pmr::new_delete_resource()->allocate(bytes, align);
  }
  void do_deallocate(void* p, size_t bytes, size_t align) override {
    std::pmr::new_delete_resource()->deallocate(p, bytes, align);
  }
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override { return this == &other; }

  std::unique_ptr<Scratch> scratch_;
  size_t overflow_ = 0;  // bytes the arena took from the heap
};

}  // namespace distca::plan
