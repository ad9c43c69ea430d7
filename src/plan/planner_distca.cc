// The DistCA paper's communication-aware greedy scheduler, reproduced faithfully from the
// authors' planner: hao-ai-lab/distca, distca/planner/planner.py at d7cef32 (Item.get_flops,
// Item.get_priority, Item.split_item, Planner.plan_items). On whole even-length documents it
// makes the same moves in the same order; tests/plan/planner_fidelity_test.cc checks it against
// the reference's own output on four batches.
//
// Work is counted in causal (query, key) pairs, the reference's "flops" (our CostModel's
// seconds are used only to report the plan). With mean = total pairs / R, every server has
// surplus = pairs - mean.
//   1. Receivers are the servers with surplus < 0, visited once each, most negative first
//      (ties: lower rank first; Python's stable sort). A receiver needs -surplus; it is filled
//      while need > eps * mean. eps bounds nothing else: donors may stay far above the mean, and
//      a receiver is given up early (below).
//   2. Candidates are the items (unmoved parts of pieces, or shards moved earlier) on servers
//      with surplus > 0, in list order. Each has
//        f        = min(donor surplus, need, item pairs)
//        priority = (f / (L + 1) * Q bytes + (L + 1) * K/V bytes) / f      (lower is better)
//      with L the whole document's length: the K/V of the whole document is charged whatever
//      part moves. The lowest priority wins; ties go to the earliest item in the list.
//   3. The winner moves whole if f >= its pairs. Otherwise m = floor(f / (L + 1)) rows are cut
//      from the *inner* edges of its head and tail: the head keeps [lo, h - m), the tail keeps
//      [t + m, hi), and [h - m, h) + [t, t + m) move, whose work is m * (h + t + 1) =
//      m * (L + 1) pairs. A whole document starts with h = t = ceil(L / 2), so its first cut
//      takes the middle 2m rows. There is no granularity: m may be any number of rows >= 1
//      (options.granularity is ignored). If m = 0 the receiver is given up, with its need
//      still above eps * mean (the reference's "could not move any FLOPs" break). A moved
//      shard becomes a new item at the end of the list.
//   4. A receiver is also given up when no server has a surplus left.
// The output has one task per chunk of the reference: one for an item never cut, else one per
// non-empty range; a moved pair is two tasks even where its two ranges touch.
//
// Beyond the reference (which takes whole documents whose lengths are even): a piece of a
// document that spans ranks is an item [lo, hi) with h = t = lo + ceil((hi - lo) / 2), and
// its cut is m = floor(f / (h + t + 1)) rows moving m * (h + t + 1) pairs, which for a whole
// even document is the reference's rule; for odd lengths (where the reference asserts) the
// tail may run out one row before the head, and the work moved is still exact.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "distca/core/check.h"
#include "distca/plan/planner.h"

namespace distca::plan {
namespace {

// The reference's Item: rows [lo, h) (head) and [t, hi) (tail) of document `doc` on `server`.
// A complete item (a piece never cut) is one chunk [lo, hi) with h = t; any other is two.
struct Item {
  int32_t doc;
  int32_t server;
  int64_t lo, h, t, hi;
  bool complete;
  int64_t pairs;  // total_flops

  int64_t count_pairs() const { return causal_pairs(lo, h) + causal_pairs(t, hi); }
};

Item make_item(int32_t doc, int32_t server, int64_t lo, int64_t h, int64_t t, int64_t hi,
               bool complete) {
  Item it{doc, server, lo, h, t, hi, complete, 0};
  it.pairs = it.count_pairs();
  return it;
}

}  // namespace

Result<Plan> plan_distca(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  const int32_t r = batch.num_ranks;
  const TokenBytes& tb = cost.token_bytes();

  std::vector<Item> items;
  for (const Piece& p : batch.pieces) {
    const int64_t mid = p.begin + (p.length() + 1) / 2;
    items.push_back(make_item(p.doc, p.rank, p.begin, mid, mid, p.end, true));
  }

  // Surplus (> 0) or deficit (< 0) of every server, in pairs, as the reference's floats.
  std::vector<double> surplus(r, 0.0);
  for (const Item& it : items) surplus[it.server] += static_cast<double>(it.pairs);
  const double total = std::accumulate(surplus.begin(), surplus.end(), 0.0);
  const double mean = total / r;
  for (double& s : surplus) s -= mean;
  const double threshold = mean * options.tolerance;

  std::vector<int32_t> receivers;
  for (int32_t s = 0; s < r; ++s) {
    if (surplus[s] < 0) receivers.push_back(s);
  }
  std::stable_sort(receivers.begin(), receivers.end(),
                   [&](int32_t a, int32_t b) { return surplus[a] < surplus[b]; });
  // Candidates lie only on servers with a surplus, and a server does not gain one: donors only
  // give, and a receiver takes at most its need (a moved item or shard lands on it). So only the
  // items on donors are scanned, a list that only loses items. Each has a floor under its
  // priority whatever the need and the donor's surplus (f <= pairs):
  //   floor = Q / (L + 1) + (L + 1) K / pairs,
  // and an item cut later has fewer pairs, so a higher floor: the floor taken when the list is
  // made stays a floor. The scan goes through the list by floor and stops where the floor passes
  // the best priority found (with a margin far above rounding), so it finds the same winner
  // (ties: the earliest in list order) as a scan of every item, which made a plan O(R x items)
  // (the paper's planner at 16,384 ranks: 88 % of distca simulate --gpus 131072). Items found on
  // a server with no surplus left are skipped from then on (skip: path-compressed links to the
  // next entry that may be live). A receiver that rounding leaves a hair above the mean becomes a
  // donor: the list is made again.
  struct Candidate {
    double floor;
    int64_t item;
  };
  std::vector<Candidate> on_donors;
  std::vector<size_t> skip;  // skip[j] == j: entry j may be live; else an entry after it to look at
  auto collect_donor_items = [&] {
    on_donors.clear();
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      const Item& it = items[i];
      if (!(surplus[it.server] > 0)) continue;
      const auto kv_len = static_cast<double>(batch.doc_lengths[it.doc] + 1);
      const double floor = it.pairs > 0 ? static_cast<double>(tb.q) / kv_len +
                                              kv_len * static_cast<double>(tb.kv) / static_cast<double>(it.pairs)
                                        : std::numeric_limits<double>::infinity();
      on_donors.push_back({floor, i});
    }
    std::sort(on_donors.begin(), on_donors.end(), [](const Candidate& a, const Candidate& b) {
      return a.floor < b.floor || (a.floor == b.floor && a.item < b.item);
    });
    skip.resize(on_donors.size() + 1);
    for (size_t j = 0; j < skip.size(); ++j) skip[j] = j;
  };
  auto next_live = [&](size_t j) {  // the first entry >= j not known to be dead
    size_t r = j;
    while (skip[r] != r) r = skip[r];
    while (skip[j] != j) {
      const size_t after = skip[j];
      skip[j] = r;
      j = after;
    }
    return r;
  };
  constexpr double kFloorMargin = 1e-9;  // relative; the floor's rounding is ~1e-16
  collect_donor_items();

  int32_t num_given_up = 0;  // receivers left with need > eps * mean
  for (const int32_t dst : receivers) {
    double need = -surplus[dst];
    while (need > threshold) {
      // 2. The candidate with the lowest bytes per pair; the first in list order on ties.
      int64_t best = -1;
      double best_priority = 0;
      double best_flops = 0;
      for (size_t j = next_live(0); j < on_donors.size(); j = next_live(j + 1)) {
        const Candidate& c = on_donors[j];
        if (best >= 0 && c.floor > best_priority * (1 + kFloorMargin)) break;  // the rest are no better
        const int64_t i = c.item;
        const Item& it = items[i];
        const double donor_surplus = surplus[it.server];
        if (!(donor_surplus > 0)) {  // its server gave all its surplus (or it moved): never again
          skip[j] = j + 1;
          continue;
        }
        if (it.pairs <= 0) continue;
        const double f = std::min({donor_surplus, need, static_cast<double>(it.pairs)});
        const int64_t kv_len = batch.doc_lengths[it.doc] + 1;
        const double q_len = f / static_cast<double>(kv_len);
        const double volume = q_len * static_cast<double>(tb.q) + static_cast<double>(kv_len * tb.kv);
        const double priority = volume / f;
        if (best < 0 || priority < best_priority || (priority == best_priority && i < best)) {
          best = i;
          best_priority = priority;
          best_flops = f;
        }
      }
      if (best < 0) break;  // no server has a surplus left

      // 3. Move it whole, or cut m rows from the inner edges of its head and tail.
      Item& it = items[best];
      const int32_t donor = it.server;
      int64_t moved = 0;
      if (best_flops >= static_cast<double>(it.pairs)) {
        moved = it.pairs;
        it.server = dst;
      } else {
        const int64_t per_row = it.h + it.t + 1;  // L + 1 for a whole document
        const auto m = static_cast<int64_t>(best_flops / static_cast<double>(per_row));
        if (m <= 0) break;
        DISTCA_CHECK(m < it.h - it.lo && m <= it.hi - it.t) << "cut of " << m << " rows";
        Item shard = make_item(it.doc, dst, it.h - m, it.h, it.t, it.t + m, false);
        it.h -= m;
        it.t += m;
        it.complete = false;
        it.pairs = it.count_pairs();
        moved = m * per_row;
        DISTCA_CHECK(shard.pairs == moved) << shard.pairs << " pairs moved, expected " << moved;
        items.push_back(shard);
      }
      surplus[donor] -= static_cast<double>(moved);
      surplus[dst] += static_cast<double>(moved);
      need -= static_cast<double>(moved);
      if (surplus[dst] > 0) collect_donor_items();
    }
    if (need > threshold) ++num_given_up;
  }

  std::vector<Task> tasks;
  for (const Item& it : items) {
    if (it.complete) {
      tasks.push_back(causal_task(it.doc, it.lo, it.hi, it.server));
      continue;
    }
    if (it.lo < it.h) tasks.push_back(causal_task(it.doc, it.lo, it.h, it.server));
    if (it.t < it.hi) tasks.push_back(causal_task(it.doc, it.t, it.hi, it.server));
  }
  Plan plan = finalize_plan("distca", options.tolerance, batch, cost, std::move(tasks));
  if (!plan.is_balanced) {
    plan.note = fmt::format(
        "the paper's planner: eps bounds the receivers, not the senders: max = {:.4f} x mean "
        "({:.4f} x in causal pairs)",
        plan.load.imbalance, plan.load.pairs_imbalance);
    if (num_given_up > 0) {
      plan.note += fmt::format(
          "; {} of {} receivers given up more than {:.3g} below the mean (the best item could not "
          "move one row pair)",
          num_given_up, receivers.size(), options.tolerance);
    }
  }
  return plan;
}

}  // namespace distca::plan
