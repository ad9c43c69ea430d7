// The sm_90a kernels' launchers (launch.cu, compiled by nvcc: hopper_fwd.cuh, hopper_bwd.cuh and
// hopper_bwd_dq.cuh), called by the host side (../attention_cuda.cc). Each returns the launch's
// cudaError_t; every launch is asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/schedule.h"

namespace distca::kernels::cuda {

// The sm_90a forward (hopper_fwd.cuh): items from fwd_schedule(tasks, kHopperFwdBlockM), a
// persistent grid of at most num_sms blocks. Only for a device of compute capability 9.0 and a
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

}  // namespace distca::kernels::cuda
