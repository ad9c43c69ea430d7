// Profiles: what one machine's kernels and links cost, as data (versioned JSON). The simulator
// prices every operation from a profile:
//   attention  per head configuration (Hq, Hkv, D per GPU), measured points of a causal shard of
//              q query rows at the end of a kv-row prefix: forward and backward seconds. The
//              throughput (FLOP/s) is interpolated log-linearly in the key length between
//              points (short documents run at a poor rate; a shard of a long one runs at the
//              rate of its long prefix), and a shard of fewer than tile_rows queries pays for a
//              whole tile. Other head configurations scale by FLOPs.
//   linear     FLOP/s of the linear layers (GEMMs, norms and the TP collectives inside them).
//   links      intra-node and inter-node, per GPU and direction (alpha-beta).
//   memory     bytes of device memory per GPU (optional: 0 when unknown, and then not checked).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/status.h"
#include "distca/sim/timing.h"

namespace distca::sim {

inline constexpr int kProfileVersion = 1;

struct AttentionPoint {
  int64_t q_tokens = 0;
  int64_t kv_tokens = 0;  // >= q_tokens: the shard is the last q rows of a kv-row prefix
  double fwd_seconds = 0;
  double bwd_seconds = 0;
};

struct AttentionProfile {
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  std::vector<AttentionPoint> points;  // sorted by kv_tokens
  double task_overhead_seconds = 0;    // per task per layer (launch, scheduling)
  int64_t tile_rows = 1;               // query rows per kernel tile
};

// A measured model: its linear work (everything but core attention: GEMMs, norms, RoPE, the
// head and loss amortized over the layers) per token per layer, forward and backward together,
// and what a step costs besides (optimizer). `model` names the configuration it was measured on.
struct LinearEntry {
  std::string model;
  double seconds_per_token_layer = 0;
  double step_fixed_seconds = 0;
};

struct Profile {
  std::string name;
  std::string source;  // where the numbers come from
  std::vector<AttentionProfile> attention;
  double linear_flops_per_second = 0;
  Link intra_node;
  Link inter_node;
  std::string links_source;
  double device_memory_bytes = 0;  // per GPU; 0: unknown
  std::string device_memory_source;
  std::vector<LinearEntry> linear_models;
  const LinearEntry* find_linear(const std::string& model) const;

  Status validate() const;
  // Forward / backward seconds of a causal shard of q rows ending at key row kv_rows, with
  // `pairs` (query, key) pairs, for Hq query heads of dimension D on one GPU (the closest
  // profiled head configuration, scaled by FLOPs).
  double attention_seconds(int64_t q_rows, int64_t kv_rows, int64_t pairs, int64_t hq, int64_t head_dim,
                           bool is_backward) const;
};

// Profile::attention_seconds for one head configuration, with what it works out on every call
// (the closest profiled configuration, each point's rate and log key count) done once: the same
// numbers, for code that prices every task of a plan.
class AttentionPricer {
 public:
  AttentionPricer(const Profile& profile, int64_t hq, int64_t head_dim);
  double seconds(int64_t q_rows, int64_t kv_rows, int64_t pairs, bool is_backward) const;
  // {forward, backward}: the same two numbers, the rate's point looked up once.
  std::array<double, 2> seconds_both(int64_t q_rows, int64_t kv_rows, int64_t pairs) const;

 private:
  const AttentionProfile* config_;
  int64_t hq_, head_dim_;
  std::vector<double> log_kv_;                 // per point
  std::array<std::vector<double>, 2> rate_;    // per point: FLOP/s forward, backward
};

// Causal pairs of the last q rows of a kv-row prefix.
inline int64_t shard_pairs(int64_t q, int64_t kv) { return q * kv - q * (q - 1) / 2; }

// H200 SXM from published numbers; each number's source is in the profile.
Profile default_h200_profile();
nlohmann::json to_json(const Profile& p);
Result<Profile> profile_from_json(const nlohmann::json& j, const std::string& origin);
Result<Profile> load_profile(const std::string& path);

}  // namespace distca::sim
