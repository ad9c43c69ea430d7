// Cost model (docs/design.md §6): causal pair counts, FLOPs, estimated seconds from a throughput
// profile, and bytes per token for every tensor the runtime moves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distca/core/check.h"
#include "distca/core/status.h"
#include "distca/plan/model_shape.h"

namespace distca::plan {

// Causal (query, key) pairs of query rows [q0, q1) of a document against keys [0, q]:
// sum over q of (q + 1). Closed form, exact in 64 bits for documents up to 2^31 tokens.
inline int64_t causal_pairs(int64_t q0, int64_t q1) {
  return (q1 * (q1 + 1) - q0 * (q0 + 1)) / 2;
}

// Throughput profile of an attention server. The default stands for an H100/H200-class GPU
// (FlashAttention-class kernels at ~400 TFLOP/s on long shards); `distca profile` measures real
// ones. A shard shorter than `tile_rows` pays for a whole tile.
struct RatePoint {
  int64_t keys = 0;             // keys a query row of the task attends
  double flops_per_second = 0;  // forward and backward together
};

struct ThroughputProfile {
  std::string source = "default: 400 TFLOP/s fixed rate, 128-row tile, 2 us per task per layer";
  double flops_per_second = 400e12;
  int64_t tile_rows = 128;
  double task_overhead_seconds = 2e-6;  // per task, per layer, forward and backward together
  // Optional: the rate by the length of a task's key range (attention kernels run long key
  // ranges faster), keys ascending, interpolated in log(keys) and clamped at both ends; every
  // rate at most flops_per_second. Empty: flops_per_second for every task.
  std::vector<RatePoint> rate_by_keys;

  Status validate() const;
  // FLOP/s of a task whose key range is `keys` long.
  double rate(int64_t keys) const;
  // The slowest rate of any task.
  double slowest_rate() const;
};

// The planner's view of a CPU attention server (distca's CpuAttention and PyTorch's CPU flash
// kernel, roughly): a low FLOP rate, 16-row tiles and a per-task overhead, so short documents are
// priced at what they cost on a CPU rather than at a GPU's 128-row tile. `distca profile`
// measures real ones.
ThroughputProfile cpu_throughput_profile();

// Bytes per token of one layer, on one rank (heads already divided by tp).
struct TokenBytes {
  int64_t q = 0;              // Q
  int64_t kv = 0;             // K and V
  int64_t out = 0;            // O and its fp32 LSE (forward return)
  int64_t bwd_q = 0;          // Q, O, dO and LSE (backward dispatch, query side, stateless)
  int64_t bwd_do = 0;         // dO alone (backward dispatch, query side, stateful)
  int64_t bwd_dq = 0;         // dQ (backward return, query side)
  int64_t bwd_dkv = 0;        // dK and dV in the grad-return dtype, summed at the owner in fp32 (backward return)
  bool operator==(const TokenBytes&) const = default;
};

// Bytes per token of every tensor the runtime moves, for hq query heads and hkv key/value heads
// of head_dim elements of dtype_bytes each. LSE is fp32; the returned dK/dV are fp32 or bf16
// (grad_return); dQ travels in the activation dtype. The cost model, the simulator and the
// runtime all take their sizes from here.
TokenBytes token_bytes(int64_t hq, int64_t hkv, int64_t head_dim, int64_t dtype_bytes, GradReturn grad_return);
// The same for one rank of a model (heads divided by its tp).
TokenBytes token_bytes(const ModelShape& model);

class CostModel {
 public:
  CostModel(ModelShape model, ThroughputProfile profile);

  const ModelShape& model() const { return model_; }
  const ThroughputProfile& profile() const { return profile_; }
  const TokenBytes& token_bytes() const { return token_bytes_; }

  // Forward FLOPs of one layer per causal pair on one rank: QK^T and PV, 2 FLOPs per MAC each.
  double fwd_flops_per_pair() const { return 4.0 * model_.head_dim * model_.q_heads_per_rank(); }
  // Backward is about 2.5x forward (dQ, dK, dV and the recomputed scores).
  double bwd_flops_per_pair() const { return 2.5 * fwd_flops_per_pair(); }

  // Estimated seconds of one task over all layers, forward and backward, for a task of q_len
  // query rows, `pairs` (query, key) pairs and a key range `keys` long (k1 - k0).
  // (Inline: the planners price every shape they try with it.)
  double task_seconds(int64_t q_len, int64_t pairs, int64_t keys) const {
    DISTCA_CHECK(q_len > 0 && pairs >= 0) << "task of " << q_len << " rows and " << pairs << " pairs";
    double seconds = pair_seconds(pairs);
    if (!profile_.rate_by_keys.empty()) seconds *= profile_.flops_per_second / profile_.rate(keys);
    if (q_len < profile_.tile_rows) {
      seconds *= static_cast<double>(profile_.tile_rows) / static_cast<double>(q_len);
    }
    return seconds + task_overhead_;
  }
  // Seconds of `pairs` pairs at the profile's top rate with no per-task overhead and no
  // short-shard penalty: the floor any split of the same work can reach.
  double pair_seconds(int64_t pairs) const { return seconds_per_pair_ * static_cast<double>(pairs); }
  // Seconds of one pair at the profile's slowest rate (no overhead): the most a pair can cost.
  double slowest_pair_seconds() const { return slowest_seconds_per_pair_; }

 private:
  ModelShape model_;
  ThroughputProfile profile_;
  TokenBytes token_bytes_;
  double seconds_per_pair_ = 0;  // all layers, forward and backward, at the top rate
  double slowest_seconds_per_pair_ = 0;
  double task_overhead_ = 0;  // all layers' per-task overhead
};

}  // namespace distca::plan
