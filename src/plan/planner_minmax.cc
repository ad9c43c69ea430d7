// minmax: our balancer. It guarantees max load <= (1 + eps) * mean whenever the largest
// indivisible shard fits in the slack (see `is_guaranteed` below), and among the moves that
// balance it takes the fewest bytes.
//
// Work is cut into shards [k*g, (k+1)*g) of each document (the last one shorter). A run is a
// contiguous range of shards of one document on one server, and it is one task.
//   1. Each run starts at home: shard k on the rank that holds its first row.
//   2. cap = (1 + eps) * mean_lb, where mean_lb is the mean load with every document as one
//      task: no split can lower the true mean below it, so max <= cap implies the bound.
//   3. For each server above cap, heaviest first, until it is at or below cap: cut a slice of
//      whole shards off the front or the back of one of its runs (so every run stays one task)
//      and give it to a server below cap, as large as needed to clear the excess but never
//      pushing the receiver above cap. Among the candidates (its heaviest runs x front/back x
//      receivers: the one with most room, the document's other owners, and servers that
//      already hold this document's keys) take the fewest estimated bytes per second of work
//      moved. Keys already sent to or owned by the receiver cost nothing.
//   4. A slice that lands next to a run of the same document on the receiver merges into it.
// With a per-rank byte budget, a candidate that would push any rank's forward send or receive
// bytes (an upper bound, tracked per move) over the budget is skipped; with a per-server memory
// cap (memory_cap.h), one that would take the receiver's rows (Plan::server_bytes, an upper
// bound: a sender's key prefix is counted as kept) over the cap.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "budget.h"
#include "memory_cap.h"
#include "distca/plan/planner.h"

namespace distca::plan {
namespace {

struct Run {
  int32_t doc;
  int64_t lo;
  int64_t hi;
  int32_t server;
  bool is_alive() const { return lo < hi; }
};

// A candidate move: the slice [a, b) off the front or back of a run, to server dst, and its score.
struct SliceMove {
  int32_t run = -1;
  bool is_front = true;
  int64_t a = 0;  // slice [a, b)
  int64_t b = 0;
  int32_t dst = -1;
  double score = 0;  // bytes per second of work moved
};

class MinmaxPlanner {
 public:
  MinmaxPlanner(const Batch& batch, const CostModel& cost, const PlannerOptions& options)
      : batch_(batch), cost_(cost), options_(options), g_(options.granularity),
        num_ranks_(batch.num_ranks), load_(num_ranks_, 0.0), server_runs_(num_ranks_),
        room_key_(num_ranks_, -1.0), kv_need_(batch.num_docs()), memory_cap_(std::max<int64_t>(0, options.max_server_bytes)),
        memory_(num_ranks_, 0), q_held_(cost.token_bytes().q + cost.token_bytes().out), kv_held_(cost.token_bytes().kv) {}

  Plan run() {
    place_home_runs();
    double lower_total = 0;
    double largest_shard = 0;
    for (int32_t d = 0; d < batch_.num_docs(); ++d) {
      const int64_t length = batch_.doc_lengths[d];
      lower_total += seconds(0, length);
      const int64_t last_start = ((length - 1) / g_) * g_;
      largest_shard = std::max(largest_shard, seconds(last_start, length));
      if (last_start > 0) largest_shard = std::max(largest_shard, seconds(last_start - g_, last_start));
    }
    const double mean_lb = lower_total / num_ranks_;
    cap_ = (1.0 + options_.tolerance) * mean_lb;
    if (options_.max_rank_bytes > 0) start_budget();

    for (int32_t s = 0; s < num_ranks_; ++s) update_room(s);
    std::vector<int32_t> sources;
    for (int32_t s = 0; s < num_ranks_; ++s) {
      if (load_[s] > cap_) sources.push_back(s);
    }
    std::stable_sort(sources.begin(), sources.end(),
                     [&](int32_t a, int32_t b) { return load_[a] > load_[b]; });
    for (int32_t s : sources) shed(s);

    std::vector<Task> tasks;
    for (const Run& run : runs_) {
      if (run.is_alive()) tasks.push_back(causal_task(run.doc, run.lo, run.hi, run.server));
    }
    Plan plan = finalize_plan("minmax", options_.tolerance, batch_, cost_, std::move(tasks));
    // The greedy always finds a receiver while a server with room for any shard exists, which
    // the slack guarantees when the largest shard fits in it.
    plan.is_guaranteed = options_.max_rank_bytes == 0 && largest_shard <= cap_ - plan.load.mean;
    if (options_.max_rank_bytes > 0) {
      const auto& fwd = plan.traffic.forward;
      plan.is_within_budget = is_budget_feasible_ && fwd.max_send_bytes <= options_.max_rank_bytes &&
                              fwd.max_recv_bytes <= options_.max_rank_bytes;
    }
    if (!plan.is_balanced) {
      plan.note = "bound not met";
      if (!stuck_.empty()) {
        // The busiest server of the finished plan, which need not be the first that got stuck.
        const auto busiest = static_cast<int32_t>(std::max_element(load_.begin(), load_.end()) - load_.begin());
        const bool was_stuck = std::find(stuck_.begin(), stuck_.end(), busiest) != stuck_.end();
        plan.note = fmt::format("the busiest server, {}, stays at {:.4f} x cap: {}{}", busiest, load_[busiest] / cap_,
                                was_stuck ? "no server has room for a shard of its work" : "the planner ran out of moves",
                                was_stuck && options_.max_rank_bytes > 0 ? " within --max-rank-bytes"
                                : was_stuck && memory_cap_ > 0           ? " within the memory cap"
                                                                         : "");
      }
      plan.note += fmt::format("; largest indivisible shard = {:.4f} x mean", largest_shard / plan.load.mean);
    } else {
      plan.note = plan.is_guaranteed ? "bound guaranteed: the largest shard fits in the slack"
                                : "bound met";
    }
    if (!plan.is_within_budget) plan.note += "; " + budget_failure_;
    if (memory_cap_ > 0) {
      plan.memory_cap = memory_cap_;
      plan.is_within_memory = *std::max_element(plan.server_bytes.begin(), plan.server_bytes.end()) <= memory_cap_;
    }
    return plan;
  }

 private:
  double seconds(int64_t lo, int64_t hi) const {
    return hi > lo ? cost_.task_seconds(hi - lo, causal_pairs(lo, hi), hi) : 0.0;
  }
  int64_t align_up(int64_t x) const { return (x + g_ - 1) / g_ * g_; }

  // 1. Shard k at home: the rank holding its first row.
  void place_home_runs() {
    for (int32_t d = 0; d < batch_.num_docs(); ++d) {
      const int64_t length = batch_.doc_lengths[d];
      for (int32_t i : batch_.doc_pieces[d]) {
        const Piece& p = batch_.pieces[i];
        const int64_t lo = align_up(p.begin);
        const int64_t hi = std::min(length, align_up(p.end));
        if (lo < hi) add_run(Run{d, lo, hi, p.rank});
      }
    }
  }

  void add_run(const Run& run) {
    server_runs_[run.server].push_back(static_cast<int32_t>(runs_.size()));
    runs_.push_back(run);
    load_[run.server] += seconds(run.lo, run.hi);
    memory_[run.server] += memory_added(run.doc, run.lo, run.hi, run.server);
    raise_kv_need(run.doc, run.server, run.hi);
  }
  // What rows [a, b) of `doc` (keys [0, b)) add to `server`'s memory.
  int64_t memory_added(int32_t doc, int64_t a, int64_t b, int32_t server) const {
    return (b - a) * q_held_ + std::max<int64_t>(0, b - kv_need(doc, server)) * kv_held_;
  }
  bool fits_memory(int32_t doc, int64_t a, int64_t b, int32_t dst) const {
    return memory_cap_ == 0 || memory_[dst] + memory_added(doc, a, b, dst) <= memory_cap_;
  }

  int64_t kv_need(int32_t doc, int32_t server) const {
    for (const auto& [s, hi] : kv_need_[doc]) {
      if (s == server) return hi;
    }
    return 0;
  }
  void raise_kv_need(int32_t doc, int32_t server, int64_t hi) {
    for (auto& [s, h] : kv_need_[doc]) {
      if (s == server) {
        h = std::max(h, hi);
        return;
      }
    }
    kv_need_[doc].emplace_back(server, hi);
  }

  // The room set orders servers below cap by room, largest first.
  void update_room(int32_t s) {
    if (room_key_[s] >= 0) rooms_.erase({-room_key_[s], s});
    const double room = cap_ - load_[s];
    room_key_[s] = room > 0 ? room : -1.0;
    if (room > 0) rooms_.insert({-room, s});
  }
  double room(int32_t s) const { return cap_ - load_[s]; }

  // Forward flows of moving [a, b) of `doc` to `dst`: Q out and O back for rows dst does not
  // own, plus keys dst neither owns nor already needs. Calls fn(src, dst, bytes).
  template <typename Fn>
  void for_each_flow(int32_t doc, int64_t a, int64_t b, int32_t dst, Fn&& fn) const {
    const TokenBytes& tb = cost_.token_bytes();
    for_each_owner(batch_, doc, a, b, [&](int32_t owner, int64_t rows) {
      if (owner == dst) return;
      fn(owner, dst, rows * tb.q);
      fn(dst, owner, rows * tb.out);
    });
    const int64_t have = kv_need(doc, dst);
    if (b > have) {
      for_each_owner(batch_, doc, have, b, [&](int32_t owner, int64_t rows) {
        if (owner != dst) fn(owner, dst, rows * tb.kv);
      });
    }
  }

  void start_budget() {
    std::vector<Task> tasks;
    for (const Run& run : runs_) tasks.push_back(causal_task(run.doc, run.lo, run.hi, run.server));
    forward_rank_bytes(batch_, cost_.token_bytes(), tasks, send_, recv_);
    // The note names the rank furthest over the budget, not merely the first.
    int32_t worst = -1;
    for (int32_t k = 0; k < num_ranks_; ++k) {
      if (worst < 0 || std::max(send_[k], recv_[k]) > std::max(send_[worst], recv_[worst])) worst = k;
    }
    if (worst >= 0 && std::max(send_[worst], recv_[worst]) > options_.max_rank_bytes) {
      is_budget_feasible_ = false;
      budget_failure_ = fmt::format(
          "infeasible budget: rank {} already sends {} and receives {} bytes before balancing (the most of any rank), "
          "more than --max-rank-bytes {}",
          worst, send_[worst], recv_[worst], options_.max_rank_bytes);
    }
  }

  bool fits_budget(int32_t doc, int64_t a, int64_t b, int32_t dst) const {
    if (options_.max_rank_bytes == 0) return true;
    // Sum per rank before comparing: one rank may appear in several flows.
    std::vector<std::pair<int32_t, int64_t>> sends, recvs;
    for_each_flow(doc, a, b, dst, [&](int32_t src, int32_t to, int64_t bytes) {
      sends.emplace_back(src, bytes);
      recvs.emplace_back(to, bytes);
    });
    return !exceeds_budget(sends, send_, options_.max_rank_bytes) && !exceeds_budget(recvs, recv_, options_.max_rank_bytes);
  }

  // The slice of `run` to cut from one end: the fewest whole shards whose removal clears
  // `excess`, or if that does not fit in `room`, the most that fit. Empty if no shard fits.
  std::pair<int64_t, int64_t> choose_slice(const Run& run, bool is_front, double excess, double room) const {
    const int64_t num_shards = (run.hi - run.lo + g_ - 1) / g_;
    const double whole = seconds(run.lo, run.hi);
    auto slice = [&](int64_t k) -> std::pair<int64_t, int64_t> {
      if (is_front) return {run.lo, std::min(run.hi, run.lo + k * g_)};
      return {k == num_shards ? run.lo : run.lo + (num_shards - k) * g_, run.hi};
    };
    auto shed = [&](int64_t k) {  // load the source loses
      const auto [a, b] = slice(k);
      return is_front ? whole - seconds(b, run.hi) : whole - seconds(run.lo, a);
    };
    auto added = [&](int64_t k) {
      const auto [a, b] = slice(k);
      return seconds(a, b);
    };
    // Smallest k with shed(k) >= excess (num_shards if none).
    int64_t lo = 1, hi = num_shards;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (shed(mid) >= excess) hi = mid; else lo = mid + 1;
    }
    int64_t k = lo;
    if (added(k) > room) {
      // Largest k with added(k) <= room.
      int64_t a = 0, b = k - 1;
      while (a < b) {
        const int64_t mid = (a + b + 1) / 2;
        if (added(mid) <= room) a = mid; else b = mid - 1;
      }
      k = a;
    }
    if (k == 0) return {0, 0};
    return slice(k);
  }

  void consider(int32_t run_id, int32_t dst, double excess, SliceMove& best) {
    const Run& run = runs_[run_id];
    if (dst == run.server) return;
    const double dst_room = room(dst);
    if (dst_room <= 0) return;
    for (bool is_front : {true, false}) {
      const auto [a, b] = choose_slice(run, is_front, excess, dst_room);
      if (a >= b) continue;
      double bytes = 0;
      for_each_flow(run.doc, a, b, dst, [&](int32_t, int32_t, int64_t n) { bytes += static_cast<double>(n); });
      const double score = bytes / seconds(a, b);
      if (best.run >= 0 && score >= best.score) continue;
      if (!fits_budget(run.doc, a, b, dst) || !fits_memory(run.doc, a, b, dst)) continue;
      best = SliceMove{run_id, is_front, a, b, dst, score};
    }
  }

  // 3. Moves slices off server s until it is at or below cap.
  void shed(int32_t s) {
    constexpr size_t kTopRuns = 4;
    constexpr size_t kMaxReceivers = 8;
    std::vector<int32_t> top;
    std::vector<int32_t> receivers;
    while (load_[s] > cap_) {
      const double excess = load_[s] - cap_;
      top.clear();
      for (int32_t id : server_runs_[s]) {
        if (runs_[id].is_alive() && runs_[id].server == s) top.push_back(id);
      }
      std::stable_sort(top.begin(), top.end(), [&](int32_t a, int32_t b) {
        return seconds(runs_[a].lo, runs_[a].hi) > seconds(runs_[b].lo, runs_[b].hi);
      });
      SliceMove best;
      const int32_t roomiest = rooms_.empty() ? -1 : rooms_.begin()->second;
      for (size_t i = 0; i < std::min(top.size(), kTopRuns); ++i) {
        const Run& run = runs_[top[i]];
        receivers.clear();
        if (roomiest >= 0) receivers.push_back(roomiest);
        for (int32_t p : batch_.doc_pieces[run.doc]) receivers.push_back(batch_.pieces[p].rank);
        for (const auto& [server, hi] : kv_need_[run.doc]) receivers.push_back(server);
        if (receivers.size() > kMaxReceivers) receivers.resize(kMaxReceivers);
        std::sort(receivers.begin(), receivers.end());
        receivers.erase(std::unique(receivers.begin(), receivers.end()), receivers.end());
        for (int32_t dst : receivers) consider(top[i], dst, excess, best);
      }
      // Nothing among the heaviest runs fits: try every run against the roomiest server.
      for (size_t i = kTopRuns; best.run < 0 && roomiest >= 0 && i < top.size(); ++i) {
        consider(top[i], roomiest, excess, best);
      }
      if (best.run < 0) {
        stuck_.push_back(s);
        return;
      }
      apply(best);
    }
  }

  void apply(const SliceMove& c) {
    if (options_.max_rank_bytes > 0) {
      for_each_flow(runs_[c.run].doc, c.a, c.b, c.dst, [&](int32_t src, int32_t to, int64_t bytes) {
        send_[src] += bytes;
        recv_[to] += bytes;
      });
    }
    Run& run = runs_[c.run];
    const int32_t src = run.server;
    const int32_t doc = run.doc;
    load_[src] -= seconds(run.lo, run.hi);
    memory_[src] -= (c.b - c.a) * q_held_;
    if (c.is_front) run.lo = c.b; else run.hi = c.a;
    load_[src] += seconds(run.lo, run.hi);

    // 4. Merge with adjacent runs of the same document on the receiver.
    int64_t a = c.a, b = c.b;
    for (int32_t id : server_runs_[c.dst]) {
      Run& other = runs_[id];
      if (!other.is_alive() || other.doc != doc || other.server != c.dst) continue;
      if (other.hi == a || other.lo == b) {
        load_[c.dst] -= seconds(other.lo, other.hi);
        memory_[c.dst] -= (other.hi - other.lo) * q_held_;  // counted again with the merged run
        a = std::min(a, other.lo);
        b = std::max(b, other.hi);
        other.lo = other.hi;  // absorbed
      }
    }
    add_run(Run{doc, a, b, c.dst});
    update_room(src);
    update_room(c.dst);
  }

  const Batch& batch_;
  const CostModel& cost_;
  const PlannerOptions& options_;
  const int64_t g_;
  const int32_t num_ranks_;
  double cap_ = 0;
  std::vector<Run> runs_;
  std::vector<double> load_;                        // (R) seconds
  std::vector<std::vector<int32_t>> server_runs_;   // (R) run ids, dead ones included
  std::set<std::pair<double, int32_t>> rooms_;      // (-room, server) for servers below cap
  std::vector<double> room_key_;                    // (R) room as stored in rooms_, or -1
  std::vector<std::vector<std::pair<int32_t, int64_t>>> kv_need_;  // (docs) (server, key end)
  std::vector<int64_t> send_, recv_;                // (R) forward bytes, upper bounds
  bool is_budget_feasible_ = true;
  std::vector<int32_t> stuck_;  // servers left above the cap with no receiver for their work
  std::string budget_failure_ = "per-rank byte budget exceeded";
  const int64_t memory_cap_;             // per server (0: none)
  std::vector<int64_t> memory_;          // (R) bytes held, an upper bound of server_bytes
  const int64_t q_held_, kv_held_;       // a query row's and a key row's bytes held
};

}  // namespace

Result<Plan> plan_minmax(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  return plan_within_memory(batch, cost, options, [&](const PlannerOptions& o) -> Result<Plan> {
    return MinmaxPlanner(batch, cost, o).run();
  });
}

}  // namespace distca::plan
