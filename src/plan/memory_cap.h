// The per-server memory cap of distca's own planners (PlannerOptions::max_server_bytes): what it
// resolves to, and the search that plans within it.
//
// A stateful attention server keeps, for every layer until that layer's backward, the rows it
// served: Q, O and LSE of its tasks' query rows and K and V of their keys (Plan::server_bytes).
// Colocated attention holds each rank's own rows (and a split document's key prefix); a plan
// that balances compute piles K/V prefixes and blocks onto the receivers, up to 1.4x colocated's
// fullest rank on the shipped workloads. Planning within a cap keeps them lower.
//
// auto: memory balanced as compute is. The goal is (1 + eps) x colocated's fullest server, eps the
// planner's tolerance. The plan without a cap is kept where it is within that (the cap does not
// bind: the same plan, the same hash); else the planner plans again under caps a quarter, a half,
// three quarters of the way from the free plan's fullest down to the goal, and the goal, while
// each plan is balanced and its step's busiest link within 5 % of the free plan's: compute
// first, the exchange next. The first cap that fails ends the search (one plan more where no cap
// helps). An explicit cap is honoured as a limit: moves that would break it are skipped,
// whatever that leaves of the balance (Plan::is_balanced says).
#pragma once

#include <functional>

#include "distca/plan/planner.h"

namespace distca::plan {

// The largest server_bytes of the colocated plan (plan_none) on `batch`.
int64_t colocated_server_bytes(const Batch& batch, const CostModel& cost);

// Plans with `plan` (called with max_server_bytes 0 for no cap or a cap > 0) as
// options.max_server_bytes asks (the header above); fills Plan::memory_cap and is_within_memory.
Result<Plan> plan_within_memory(const Batch& batch, const CostModel& cost, const PlannerOptions& options,
                                const std::function<Result<Plan>(const PlannerOptions&)>& plan);

}  // namespace distca::plan
