// DType and TensorView: a non-owning view (pointer, dtype, shape, strides, device) used at
// every kernel and communication boundary. Views never allocate; an arena or buffer owns.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distca/core/status.h"

namespace distca {

enum class DType { kF32, kF64, kBF16, kF16, kI32, kI64 };

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
Result<DType> dtype_from_name(std::string_view name);

enum class Device { kCpu, kCuda };

// Up to 4 dimensions, row-major by default. Strides are in elements.
struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;
  int num_dims = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  // A contiguous row-major view. REQUIRES: 1 <= shape.size() <= kMaxDims, every extent >= 0.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::kCpu);

  int64_t num_elements() const;
  std::size_t num_bytes() const { return static_cast<std::size_t>(num_elements()) * dtype_size(dtype); }
  bool is_contiguous() const;
  // Element offset of an index; REQUIRES: idx has num_dims entries inside the shape.
  int64_t offset(std::initializer_list<int64_t> idx) const;
  // Rows [begin, end) of dimension 0, same dtype and trailing shape.
  TensorView slice_rows(int64_t begin, int64_t end) const;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

}  // namespace distca
