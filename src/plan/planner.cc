#include "distca/plan/planner.h"

#include <fmt/format.h>

#include <cmath>

namespace distca::plan {

Status PlannerOptions::validate() const {
  if (!(tolerance >= 0) || !std::isfinite(tolerance)) {
    return invalid_argument(fmt::format("tolerance must be >= 0, got {}", tolerance));
  }
  if (granularity <= 0 || granularity > kMaxTokens) {
    return invalid_argument(fmt::format("granularity must be in [1, {}], got {}", kMaxTokens, granularity));
  }
  if (max_rank_bytes < 0) {
    return invalid_argument(fmt::format("max rank bytes must be >= 0 (0 = no budget), got {}",
                                        max_rank_bytes));
  }
  if (max_server_bytes < kAutoServerBytes) {
    return invalid_argument(fmt::format("max server bytes must be >= 0 (0 = no cap) or auto, got {}", max_server_bytes));
  }
  return Status::ok();
}

Result<Plan> plan_none(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  std::vector<Task> tasks;
  tasks.reserve(batch.pieces.size());
  for (const Piece& p : batch.pieces) tasks.push_back(causal_task(p.doc, p.begin, p.end, p.rank));
  Plan plan = finalize_plan("none", options.tolerance, batch, cost, std::move(tasks));
  plan.note = "colocated: each rank attends its own pieces";
  return plan;
}

namespace {
struct Entry {
  const char* name;
  PlanFn fn;
};
constexpr Entry kPlanners[] = {{"none", plan_none},         {"distca", plan_distca},   {"minmax", plan_minmax},
                               {"minbytes", plan_minbytes}, {"minlink", plan_minlink}};
}  // namespace

Result<PlanFn> find_planner(std::string_view name) {
  for (const Entry& e : kPlanners) {
    if (name == e.name) return e.fn;
  }
  return not_found(fmt::format("unknown policy '{}' (expected none, distca, minmax, minbytes, minlink or all)", name));
}

std::string_view planner_name(PlanFn fn) {
  for (const Entry& e : kPlanners) {
    if (fn == e.fn) return e.name;
  }
  return "";
}

std::vector<std::string> planner_names() {
  std::vector<std::string> names;
  for (const Entry& e : kPlanners) names.emplace_back(e.name);
  return names;
}

}  // namespace distca::plan
