#include "distca/plan/plan.h"

#include <algorithm>
#include <tuple>

#include "distca/core/check.h"

namespace distca::plan {

int64_t Task::pairs() const {
  if (is_causal()) return causal_pairs(q0, q1) - k0 * (q1 - q0);
  return (q1 - q0) * (k1 - k0);
}

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kFwdDispatch: return "fwd_dispatch";
    case Phase::kFwdReturn: return "fwd_return";
    case Phase::kBwdDispatch: return "bwd_dispatch";
    case Phase::kBwdReturn: return "bwd_return";
  }
  return "?";
}

const char* backward_mode_name(BackwardMode mode) {
  return mode == BackwardMode::kStateful ? "stateful" : "stateless";
}

LinkSummary busiest_links(const Traffic& traffic) {
  LinkSummary s;
  for (int ph = 0; ph < kNumPhases; ++ph) {
    const PhaseTraffic& t = traffic.phases[ph];
    for (size_t r = 0; r < t.send_bytes.size(); ++r) {
      s.busiest[ph] = std::max({s.busiest[ph], t.send_bytes[r], t.recv_bytes[r]});
    }
    s.step += s.busiest[ph];
  }
  s.fwd_dispatch = s.busiest[static_cast<int>(Phase::kFwdDispatch)];
  return s;
}

namespace {

// Index of the other backward mode's backward dispatch, for for_each_transfer<true>.
constexpr int kOtherBwdDispatch = kNumPhases;

// Every transfer of a layer's four phases, as fn(phase, src, dst, bytes), src != dst; and the
// forward dispatch's Q, K/V and O bytes into `fwd`. With kOtherMode, also the backward dispatch
// of the other backward mode, as phase kOtherBwdDispatch.
template <bool kOtherMode = false, typename Fn>
void for_each_transfer(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks, BackwardMode mode,
                       CommSummary& fwd, Fn&& fn) {
  const bool is_stateless = mode == BackwardMode::kStateless;
  constexpr int kDispatch = static_cast<int>(Phase::kFwdDispatch), kReturn = static_cast<int>(Phase::kFwdReturn);
  constexpr int kBwdDispatch = static_cast<int>(Phase::kBwdDispatch), kBwdReturn = static_cast<int>(Phase::kBwdReturn);
  // 1. Query-side rows: from their owners to each task's server and back (a row in several
  //    tasks, a key-range split, travels once per task). Stateful, the rows of a split task
  //    (k0 > 0 or non-causal: each of its rows is in several tasks) also carry the final O and
  //    LSE to the server, whose own are partial.
  // A task whose document lies whole on its server moves nothing (most tasks of a plan).
  auto is_local = [&](const Task& t) {
    const auto& pieces = batch.doc_pieces[t.doc];
    return pieces.size() == 1 && batch.pieces[pieces[0]].rank == t.server;
  };
  for (const Task& t : tasks) {
    if (is_local(t)) continue;
    const bool is_split = t.k0 > 0 || !t.is_causal();
    const int64_t stateful_q = bytes.bwd_do + (is_split ? bytes.out : 0);
    const int64_t bwd_q = is_stateless ? bytes.bwd_q : stateful_q;
    for_each_owner(batch, t.doc, t.q0, t.q1, [&](int32_t owner, int64_t rows) {
      if (owner == t.server) return;
      fn(kDispatch, owner, t.server, rows * bytes.q);
      fn(kReturn, t.server, owner, rows * bytes.out);
      fn(kBwdDispatch, owner, t.server, rows * bwd_q);
      if constexpr (kOtherMode) fn(kOtherBwdDispatch, owner, t.server, rows * (is_stateless ? stateful_q : bytes.bwd_q));
      fn(kBwdReturn, t.server, owner, rows * bytes.bwd_dq);
      fwd.q_bytes += rows * bytes.q;
      fwd.out_bytes += rows * bytes.out;
    });
  }

  // 2. Key/value rows: once per (document, server), the union of that server's key ranges.
  auto send_kv = [&](int32_t doc, int32_t server, int64_t k0, int64_t k1) {
    for_each_owner(batch, doc, k0, k1, [&](int32_t owner, int64_t rows) {
      if (owner == server) return;
      fn(kDispatch, owner, server, rows * bytes.kv);
      if (is_stateless) fn(kBwdDispatch, owner, server, rows * bytes.kv);
      if constexpr (kOtherMode) {
        if (!is_stateless) fn(kOtherBwdDispatch, owner, server, rows * bytes.kv);
      }
      fn(kBwdReturn, server, owner, rows * bytes.bwd_dkv);
      fwd.kv_bytes += rows * bytes.kv;
    });
  };
  // Tasks grouped by (server, document), as finalize_plan orders them: each group's ranges sorted
  // on their own; else all of them at once.
  std::vector<std::tuple<int32_t, int32_t, int64_t, int64_t>> ranges;  // (doc, server, k0, k1)
  ranges.reserve(tasks.size());
  for (const Task& t : tasks) {
    if (!is_local(t)) ranges.emplace_back(t.doc, t.server, t.k0, t.k1);
  }
  const auto group = [](const auto& a, const auto& b) {
    return std::tie(std::get<1>(a), std::get<0>(a)) < std::tie(std::get<1>(b), std::get<0>(b));
  };
  if (std::is_sorted(ranges.begin(), ranges.end(), group)) {
    for (size_t i = 0; i < ranges.size();) {
      size_t j = i + 1;
      while (j < ranges.size() && !group(ranges[i], ranges[j])) ++j;
      std::sort(ranges.begin() + static_cast<std::ptrdiff_t>(i), ranges.begin() + static_cast<std::ptrdiff_t>(j));
      i = j;
    }
  } else {
    std::sort(ranges.begin(), ranges.end());
  }
  for (size_t i = 0; i < ranges.size();) {
    auto [doc, server, k0, k1] = ranges[i];
    size_t j = i + 1;
    for (; j < ranges.size() && std::get<0>(ranges[j]) == doc && std::get<1>(ranges[j]) == server; ++j) {
      const auto [d2, s2, a, b] = ranges[j];
      if (a > k1) {
        send_kv(doc, server, k0, k1);
        k0 = a;
        k1 = b;
      } else {
        k1 = std::max(k1, b);
      }
    }
    send_kv(doc, server, k0, k1);
    i = j;
  }
}

}  // namespace

Traffic count_traffic(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks,
                      BackwardMode mode) {
  const int32_t r = batch.num_ranks;
  Traffic traffic;
  for (PhaseTraffic& t : traffic.phases) {
    t.send_bytes.assign(r, 0);
    t.recv_bytes.assign(r, 0);
  }
  CommSummary fwd;
  std::vector<int64_t> other_send(r, 0), other_recv(r, 0);  // the other mode's backward dispatch
  int64_t other_total = 0;
  // Summed per rank as they come (for_each_transfer gives no self transfers): the flows, which
  // may number R^2, are never held (count_flows).
  for_each_transfer<true>(batch, bytes, tasks, mode, fwd, [&](int phase, int32_t src, int32_t dst, int64_t n) {
    if (phase < kNumPhases) {
      PhaseTraffic& t = traffic.phases[phase];
      t.send_bytes[src] += n;
      t.recv_bytes[dst] += n;
      t.total_bytes += n;
    } else {
      other_send[src] += n;
      other_recv[dst] += n;
      other_total += n;
    }
  });
  const int counted = static_cast<int>(mode), other = 1 - counted;
  LinkSummary& links = traffic.links[counted];
  links = busiest_links(traffic);
  for (const PhaseTraffic& t : traffic.phases) traffic.all_phases_bytes[counted] += t.total_bytes;
  constexpr int kBwd = static_cast<int>(Phase::kBwdDispatch);
  LinkSummary& alt = traffic.links[other];
  alt = links;
  alt.busiest[kBwd] = 0;
  for (int32_t k = 0; k < r; ++k) alt.busiest[kBwd] = std::max({alt.busiest[kBwd], other_send[k], other_recv[k]});
  alt.step = links.step - links.busiest[kBwd] + alt.busiest[kBwd];
  traffic.all_phases_bytes[other] = traffic.all_phases_bytes[counted] - traffic.phases[kBwd].total_bytes + other_total;
  const auto& d = traffic.phases[static_cast<int>(Phase::kFwdDispatch)];
  const auto& ret = traffic.phases[static_cast<int>(Phase::kFwdReturn)];
  fwd.total_bytes = d.total_bytes + ret.total_bytes;
  for (int32_t k = 0; k < r; ++k) {
    fwd.max_send_bytes = std::max(fwd.max_send_bytes, d.send_bytes[k] + ret.send_bytes[k]);
    fwd.max_recv_bytes = std::max(fwd.max_recv_bytes, d.recv_bytes[k] + ret.recv_bytes[k]);
  }
  traffic.forward = fwd;
  return traffic;
}

namespace {

// Accumulates (src, dst, bytes) entries of one phase and folds them into flows: bucketed by
// sender (a counting sort), then each sender's few entries sorted by receiver. (A sort of all
// entries by (src, dst) was three quarters of counting the flows at 512 ranks.)
class FlowAccumulator {
 public:
  explicit FlowAccumulator(int32_t num_ranks) : num_ranks_(num_ranks) {}
  void add(int32_t src, int32_t dst, int64_t bytes) {
    if (src != dst && bytes > 0) entries_.push_back(Entry{src, dst, bytes});
  }
  std::vector<Flow> fold() {
    std::vector<Flow> flows;
    std::vector<size_t> start(static_cast<size_t>(num_ranks_) + 1, 0);
    for (const Entry& e : entries_) ++start[static_cast<size_t>(e.src) + 1];
    for (int32_t k = 0; k < num_ranks_; ++k) start[k + 1] += start[k];
    std::vector<std::pair<int32_t, int64_t>> by_src(entries_.size());  // (dst, bytes), grouped by src
    std::vector<size_t> at(start.begin(), start.end() - 1);
    for (const Entry& e : entries_) by_src[at[e.src]++] = {e.dst, e.bytes};
    entries_ = {};  // by_src holds them now
    for (int32_t src = 0; src < num_ranks_; ++src) {
      const auto first = by_src.begin() + static_cast<ptrdiff_t>(start[src]);
      const auto last = by_src.begin() + static_cast<ptrdiff_t>(start[src + 1]);
      std::sort(first, last, [](const auto& a, const auto& b) { return a.first < b.first; });
      for (auto it = first; it != last; ++it) {
        const auto [dst, bytes] = *it;
        if (it != first && flows.back().dst == dst) {
          flows.back().bytes += bytes;
        } else {
          flows.push_back(Flow{src, dst, bytes});
        }
      }
    }
    return flows;
  }

 private:
  struct Entry {
    int32_t src, dst;
    int64_t bytes;
  };
  int32_t num_ranks_;
  std::vector<Entry> entries_;
};

}  // namespace

std::vector<Flow> count_flows(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks, Phase phase,
                              BackwardMode mode) {
  FlowAccumulator acc(batch.num_ranks);
  CommSummary fwd;
  const int wanted = static_cast<int>(phase);
  for_each_transfer(batch, bytes, tasks, mode, fwd, [&](int p, int32_t src, int32_t dst, int64_t n) {
    if (p == wanted) acc.add(src, dst, n);
  });
  return acc.fold();
}

LinkSummary busiest_links(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks,
                          BackwardMode mode, int64_t* total_bytes) {
  const int32_t r = batch.num_ranks;
  std::array<std::vector<int64_t>, kNumPhases> send, recv;
  for (int p = 0; p < kNumPhases; ++p) {
    send[p].assign(r, 0);
    recv[p].assign(r, 0);
  }
  int64_t total = 0;
  CommSummary fwd;
  for_each_transfer(batch, bytes, tasks, mode, fwd, [&](int phase, int32_t src, int32_t dst, int64_t n) {
    send[phase][src] += n;
    recv[phase][dst] += n;
    total += n;
  });
  LinkSummary s;
  for (int p = 0; p < kNumPhases; ++p) {
    for (int32_t k = 0; k < r; ++k) s.busiest[p] = std::max({s.busiest[p], send[p][k], recv[p][k]});
    s.step += s.busiest[p];
  }
  s.fwd_dispatch = s.busiest[static_cast<int>(Phase::kFwdDispatch)];
  if (total_bytes != nullptr) *total_bytes = total;
  return s;
}

std::vector<int64_t> server_bytes(const TokenBytes& bytes, const std::vector<Task>& tasks, int32_t num_ranks) {
  std::vector<int64_t> out(static_cast<size_t>(num_ranks), 0);
  std::vector<std::tuple<int32_t, int32_t, int64_t, int64_t>> ranges;  // (server, doc, k0, k1)
  ranges.reserve(tasks.size());
  for (const Task& t : tasks) {
    DISTCA_CHECK(t.server >= 0 && t.server < num_ranks) << "task on server " << t.server;
    out[static_cast<size_t>(t.server)] += t.q_len() * (bytes.q + bytes.out);
    ranges.emplace_back(t.server, t.doc, t.k0, t.k1);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    auto [server, doc, k0, k1] = ranges[i];
    int64_t keys = 0;
    size_t j = i;
    for (; j < ranges.size() && std::get<0>(ranges[j]) == server && std::get<1>(ranges[j]) == doc; ++j) {
      const auto [s2, d2, a, b] = ranges[j];
      if (a > k1) {  // a gap: the interval so far is complete
        keys += k1 - k0;
        k0 = a;
      }
      k1 = std::max(k1, b);
    }
    keys += k1 - k0;
    out[static_cast<size_t>(server)] += keys * bytes.kv;
    i = j;
  }
  return out;
}

LoadSummary summarize_load(const std::vector<double>& seconds, const std::vector<int64_t>& pairs) {
  DISTCA_CHECK(!seconds.empty() && seconds.size() == pairs.size()) << "one load per server";
  LoadSummary s;
  double total = 0;
  double total_pairs = 0;
  int64_t max_pairs = 0;
  for (size_t i = 0; i < seconds.size(); ++i) {
    s.max = std::max(s.max, seconds[i]);
    total += seconds[i];
    total_pairs += static_cast<double>(pairs[i]);
    max_pairs = std::max(max_pairs, pairs[i]);
  }
  const auto n = static_cast<double>(seconds.size());
  s.mean = total / n;
  s.imbalance = s.mean > 0 ? s.max / s.mean : 1.0;
  s.pairs_imbalance = total_pairs > 0 ? static_cast<double>(max_pairs) / (total_pairs / n) : 1.0;
  return s;
}

uint64_t plan_hash(const Batch& batch, const std::vector<Task>& tasks) {
  // FNV-1a over 64-bit words, then a splitmix64 finaliser to spread the bits.
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](int64_t v) { h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ULL; };
  mix(batch.num_ranks);
  mix(batch.tokens_per_rank);
  for (int64_t len : batch.doc_lengths) mix(len);
  for (const Piece& p : batch.pieces) {
    mix(p.doc), mix(p.begin), mix(p.end), mix(p.rank);
  }
  for (const Task& t : tasks) {
    mix(t.doc), mix(t.q0), mix(t.q1), mix(t.k0), mix(t.k1), mix(t.server);
  }
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

Plan finalize_plan(std::string policy, double tolerance, const Batch& batch, const CostModel& cost,
                   std::vector<Task> tasks) {
  // Planners leave most tasks in this order already (every piece's own task, in batch order) and
  // append what they moved: sort what follows the sorted run, then merge the two.
  auto before = [](const Task& a, const Task& b) {
    return std::tie(a.server, a.doc, a.q0, a.k0, a.q1, a.k1) < std::tie(b.server, b.doc, b.q0, b.k0, b.q1, b.k1);
  };
  const auto sorted_end = std::is_sorted_until(tasks.begin(), tasks.end(), before);
  std::sort(sorted_end, tasks.end(), before);
  std::inplace_merge(tasks.begin(), sorted_end, tasks.end(), before);
  Plan plan;
  plan.policy = std::move(policy);
  plan.tolerance = tolerance;
  plan.server_seconds.assign(batch.num_ranks, 0.0);
  plan.server_pairs.assign(batch.num_ranks, 0);
  for (const Task& t : tasks) {
    DISTCA_CHECK(t.server >= 0 && t.server < batch.num_ranks) << "task on server " << t.server;
    plan.server_seconds[t.server] += cost.task_seconds(t.q_len(), t.pairs(), t.k1 - t.k0);
    plan.server_pairs[t.server] += t.pairs();
  }
  plan.load = summarize_load(plan.server_seconds, plan.server_pairs);
  plan.server_bytes = server_bytes(cost.token_bytes(), tasks, batch.num_ranks);
  plan.traffic = count_traffic(batch, cost.token_bytes(), tasks);
  plan.hash = plan_hash(batch, tasks);
  plan.is_balanced = plan.load.max <= (1.0 + tolerance) * plan.load.mean * (1.0 + 1e-12);
  plan.tasks = std::move(tasks);
  return plan;
}

}  // namespace distca::plan
