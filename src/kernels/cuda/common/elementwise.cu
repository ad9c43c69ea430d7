// The shared small kernels (elementwise.h): grid-stride loops over rows or elements.
#include "elementwise.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "warp.cuh"

namespace distca::kernels::cuda {
namespace {

// Rows [begin, end) of O get 0 and of LSE -inf (rows no task covers).
__global__ void fill_rows_kernel(uint16_t* o, float* lse, int64_t begin, int64_t end, int64_t row_elems, int heads) {
  const int64_t n = (end - begin) * row_elems;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    o[begin * row_elems + i] = 0;
    if (i < (end - begin) * heads) lse[begin * heads + i] = -INFINITY;
  }
}

// delta[r, h] = sum_d dO[r, h, d] O[r, h, d] - dLSE[r, h]: one warp per (row, head).
template <typename Elt>
__global__ void delta_kernel(const uint16_t* d_o, const uint16_t* o, const float* d_lse, float* delta, int64_t rows_heads,
                             int head_dim) {
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows_heads) return;
  const uint16_t* a = d_o + warp * head_dim;
  const uint16_t* b = o + warp * head_dim;
  float sum = 0.f;
  for (int d = lane; d < head_dim; d += 32) sum += to_float(a[d], Elt{}) * to_float(b[d], Elt{});
  for (int mask = 16; mask > 0; mask /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  if (lane == 0) delta[warp] = sum - (d_lse ? d_lse[warp] : 0.f);
}

// out[i] = round(acc[i] * scale) in the storage type, or acc[i] *= scale in place when out is null.
template <typename Elt>
__global__ void finalize_kernel(float* acc, uint16_t* out, float scale, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float x = acc[i] * scale;
    if (out) {
      out[i] = static_cast<uint16_t>(pack2(x, 0.f, Elt{}) & 0xffffu);
    } else {
      acc[i] = x;
    }
  }
}

template <typename Elt>
__global__ void from_f32_kernel(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = static_cast<uint16_t>(pack2(src[i], 0.f, Elt{}) & 0xffffu);
  }
}

template <typename Elt>
__global__ void to_f32_kernel(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = to_float(src[i], Elt{});
  }
}

// acc[dst_row + r] += src[src_row + r] for each span (blockIdx.y) of rows of row_elems elements;
// spans may add into the same rows (tasks sharing K/V rows), hence the atomics.
template <typename Elt>
__global__ void add_rows_kernel(const uint16_t* src, float* acc, const int64_t* spans, int64_t row_elems) {
  const int64_t* s = spans + 3 * blockIdx.y;
  const uint16_t* from = src + s[0] * row_elems;
  float* to = acc + s[1] * row_elems;
  const int64_t n = s[2] * row_elems;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    atomicAdd(to + i, to_float(from[i], Elt{}));
  }
}

__global__ void transpose_f32_kernel(const float* src, float* dst, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[c * rows + r] = src[i];
  }
}

// Blocks for a grid-stride loop over n elements.
unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace

cudaError_t launch_fill_rows(uint16_t* o, float* lse, int64_t begin, int64_t end, int64_t row_elems, int heads,
                             cudaStream_t stream) {
  fill_rows_kernel<<<grid_for((end - begin) * row_elems), 256, 0, stream>>>(o, lse, begin, end, row_elems, heads);
  return cudaGetLastError();
}

cudaError_t launch_delta(const uint16_t* d_o, const uint16_t* o, const float* d_lse, float* delta, int64_t rows_heads,
                         int head_dim, bool is_bf16, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((rows_heads * 32 + 255) / 256);
  if (is_bf16) {
    delta_kernel<Bf16><<<blocks, 256, 0, stream>>>(d_o, o, d_lse, delta, rows_heads, head_dim);
  } else {
    delta_kernel<Fp16><<<blocks, 256, 0, stream>>>(d_o, o, d_lse, delta, rows_heads, head_dim);
  }
  return cudaGetLastError();
}

cudaError_t launch_finalize(float* acc, uint16_t* out, float scale, int64_t n, bool is_bf16, cudaStream_t stream) {
  if (is_bf16) {
    finalize_kernel<Bf16><<<grid_for(n), 256, 0, stream>>>(acc, out, scale, n);
  } else {
    finalize_kernel<Fp16><<<grid_for(n), 256, 0, stream>>>(acc, out, scale, n);
  }
  return cudaGetLastError();
}

cudaError_t launch_from_f32(const float* src, uint16_t* dst, int64_t n, bool is_bf16, cudaStream_t stream) {
  if (is_bf16) {
    from_f32_kernel<Bf16><<<grid_for(n), 256, 0, stream>>>(src, dst, n);
  } else {
    from_f32_kernel<Fp16><<<grid_for(n), 256, 0, stream>>>(src, dst, n);
  }
  return cudaGetLastError();
}

cudaError_t launch_add_rows(const uint16_t* src, float* acc, const int64_t* spans, int64_t num_spans, int64_t max_rows,
                            int64_t row_elems, bool is_bf16, cudaStream_t stream) {
  for (int64_t first = 0; first < num_spans; first += 65535) {  // gridDim.y is at most 65535
    const dim3 grid(std::min(grid_for(max_rows * row_elems), 1024u), static_cast<unsigned>(std::min<int64_t>(num_spans - first, 65535)));
    if (is_bf16) {
      add_rows_kernel<Bf16><<<grid, 256, 0, stream>>>(src, acc, spans + 3 * first, row_elems);
    } else {
      add_rows_kernel<Fp16><<<grid, 256, 0, stream>>>(src, acc, spans + 3 * first, row_elems);
    }
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launch_transpose_f32(const float* src, float* dst, int64_t rows, int64_t cols, cudaStream_t stream) {
  transpose_f32_kernel<<<grid_for(rows * cols), 256, 0, stream>>>(src, dst, rows, cols);
  return cudaGetLastError();
}

cudaError_t launch_to_f32(const uint16_t* src, float* dst, int64_t n, bool is_bf16, cudaStream_t stream) {
  if (is_bf16) {
    to_f32_kernel<Bf16><<<grid_for(n), 256, 0, stream>>>(src, dst, n);
  } else {
    to_f32_kernel<Fp16><<<grid_for(n), 256, 0, stream>>>(src, dst, n);
  }
  return cudaGetLastError();
}

}  // namespace distca::kernels::cuda
