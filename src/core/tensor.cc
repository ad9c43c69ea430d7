#include "distca/core/tensor.h"

#include <string>

namespace distca {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

Result<DType> dtype_from_name(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kI32, DType::kI64}) {
    if (dtype_name(d) == name) return d;
  }
  return invalid_argument("unknown dtype '" + std::string(name) +
                          "' (expected f32, f64, bf16, f16, i32 or i64)");
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  DISTCA_CHECK(shape.size() >= 1 && shape.size() <= kMaxDims)
      << "a TensorView has 1.." << kMaxDims << " dims, got " << shape.size();
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.num_dims = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t extent : shape) {
    DISTCA_CHECK(extent >= 0) << "negative extent " << extent << " in dim " << i;
    v.shape[i++] = extent;
  }
  int64_t stride = 1;
  for (int d = v.num_dims - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

int64_t TensorView::num_elements() const {
  if (num_dims == 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < num_dims; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = num_dims - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

int64_t TensorView::offset(std::initializer_list<int64_t> idx) const {
  DISTCA_CHECK(static_cast<int>(idx.size()) == num_dims)
      << "index has " << idx.size() << " coordinates for a " << num_dims << "-d view";
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) {
    DISTCA_CHECK(i >= 0 && i < shape[d]) << "index " << i << " outside dim " << d << " of extent " << shape[d];
    off += i * strides[d++];
  }
  return off;
}

TensorView TensorView::slice_rows(int64_t begin, int64_t end) const {
  DISTCA_CHECK(num_dims >= 1 && 0 <= begin && begin <= end && end <= shape[0])
      << "rows [" << begin << ", " << end << ") outside [0, " << shape[0] << ")";
  TensorView v = *this;
  v.shape[0] = end - begin;
  v.data = static_cast<char*>(data) + static_cast<std::size_t>(begin * strides[0]) * dtype_size(dtype);
  return v;
}

}  // namespace distca
