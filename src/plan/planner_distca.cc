// The DistCA paper's communication-aware greedy scheduler, reproduced faithfully.
//
// Servers above the mean load are sources, those below are destinations. Repeatedly:
//   1. take the destination with the largest deficit; stop when every deficit is within
//      eps * mean (eps bounds only the receivers: a source may stay far above the mean);
//   2. for every item (the unmoved token range of a piece) on every source, the work it can
//      move is dF = min(item work, source surplus, destination deficit) and the bytes it costs
//      are V = Q of the moved rows + K/V of the prefix the moved rows attend to;
//   3. move the item with the highest dF / V: whole, or as a mirrored head/tail pair of m
//      tokens each (m a multiple of g), whose work m * (lo + hi + 1) is linear in m.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "distca/plan/planner.h"

namespace distca::plan {
namespace {

struct Item {
  int32_t doc;
  int64_t lo;  // unmoved rows [lo, hi)
  int64_t hi;
  int32_t owner;
};

}  // namespace

Result<Plan> plan_distca(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  const int32_t r = batch.num_ranks;
  const int64_t g = options.granularity;
  const TokenBytes& tb = cost.token_bytes();
  auto work = [&](int64_t lo, int64_t hi) {
    return hi > lo ? cost.task_seconds(hi - lo, causal_pairs(lo, hi)) : 0.0;
  };

  std::vector<Item> items;
  std::vector<double> load(r, 0.0);
  for (const Piece& p : batch.pieces) {
    items.push_back(Item{p.doc, p.begin, p.end, p.rank});
    load[p.rank] += work(p.begin, p.end);
  }
  std::vector<Task> moved;
  std::vector<bool> is_exhausted(r, false);

  for (int64_t iteration = 0; iteration < 64 * (int64_t{r} + static_cast<int64_t>(items.size())); ++iteration) {
    double total = 0;
    for (double l : load) total += l;
    const double mean = total / r;
    // 1. The destination with the largest deficit.
    int32_t dst = -1;
    for (int32_t s = 0; s < r; ++s) {
      if (!is_exhausted[s] && load[s] < mean && (dst < 0 || load[s] < load[dst])) dst = s;
    }
    if (dst < 0 || mean - load[dst] <= options.tolerance * mean) break;
    const double deficit = mean - load[dst];

    // 2. The candidate with the most work per byte.
    int64_t best = -1;
    double best_priority = 0;
    int64_t best_m = 0;  // 0: move the whole item
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      const Item& it = items[i];
      if (it.lo >= it.hi || load[it.owner] <= mean) continue;
      const double item_work = work(it.lo, it.hi);
      const double df = std::min({item_work, load[it.owner] - mean, deficit});
      if (df <= 0) continue;
      int64_t m = 0;
      if (df < item_work) {
        const double per_token = cost.pair_seconds(it.lo + it.hi + 1);
        m = std::max<int64_t>(g, std::llround(df / per_token / static_cast<double>(g)) * g);
        if (2 * m >= it.hi - it.lo) m = 0;
      }
      const int64_t rows = m == 0 ? it.hi - it.lo : 2 * m;
      const double bytes = static_cast<double>(rows * tb.q + it.hi * tb.kv);
      const double priority = df / bytes;
      if (priority > best_priority) {
        best = i;
        best_priority = priority;
        best_m = m;
      }
    }
    if (best < 0) {
      is_exhausted[dst] = true;
      continue;
    }

    // 3. Move it.
    Item& it = items[best];
    const double before = work(it.lo, it.hi);
    if (best_m == 0) {
      moved.push_back(causal_task(it.doc, it.lo, it.hi, dst));
      load[dst] += before;
      it.lo = it.hi;
    } else {
      moved.push_back(causal_task(it.doc, it.lo, it.lo + best_m, dst));
      moved.push_back(causal_task(it.doc, it.hi - best_m, it.hi, dst));
      load[dst] += work(it.lo, it.lo + best_m) + work(it.hi - best_m, it.hi);
      it.lo += best_m;
      it.hi -= best_m;
    }
    load[it.owner] -= before - work(it.lo, it.hi);
  }

  std::vector<Task> tasks = std::move(moved);
  for (const Item& it : items) {
    if (it.lo < it.hi) tasks.push_back(causal_task(it.doc, it.lo, it.hi, it.owner));
  }
  Plan plan = finalize_plan("distca", options.tolerance, batch, cost, std::move(tasks));
  if (!plan.is_balanced) {
    plan.note = fmt::format(
        "receivers are within {:.3g} of the mean, but eps does not bound the senders: max = "
        "{:.4f} x mean",
        options.tolerance, plan.load.imbalance);
  }
  return plan;
}

}  // namespace distca::plan
