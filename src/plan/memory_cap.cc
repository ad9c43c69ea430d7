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
// plan's: memory is balanced where it costs the exchange little.
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
  const auto cap_at = [&](double slack) { return static_cast<int64_t>(std::floor(static_cast<double>(colocated) * (1.0 + slack))); };
  free.memory_cap = cap_at(eps);
  free.is_within_memory = fullest(free) <= free.memory_cap;
  if (free.is_within_memory || !free.is_balanced || eps <= 0) return free;
  // The first level that keeps the balance; then two halvings of the step below it.
  auto try_cap = [&](double slack) -> Result<std::optional<Plan>> {
    capped.max_server_bytes = cap_at(slack);
    DISTCA_ASSIGN_OR_RETURN(Plan p, plan(capped));
    const auto link = [](const Plan& x) { return static_cast<double>(x.traffic.links[kStateful].step); };
    if (p.is_balanced && p.is_within_budget && p.is_within_memory && link(p) <= (1 + kLinkSlack) * link(free)) {
      return std::optional<Plan>(std::move(p));
    }
    return std::optional<Plan>();
  };
  double failed = 0;  // the largest slack known not to keep it (0: none tried)
  for (double slack = eps; cap_at(slack) < fullest(free); failed = slack, slack *= 2) {
    DISTCA_ASSIGN_OR_RETURN(std::optional<Plan> kept, try_cap(slack));
    if (!kept) continue;
    double lo = failed, hi = slack;
    for (int i = 0; i < 2 && failed > 0; ++i) {
      const double mid = (lo + hi) / 2;
      DISTCA_ASSIGN_OR_RETURN(std::optional<Plan> tighter, try_cap(mid));
      if (tighter) {
        kept = std::move(tighter);
        hi = mid;
      } else {
        lo = mid;
      }
    }
    kept->note += fmt::format("; memory capped at {:.1f} MiB per server ({:.3f} x colocated's fullest; {:.1f} MiB uncapped)",
                              mib(kept->memory_cap), 1.0 + hi, mib(fullest(free)));
    return std::move(*kept);
  }
  free.note += fmt::format("; memory: no cap below its own {:.1f} MiB per server ({:.3f} x colocated's fullest) kept the "
                           "balance and the busiest link within 5 %", mib(fullest(free)), static_cast<double>(fullest(free)) / static_cast<double>(colocated));
  return free;
}

}  // namespace distca::plan
