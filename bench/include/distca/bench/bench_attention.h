// The attention kernel benchmark behind `distca bench attention`.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "distca/core/status.h"

namespace distca::bench {

struct AttentionBenchOptions {
  std::vector<int64_t> docs = {4096, 16384, 32768};  // whole-document lengths
  int64_t shard_doc = 16384;                         // the document cut into shards; the headline
  std::vector<int64_t> shards = {64, 128, 256, 1024};
  int64_t head_dim = 128;
  int64_t q_heads = 1;
  int64_t kv_heads = 1;
  int threads = 0;  // "all threads": 0 = one per hardware thread
  int repeats = 1;  // each time is the best of this many runs
  uint64_t seed = 1;
};

Status validate(const AttentionBenchOptions& o);

using ProgressLine = std::function<void(const std::string&)>;
// Runs the benchmark; progress gets one line per finished measurement. The JSON has
// fwd_gflops, bwd_gflops, sgemm_gflops, gemm_attention_gflops, shard_fwd_gflops{size: ...},
// ratios, every measurement under "results", and blas_core with ceiling_trusted (false, with
// blas_warning, when OpenBLAS runs kernels narrower than the CPU's vector unit: kernels/blas_setup.h).
Result<nlohmann::json> run_attention_bench(const AttentionBenchOptions& o, const ProgressLine& progress);
void print_attention_report(const nlohmann::json& report);

}  // namespace distca::bench
