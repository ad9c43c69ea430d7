// `distca bench attention --device cuda`: TFLOP/s of distca's CUDA attention kernels, forward and
// backward (causal-aware FLOP counts: 4 D Hq per (query, key) pair forward, the backward counted
// as 2.5x the forward), timed with CUDA events (the median of --repeats, with the spread), on
// whole documents and on the same tokens as fused shards sharing K/V; and, with --profile-out,
// a simulator profile of this GPU with the measured points (`"measured": true`, device, date).
//
// PyTorch's kernels on the same shapes, in the same process and run, are measured by
// python/bench/bench_cuda_attention.py (this binary links no PyTorch); scripts/gpu-check.sh runs
// both.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "distca/core/status.h"

namespace distca::bench {

struct CudaAttentionBenchOptions {
  std::vector<int64_t> docs = {4096, 16384, 32768, 65536};
  int64_t shard_doc = 16384;  // the document cut into shards (also timed whole)
  std::vector<int64_t> shards = {64, 128, 256, 1024};
  int64_t head_dim = 128;
  int64_t q_heads = 32;
  int64_t kv_heads = 8;
  std::string dtype = "bfloat16";  // or float16
  int repeats = 5;
  uint64_t seed = 1;
  int device = -1;  // -1: the current one
  std::string profile_out;  // "" : none
};

Status validate(const CudaAttentionBenchOptions& o);

// Fails with a clear Status where the build has no CUDA kernels or the machine no GPU.
Result<nlohmann::json> run_cuda_attention_bench(const CudaAttentionBenchOptions& o,
                                                const std::function<void(const std::string&)>& progress);
void print_cuda_attention_report(const nlohmann::json& report);

// The simulator profile --profile-out writes: the default (published-number) profile with this
// GPU's measured attention points, whole documents of L tokens timed as (L, L, fwd, bwd); the
// kernels' 64-row query tile as the smallest unit a shard pays for; "measured": true, device, date;
// the GPU's own memory when device_memory_bytes > 0 (its total, as CUDA reports it), else the
// default profile's, said so in device_memory_source.
struct MeasuredPoint {
  int64_t tokens = 0;
  double fwd_seconds = 0;
  double bwd_seconds = 0;
};
nlohmann::json measured_cuda_profile(const CudaAttentionBenchOptions& o, const std::string& device,
                                     const std::string& date, const std::vector<MeasuredPoint>& whole_documents,
                                     double device_memory_bytes = 0);

}  // namespace distca::bench
