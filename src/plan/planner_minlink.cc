// minlink: the plan with the least busy link at the asked balance. An all-to-all lasts as long as
// its busiest rank's transfer, and a step's four exchanges one after the other, so what a plan
// costs on the wire is the sum over the phases (stateful backward) of each phase's busiest link
// (busiest_links), not its total bytes.
//
// minbytes shapes its moves for the fewest bytes; which of its variants has the least busy links
// depends on the batch: spreading a sender's excess over many receivers (its default) keeps each
// receiver's intake small but makes the sender ship many small blocks, which cost more bytes per
// pair than a few large ones. So minlink plans both (below) and keeps the balanced one (max load
// <= (1 + eps) mean, within the byte budget) with the least busy step, then the least busy
// forward dispatch, then the fewest bytes; where neither balances, the more balanced one.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <thread>
#include <tuple>

#include "minbytes.h"

#include "distca/plan/planner.h"

namespace distca::plan {
namespace {

struct Candidate {
  std::string name;
  Plan plan;
  LinkSummary links;
  int64_t total_bytes = 0;
};

}  // namespace

Result<Plan> plan_minlink(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  const double eps = options.tolerance;
  // minbytes as it is (its intake spread over the most receivers) and with its intake raised to
  // the largest room (each sender's excess in the fewest, largest blocks). Measured on the shipped
  // batches and fresh ones (distca bench planner --fresh 3, eps 0.02 and 0.05): each was the least
  // busy on some batch; minbytes at eps/2, eps/4 and eps/8, minmax and the paper's planner added
  // nothing to the worst case and were dropped. The two run on two threads.
  const double scales[] = {1.0, std::numeric_limits<double>::infinity()};
  std::vector<Candidate> candidates(2);
  std::vector<Status> failed(2);
  auto plan_one = [&](int i) {
    Result<Plan> p = plan_minbytes_shaped(batch, cost, options, scales[i]);
    if (!p.is_ok()) {
      failed[i] = p.status();
      return;
    }
    const Traffic stateful = count_traffic(batch, cost.token_bytes(), p.value().tasks, BackwardMode::kStateful);
    int64_t total = 0;
    for (const PhaseTraffic& t : stateful.phases) total += t.total_bytes;
    candidates[i] = Candidate{i == 0 ? "minbytes" : "minbytes with the largest blocks", std::move(p).value(),
                              busiest_links(stateful), total};
  };
  std::thread other(plan_one, 1);
  plan_one(0);
  other.join();
  for (const Status& s : failed) DISTCA_RETURN_IF_ERROR(s);

  auto balanced = [&](const Candidate& c) {
    return c.plan.load.max <= (1.0 + eps) * c.plan.load.mean * (1.0 + 1e-12) && c.plan.is_within_budget;
  };
  auto key = [&](const Candidate& c) {
    return std::make_tuple(!balanced(c), balanced(c) ? 0.0 : c.plan.load.imbalance, c.links.step, c.links.fwd_dispatch,
                           c.total_bytes);
  };
  const auto best = std::min_element(candidates.begin(), candidates.end(),
                                     [&](const Candidate& a, const Candidate& b) { return key(a) < key(b); });
  Plan plan = std::move(best->plan);  // finalized by minbytes at this eps: only the name changes
  plan.policy = "minlink";
  plan.note = fmt::format("{} of {} candidates: {}{}", plan.is_balanced ? "the least busy link" : "the more balanced",
                          candidates.size(), best->name,
                          plan.note.empty() || plan.note == "bound met" ? "" : " (" + plan.note + ")");
  return plan;
}

}  // namespace distca::plan
