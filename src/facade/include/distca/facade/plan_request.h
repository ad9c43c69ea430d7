// What `distca plan` does with a batch, as a library: its options checked once (the same
// messages for the command line and the Python package), every asked policy planned, timed and
// verified, each plan's per-layer forward time on a profile's link, and the JSON report that
// `distca plan --json` prints. Sampling a batch and printing tables stay in the command line.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/plan.h"
#include "distca/plan/planner.h"
#include "distca/sim/auto_tolerance.h"
#include "distca/sim/profile.h"

namespace distca::facade {

// --granularity: a power of two from 16 to 4096 (see plan_request.cc for why).
inline constexpr int64_t kMinGranularity = 16;
inline constexpr int64_t kMaxGranularity = 4096;

// Options named by their command-line flags; an unset optional is a flag not given.
struct PlanRequest {
  std::string policy = std::string(plan::kDefaultPlanner);  // a planner's name, or "all"
  std::optional<double> tolerance;            // eps in [0, 1]; unset: auto (auto_tolerance.h)
  std::optional<int64_t> granularity;         // default 128
  std::optional<std::string> max_rank_bytes;  // bytes or "auto"; default "0" (no budget)
  // minmax, minbytes, minlink: one layer's attention rows a server may hold, bytes (0 = no cap)
  // or "auto" (the default: src/plan/memory_cap.h).
  std::optional<std::string> max_server_bytes;
  // The attention rates the planner prices tasks at (default: ThroughputProfile{}, a GPU's;
  // plan::cpu_throughput_profile() for CPU servers). The report's per-layer times still come
  // from the simulator's profile.
  std::optional<plan::ThroughputProfile> throughput;
  std::string model = "llama-8b";             // a preset, or "custom" with every shape flag
  std::optional<int> layers, hidden, heads, kv_heads, head_dim, ffn_hidden, dtype_bytes, tp;
  // "fp32" or "bf16": the dK/dV return the plan's bytes are counted at; unset: fp32, what the
  // runtime and distca.torch send by default.
  std::optional<std::string> grad_return;
  int gpus_per_node = 8;

  int64_t granularity_or_default() const { return granularity.value_or(128); }
  // Every check that needs no batch: policy, tolerance, granularity, budget, model flags.
  Status validate() const;
  // The model the flags describe (validated).
  Result<plan::ModelShape> model_shape() const;
};

// --tolerance: auto (unset) or a number in [0, 1] (checked by PlanRequest::validate).
Result<std::optional<double>> parse_tolerance(const std::string& text);

// --max-rank-bytes as a number of bytes (0 = no budget).
Result<int64_t> parse_byte_budget(const std::string& text);
// --max-server-bytes: auto (PlannerOptions::kAutoServerBytes) or a number of bytes (0 = no cap).
Result<int64_t> parse_server_bytes(const std::string& text);

// The link one layer's all-to-all runs on: R x tp GPUs, gpus_per_node to a node; once they span
// two nodes the inter-node link bounds the exchange, as the simulator prices it.
struct LinkChoice {
  sim::Link link;
  std::string name;  // "intra-node" or "inter-node"
  int64_t gpus = 0;
  int64_t nodes = 0;
};

// One layer's forward on the profile: the busiest rank's link time against the compute ping-pong
// can hide it behind (the fullest rank's linear layers plus the slowest server's attention).
struct LayerTime {
  double comm = 0;
  double linear = 0;
  double attention = 0;
  bool is_hidden() const { return comm <= linear + attention; }
};

// --max-rank-bytes auto: half of what the link moves in the fullest rank's linear time, less
// two latencies (dispatch and return fit in it).
struct AutoBudget {
  int64_t bytes = 0;
  double linear_seconds = 0;
};

struct PolicyRun {
  plan::Plan plan;
  double plan_ms = 0;       // the planner's own time (with auto: every plan its search made)
  std::optional<sim::AutoTolerance> auto_tolerance;  // with auto: the eps picked and what was tried
  bool is_verified = false;
  std::string verify_error;
  LayerTime time;
};

struct PlanRun {
  explicit PlanRun(plan::CostModel cost_model) : cost(std::move(cost_model)) {}
  plan::CostModel cost;
  LinkChoice link;
  std::optional<AutoBudget> auto_budget;
  int64_t budget = 0;
  int64_t max_server_bytes = plan::PlannerOptions::kAutoServerBytes;
  std::optional<double> tolerance;  // unset: auto
  int64_t granularity = 0;
  int gpus_per_node = 0;
  std::string profile_name;
  PolicyRun before;              // none: the colocated baseline
  std::vector<PolicyRun> runs;   // the asked policies
};

// Plans `batch` with every asked policy. Bad input (the request, the batch, a budget the link
// cannot give) is an invalid_argument error, found before any planning. In three steps, for a
// caller that wants the plan first and the report later (the Python package):
//   prepare_plan_run  the checks, the cost model, the link and the byte budget; no planning
//   plan_policy       one policy's plan; plan_ms times the planner alone
//   complete_plan_run the baseline (none), every plan's verification and layer time
// `progress` (may be null) is told each step (and each rung of --tolerance auto) as it starts.
Result<PlanRun> run_plan_request(const PlanRequest& request, const plan::Batch& batch, const sim::Profile& profile,
                                 Progress* progress = nullptr);
Result<PlanRun> prepare_plan_run(const PlanRequest& request, const plan::Batch& batch, const sim::Profile& profile);
PolicyRun plan_policy(const PlanRun& run, const plan::Batch& batch, plan::PlanFn planner, const sim::Profile& profile,
                      Progress* progress = nullptr);
void complete_plan_run(PlanRun& run, const plan::Batch& batch, const sim::Profile& profile, Progress* progress = nullptr);

// The report `distca plan --json` prints (without the workload and seed it adds): one policy's
// object, or {"policies": [...]} with several.
nlohmann::json plan_run_json(const PlanRun& run, const plan::Batch& batch);

}  // namespace distca::facade
