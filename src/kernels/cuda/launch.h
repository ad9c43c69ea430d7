// The kernels' launchers (attention_cuda.cu, compiled by nvcc), called by the host side
// (attention_cuda.cc, compiled by the C++ compiler: fmt and Status stay out of nvcc's way). Each
// returns the launch's cudaError_t; every launch is asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_bwd.cuh"
#include "flash_fwd.cuh"

namespace distca::kernels::cuda {

// Raises the dynamic shared memory limit of every tile kernel (once per device).
cudaError_t allow_tile_smem();
// `blocks` = items x query heads; head_dim 64 or 128.
cudaError_t launch_fwd(const FwdKernelParams& p, int head_dim, bool is_bf16, int64_t blocks, cudaStream_t stream);
cudaError_t launch_bwd(const BwdKernelParams& p, int head_dim, bool is_bf16, int64_t blocks, cudaStream_t stream);
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
// dst[c * rows + r] = src[r * cols + c]: a [rows, cols] fp32 matrix transposed (LSE [T, H] <-> [H, T]).
cudaError_t launch_transpose_f32(const float* src, float* dst, int64_t rows, int64_t cols, cudaStream_t stream);

// The sm_90a forward (attention_hopper.cu, hopper_fwd.cuh): items from fwd_schedule(tasks,
// kHopperFwdBlockM),
// a persistent grid of at most num_sms blocks. Only for a device of compute capability 9.0 and a
// build with sm_90a.
inline constexpr int kHopperFwdBlockM = 128;
struct HopperFwdLaunch {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  uint16_t* o = nullptr;
  float* lse = nullptr;
  const FwdItem* items = nullptr;  // device memory
  int64_t num_items = 0;
  int64_t num_q_rows = 0, num_kv_rows = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool is_bf16 = true;
  float scale_log2 = 0;
  int num_sms = 0;
};
cudaError_t launch_hopper_fwd(const HopperFwdLaunch& l, cudaStream_t stream);

// The sm_90a backward (hopper_bwd.cuh): K/V tiles from kv_tile_schedule(tasks, kHopperBwdBlockN),
// the sm_80 backward's inputs and fp32 sums (lse, delta, zeroed dq_acc, dk_acc, dv_acc), a
// persistent grid.
inline constexpr int kHopperBwdBlockN = 64;
struct HopperBwdLaunch {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* d_o = nullptr;
  const float* lse = nullptr;
  const float* delta = nullptr;
  float* dq_acc = nullptr;
  float* dk_acc = nullptr;
  float* dv_acc = nullptr;
  const KvTileItem* items = nullptr;  // device memory
  const KvTileEntry* entries = nullptr;
  int64_t num_items = 0;
  // dQ in a pass of its own (hopper_bwd_dq.cuh, after the K/V blocks, which then skip dQ): its
  // 64-row query tiles, fwd_schedule(tasks, kHopperBwdDqBlockM), in device memory; null: the K/V
  // blocks add dQ by atomics.
  const FwdItem* dq_items = nullptr;
  int64_t num_dq_items = 0;
  int64_t num_q_rows = 0, num_kv_rows = 0;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool is_bf16 = true;
  float scale_log2 = 0;
  int num_sms = 0;
};
inline constexpr int kHopperBwdDqBlockM = 64;
cudaError_t launch_hopper_bwd(const HopperBwdLaunch& l, cudaStream_t stream);
cudaError_t launch_to_f32(const uint16_t* src, float* dst, int64_t n, bool is_bf16, cudaStream_t stream);

}  // namespace distca::kernels::cuda
