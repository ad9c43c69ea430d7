// Planners (balancing policies) behind one interface (docs/design.md §5).
//   none    colocated attention: each rank attends its own pieces (the baseline)
//   distca  the paper's communication-aware greedy scheduler, reproduced faithfully
//   minmax  ours: max load <= (1 + eps) * mean whenever the shards allow it, fewest bytes
//   minbytes ours: the same bound, moving query x key blocks (key-range splits) shaped for the
//           fewest bytes on the busiest rank
//   minlink ours, the default: of minbytes as it is and with its largest blocks and hosts (on two
//           threads), the plan balanced to eps whose step has the least busy links
//           (planner_minlink.cc)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/plan.h"

namespace distca::plan {

struct PlannerOptions {
  double tolerance = 0.05;          // eps
  int64_t granularity = 128;        // g: shards are multiples of g tokens
  int64_t max_rank_bytes = 0;       // per-rank forward send and receive budget; 0 = none
  // minmax, minbytes, minlink: the most bytes of one layer's attention rows a server may hold
  // (Plan::server_bytes): kAutoServerBytes (memory balanced as compute is, src/plan/memory_cap.h),
  // 0 = none, or a cap in bytes.
  int64_t max_server_bytes = kAutoServerBytes;
  static constexpr int64_t kAutoServerBytes = -1;

  Status validate() const;
};

using PlanFn = Result<Plan> (*)(const Batch&, const CostModel&, const PlannerOptions&);

Result<Plan> plan_none(const Batch& batch, const CostModel& cost, const PlannerOptions& options);
Result<Plan> plan_distca(const Batch& batch, const CostModel& cost, const PlannerOptions& options);
Result<Plan> plan_minmax(const Batch& batch, const CostModel& cost, const PlannerOptions& options);
Result<Plan> plan_minbytes(const Batch& batch, const CostModel& cost, const PlannerOptions& options);
Result<Plan> plan_minlink(const Batch& batch, const CostModel& cost, const PlannerOptions& options);

// "none", "distca", "minmax", "minbytes", "minlink" (the default: the least busy links of the
// policies on the shipped and fresh batches, distca bench planner).
Result<PlanFn> find_planner(std::string_view name);
std::vector<std::string> planner_names();
// The name find_planner gives `fn` ("" for a function it does not know).
std::string_view planner_name(PlanFn fn);
inline constexpr std::string_view kDefaultPlanner = "minlink";

}  // namespace distca::plan
