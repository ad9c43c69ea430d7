#include "memory_cap.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace distca::plan {
namespace {

int64_t fullest(const Plan& plan) {
  return plan.server_bytes.empty() ? 0 : *std::max_element(plan.server_bytes.begin(), plan.server_bytes.end());
}

constexpr int kStateful = static_cast<int>(BackwardMode::kStateful);
// A capped plan is kept only if its step's busiest link (stateful) is within this of the free
// plan's: memory is balanced where it costs the exchange little. Measured on 20 batches
// (reports/cpu/2026-12-07-planner-memory): minlink's fullest server over colocated's, mean
// 1.287 uncapped, 1.283 at 5 %, 1.229 at 10 % (links up to 8.6 % busier), 1.197 at 25 % (23 %).
constexpr double kLinkSlack = 0.05;

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int64_t colocated_server_bytes(const Batch& batch, const CostModel& cost) {
  std::vector<Task> tasks;
  tasks.reserve(batch.pieces.size());
  for (const Piece& p : batch.pieces) tasks.push_back(causal_task(p.doc, p.begin, p.end, p.rank));
  const std::vector<int64_t> bytes = server_bytes(cost.token_bytes(), tasks, batch.num_ranks);
  return bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end());
}

Result<Plan> plan_within_memory(const Batch& batch, const CostModel& cost, const PlannerOptions& options,
                                const std::function<Result<Plan>(const PlannerOptions&)>& plan) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  PlannerOptions capped = options;
  if (options.max_server_bytes >= 0) {  // none, or a limit honoured as it is
    DISTCA_ASSIGN_OR_RETURN(Plan p, plan(capped));
    p.memory_cap = options.max_server_bytes;
    p.is_within_memory = p.memory_cap == 0 || fullest(p) <= p.memory_cap;
    if (!p.is_within_memory) {
      p.note += fmt::format("; memory cap {:.1f} MiB not kept: a server holds {:.1f} MiB (rows it owns count)",
                            mib(p.memory_cap), mib(fullest(p)));
    }
    return p;
  }
  capped.max_server_bytes = 0;
  DISTCA_ASSIGN_OR_RETURN(Plan free, plan(capped));
  const int64_t colocated = colocated_server_bytes(batch, cost);
  const double eps = options.tolerance;
  free.memory_cap = static_cast<int64_t>(std::floor(static_cast<double>(colocated) * (1.0 + eps)));
  free.is_within_memory = fullest(free) <= free.memory_cap;
  if (free.is_within_memory || !free.is_balanced || eps <= 0) return free;
  // From the free plan's fullest down towards the goal, a quarter of the way at a time, while
  // each cap keeps the balance and the link: a cap that fails ends the search (one plan more
  // where none helps, four where the goal is met).
  const int64_t goal = free.memory_cap, top = fullest(free);
  std::optional<Plan> kept;
  for (int quarter = 1; quarter <= 4; ++quarter) {
    capped.max_server_bytes = top - (top - goal) * quarter / 4;
    DISTCA_ASSIGN_OR_RETURN(Plan p, plan(capped));
    const auto link = [](const Plan& x) { return static_cast<double>(x.traffic.links[kStateful].step); };
    if (!(p.is_balanced && p.is_within_budget && p.is_within_memory && link(p) <= (1 + kLinkSlack) * link(free))) break;
    kept = std::move(p);
  }
  if (kept) {
    kept->note += fmt::format("; memory capped at {:.1f} MiB per server ({:.3f} x colocated's fullest; {:.1f} MiB uncapped)",
                              mib(kept->memory_cap), static_cast<double>(kept->memory_cap) / static_cast<double>(colocated),
                              mib(top));
    return std::move(*kept);
  }
  free.note += fmt::format("; memory: no cap below its own {:.1f} MiB per server ({:.3f} x colocated's fullest) kept the "
                           "balance and the busiest link within 5 %", mib(fullest(free)), static_cast<double>(fullest(free)) / static_cast<double>(colocated));
  return free;
}

}  // namespace distca::plan
