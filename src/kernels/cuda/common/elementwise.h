// The small CUDA kernels every implementation shares (elementwise.cu): uncovered rows filled,
// the backward's delta, fp32 sums rounded once, rows summed, conversions and a transpose. Called
// by the host sides of distca's kernels (../attention_cuda.cc) and of cuDNN's (../../cudnn/).
// Each returns the launch's cudaError_t; every launch is asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace distca::kernels::cuda {

// O rows [begin, end) = 0 and their LSE = -inf.
cudaError_t launch_fill_rows(uint16_t* o, float* lse, int64_t begin, int64_t end, int64_t row_elems, int heads,
                             cudaStream_t stream);
// delta[i] = sum_d dO[i, d] O[i, d] - (d_lse ? d_lse[i] : 0) for rows_heads rows of head_dim.
cudaError_t launch_delta(const uint16_t* d_o, const uint16_t* o, const float* d_lse, float* delta, int64_t rows_heads,
                         int head_dim, bool is_bf16, cudaStream_t stream);
// out[i] = round(acc[i] * scale), or acc[i] *= scale in place when out is null.
cudaError_t launch_finalize(float* acc, uint16_t* out, float scale, int64_t n, bool is_bf16, cudaStream_t stream);
// For each of num_spans spans {src_row, dst_row, rows} (device int64 triples): acc rows
// [dst_row, dst_row + rows) += src rows [src_row, ...) in fp32 (atomics: spans may overlap).
// max_rows bounds every span's rows (it sizes the grid).
cudaError_t launch_add_rows(const uint16_t* src, float* acc, const int64_t* spans, int64_t num_spans, int64_t max_rows,
                            int64_t row_elems, bool is_bf16, cudaStream_t stream);
cudaError_t launch_from_f32(const float* src, uint16_t* dst, int64_t n, bool is_bf16, cudaStream_t stream);
cudaError_t launch_to_f32(const uint16_t* src, float* dst, int64_t n, bool is_bf16, cudaStream_t stream);
// dst[c * rows + r] = src[r * cols + c]: a [rows, cols] fp32 matrix transposed (LSE [T, H] <-> [H, T]).
cudaError_t launch_transpose_f32(const float* src, float* dst, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace distca::kernels::cuda
