#include "distca/layout/task_split.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>

namespace distca::layout {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// (query, key) pairs of a task: a causal task (k1 == q1) counts its triangle.
double pairs_of(const plan::Task& t) {
  const double q0 = static_cast<double>(t.q0), q1 = static_cast<double>(t.q1);
  const double k0 = static_cast<double>(t.k0), k1 = static_cast<double>(t.k1);
  if (t.is_causal()) return (q1 - q0) * (q0 - k0) + (q1 - q0) * (q1 - q0 + 1) / 2;
  return (q1 - q0) * (k1 - k0);
}

std::vector<double> pairs_of(const std::vector<plan::Task>& tasks) {
  std::vector<double> out(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) out[i] = pairs_of(tasks[i]);
  return out;
}

// The task indices in `key` order, ties in index order.
template <typename Key>
std::vector<size_t> sorted_by(const std::vector<plan::Task>& tasks, Key key) {
  std::vector<size_t> order(tasks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(tasks[a]) < key(tasks[b]); });
  return order;
}
auto server_doc_k0(const plan::Task& t) { return std::tuple(t.server, t.doc, t.k0); }

// How many of document rows [begin, end) `rank` holds.
int64_t owned_in(const plan::Batch& batch, int32_t doc, int32_t rank, int64_t begin, int64_t end) {
  int64_t rows = 0;
  for (int32_t i : batch.doc_pieces[doc]) {
    const plan::Piece& p = batch.pieces[i];
    if (p.rank == rank) rows += std::max<int64_t>(0, std::min(end, p.end) - std::max(begin, p.begin));
  }
  return rows;
}

// Q rows the tasks move between ranks: each task's query rows less those its server holds.
int64_t remote_q_rows(const plan::Batch& batch, const std::vector<plan::Task>& tasks) {
  int64_t rows = 0;
  for (const plan::Task& t : tasks) rows += t.q_len() - owned_in(batch, t.doc, t.server, t.q0, t.q1);
  return rows;
}

// K/V rows the tasks move between ranks: per (server, document), the union of the tasks' key
// ranges (route.h), less the rows the server holds.
int64_t remote_kv_rows(const plan::Batch& batch, const std::vector<plan::Task>& tasks) {
  int64_t rows = 0;
  std::optional<std::pair<int32_t, int32_t>> key;  // (server, doc) of the open union
  int64_t lo = 0, hi = 0;
  auto close = [&] {
    if (key) rows += (hi - lo) - owned_in(batch, key->second, key->first, lo, hi);
  };
  for (size_t i : sorted_by(tasks, server_doc_k0)) {
    const plan::Task& t = tasks[i];
    if (key == std::pair(t.server, t.doc) && t.k0 <= hi) {
      hi = std::max(hi, t.k1);
      continue;
    }
    close();
    key = std::pair(t.server, t.doc);
    lo = t.k0, hi = t.k1;
  }
  close();
  return rows;
}

// The atom of each task: tasks of one document on one server whose key ranges overlap,
// transitively (they share K/V rows on that server), numbered in (server, doc, k0) order.
struct Atoms {
  std::vector<int64_t> of;  // (tasks)
  int64_t count = 0;
};
Atoms kv_atoms(const std::vector<plan::Task>& tasks) {
  Atoms atoms;
  atoms.of.assign(tasks.size(), 0);
  const plan::Task* last = nullptr;
  int64_t reach = 0;
  for (size_t i : sorted_by(tasks, server_doc_k0)) {
    const plan::Task& t = tasks[i];
    if (last == nullptr || last->server != t.server || last->doc != t.doc || t.k0 >= reach) {
      ++atoms.count;
      reach = t.k1;
    } else {
      reach = std::max(reach, t.k1);
    }
    atoms.of[i] = atoms.count - 1;
    last = &t;
  }
  return atoms;
}

// Per atom: its pairs (summed in task order) and its server.
struct AtomWeights {
  std::vector<double> weight;
  std::vector<int32_t> server;
};
AtomWeights atom_weights(const std::vector<plan::Task>& tasks, const Atoms& atoms, const std::vector<double>& pairs) {
  AtomWeights w;
  w.weight.assign(static_cast<size_t>(atoms.count), 0.0);
  w.server.assign(static_cast<size_t>(atoms.count), 0);
  for (size_t i = 0; i < tasks.size(); ++i) {
    w.weight[atoms.of[i]] += pairs[i];
    w.server[atoms.of[i]] = tasks[i].server;
  }
  return w;
}

// The atoms by server, then largest first, ties in atom order.
std::vector<int64_t> by_server_largest_first(const AtomWeights& w) {
  std::vector<int64_t> order(w.weight.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (w.server[a] != w.server[b]) return w.server[a] < w.server[b];
    return w.weight[a] > w.weight[b];
  });
  return order;
}

// Each server's atoms dealt to two halves: largest first to the lighter half (ties: half 0),
// then single moves of the atom that narrows the gap most, while one does (a few: each is
// O(atoms), and they rarely need more).
struct Dealt {
  std::vector<int> side;                      // (atoms) 0 or 1
  std::vector<std::array<double, 2>> loads;   // (R) pairs per server and half
};
Dealt deal_atoms(const AtomWeights& w, int32_t num_ranks) {
  Dealt out;
  out.side.assign(w.weight.size(), 0);
  out.loads.assign(static_cast<size_t>(num_ranks), {0.0, 0.0});
  const std::vector<int64_t> order = by_server_largest_first(w);
  for (size_t begin = 0; begin < order.size();) {
    const int32_t s = w.server[order[begin]];
    size_t end = begin;
    while (end < order.size() && w.server[order[end]] == s) ++end;
    std::array<double, 2>& half = out.loads[s];
    std::vector<int> where;
    for (size_t j = begin; j < end; ++j) {
      const int h = half[0] <= half[1] ? 0 : 1;
      half[h] += w.weight[order[j]];
      where.push_back(h);
    }
    const size_t n = end - begin;
    for (size_t move = 0; move < std::min<size_t>(n, 8); ++move) {
      const int heavy = half[0] >= half[1] ? 0 : 1;
      const double gap = half[heavy] - half[1 - heavy];
      // Moving an atom of x from the heavier half leaves a gap of |gap - 2x|.
      int64_t best = -1;
      double best_gap = gap;
      for (size_t j = 0; j < n; ++j) {
        const double x = w.weight[order[begin + j]];
        if (where[j] == heavy && std::abs(gap - 2 * x) < best_gap) best = static_cast<int64_t>(j), best_gap = std::abs(gap - 2 * x);
      }
      if (best < 0) break;
      where[best] = 1 - heavy;
      half[heavy] -= w.weight[order[begin + best]];
      half[1 - heavy] += w.weight[order[begin + best]];
    }
    for (size_t j = 0; j < n; ++j) out.side[order[begin + j]] = where[j];
    begin = end;
  }
  return out;
}

// The row c at which rows [q0, c) of a task hold `early_pairs` pairs: the first such c
// (round_up) or the last with no more than that.
int64_t cut_row(const plan::Task& t, double early_pairs, bool round_up) {
  double x = 0;
  if (t.is_causal()) {
    // rows [q0, c) hold F(c) - F(q0) pairs, F(x) = (x - k0)(x - k0 + 1) / 2
    const double f0 = static_cast<double>((t.q0 - t.k0) * (t.q0 - t.k0 + 1)) / 2;
    x = (-1 + std::sqrt(1 + 8 * (early_pairs + f0))) / 2;
  } else {
    x = static_cast<double>(t.q0 - t.k0) + early_pairs / static_cast<double>(std::max<int64_t>(t.k1 - t.k0, 1));
  }
  const int64_t c = t.k0 + static_cast<int64_t>(round_up ? std::ceil(x - 1e-9) : std::floor(x + 1e-9));
  return std::min(std::max(c, t.q0), t.q1);
}

// A cut of one task at query row `row`: the piece of rows before it (moves_early) or from it on
// goes to the other half. cost: the K/V rows it sends twice.
struct Cut {
  double cost = kInf;
  int64_t task = -1;
  int64_t row = 0;
  bool moves_early = true;
};

// One server's heavier half and the tasks in it that a cut could divide, for cut(level).
class ServerCuts {
 public:
  ServerCuts(const plan::Batch& batch, const std::vector<plan::Task>& tasks, const std::vector<double>& pairs,
             const std::vector<int>& side, int32_t server, const std::array<double, 2>& load)
      : batch_(&batch), tasks_(&tasks), pairs_(&pairs), server_(server) {
    const int heavy = load[0] >= load[1] ? 0 : 1;
    heavy_load_ = load[heavy];
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (tasks[i].server == server && side[i] == heavy) candidates_.push_back(i);
    }
    std::stable_sort(candidates_.begin(), candidates_.end(), [&](size_t a, size_t b) { return pairs[a] > pairs[b]; });
  }

  double heavy_load() const { return heavy_load_; }

  // The cut bringing the heavier half to at most `level` pairs with the fewest K/V rows
  // travelling twice; none when none is needed; cost inf when no task of the half is larger
  // than what must move.
  std::optional<Cut> cut(double level) const {
    const double need = heavy_load_ - level;
    if (need <= 0) return std::nullopt;
    Cut best;
    for (size_t i : candidates_) {
      const double p = (*pairs_)[i];
      if (p <= need) break;  // sorted by pairs: no later task is larger
      const plan::Task& t = (*tasks_)[i];
      for (const bool moves_early : {true, false}) {
        const int64_t c = cut_row(t, moves_early ? need : p - need, moves_early);
        if (!(t.q0 < c && c < t.q1)) continue;
        // The early piece's keys are read by both pieces: they travel twice unless the server
        // owns them.
        const int64_t end = t.is_causal() ? c : t.k1;
        const double cost = static_cast<double>((end - t.k0) - owned_in(*batch_, t.doc, server_, t.k0, end));
        if (cost < best.cost || (cost == best.cost && c < best.row)) best = Cut{cost, static_cast<int64_t>(i), c, moves_early};
      }
    }
    return best;
  }

 private:
  const plan::Batch* batch_;
  const std::vector<plan::Task>* tasks_;
  const std::vector<double>* pairs_;
  int32_t server_;
  double heavy_load_ = 0;
  std::vector<size_t> candidates_;  // task indices of the heavier half, largest first
};

// The lowest level >= cap (in pairs) to which every server's heavier half can be cut, one cut
// each, with at most `budget` K/V rows travelling twice in all (bisection: a higher level needs
// smaller cuts, never more rows).
double lowest_level(const std::vector<ServerCuts>& servers, double cap, int64_t budget) {
  auto cost = [&](double level) {
    double rows = 0;
    for (const ServerCuts& sc : servers) {
      if (const std::optional<Cut> c = sc.cut(level)) rows += c->cost;
    }
    return rows;
  };
  const double limit = static_cast<double>(budget);
  if (servers.empty() || cost(cap) <= limit) return cap;
  double lo = cap, hi = 0;  // cost(hi) = 0: no cut needed
  for (const ServerCuts& sc : servers) hi = std::max(hi, sc.heavy_load());
  for (int i = 0; i < 48; ++i) {
    const double mid = (lo + hi) / 2;
    if (cost(mid) <= limit) {
      hi = mid;
    } else {
      lo = mid;
    }
    if (hi - lo <= 1) break;
  }
  return hi;
}

// Where the budget left some server's heavier half at `level` (above cap), nano-batch 1 lasts as
// long as its busiest server, so no server's lighter half need be above busiest - level. Moves
// whole atoms (tasks sharing K/V rows) wholly in a lighter half to its heavier half, largest
// first, while that one stays within level: free, and it shortens nano-batch 1 (`halves`
// updated).
void fill_to_level(const std::vector<plan::Task>& every, std::vector<int>& side, const std::vector<double>& pairs,
                   std::array<std::vector<double>, 2>& halves, double level, double busiest) {
  const Atoms atoms = kv_atoms(every);
  const AtomWeights w = atom_weights(every, atoms, pairs);
  std::vector<int64_t> in_light(static_cast<size_t>(atoms.count), 0), size(static_cast<size_t>(atoms.count), 0);
  for (size_t i = 0; i < every.size(); ++i) {
    in_light[atoms.of[i]] += side[i] == 1 ? 1 : 0;
    ++size[atoms.of[i]];
  }
  const double light = busiest - level;
  std::vector<bool> is_over(halves[1].size());
  for (size_t s = 0; s < is_over.size(); ++s) is_over[s] = halves[1][s] > light;
  std::vector<bool> moved(static_cast<size_t>(atoms.count), false);
  for (int64_t a : by_server_largest_first(w)) {
    const int32_t s = w.server[a];
    if (!is_over[s] || in_light[a] != size[a] || halves[1][s] <= light) continue;
    if (halves[0][s] + w.weight[a] <= level) {
      moved[a] = true;
      halves[0][s] += w.weight[a];
      halves[1][s] -= w.weight[a];
    }
  }
  for (size_t i = 0; i < every.size(); ++i) {
    if (moved[atoms.of[i]]) side[i] = 0;
  }
}

Status check_inputs(const plan::Batch& batch, const std::vector<plan::Task>& tasks, const TaskSplitOptions& options) {
  if (!(options.tolerance >= 0 && options.tolerance <= 1)) {
    return invalid_argument(fmt::format("tolerance must be in [0, 1] (the plan's, Plan.tolerance), got {}", options.tolerance));
  }
  if (!(options.kv_budget >= 0 && options.kv_budget <= 1)) {
    return invalid_argument(fmt::format(
        "kv_budget must be in [0, 1] (a share of the plan's travelling K/V rows), got {}", options.kv_budget));
  }
  DISTCA_RETURN_IF_ERROR(batch.validate());
  const int32_t R = batch.num_ranks, num_docs = batch.num_docs();
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].server < 0 || tasks[i].server >= R) {
      return invalid_argument(fmt::format("tasks[{}]: server {} outside [0, {}) (the batch's {} ranks)", i,
                                          tasks[i].server, R, R));
    }
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    const plan::Task& t = tasks[i];
    if (t.doc < 0 || t.doc >= num_docs || t.q0 < 0 || t.q1 <= t.q0 || t.k0 < 0 || t.k1 < t.k0) {
      return invalid_argument(fmt::format("tasks[{}]: need 0 <= doc < {} (the batch's documents), 0 <= q0 < q1 and "
                                          "0 <= k0 <= k1, got doc {}, q [{}, {}), kv [{}, {})",
                                          i, num_docs, t.doc, t.q0, t.q1, t.k0, t.k1));
    }
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    const plan::Task& t = tasks[i];
    const int64_t length = batch.doc_lengths[t.doc];
    if (t.q1 > length || t.k1 > length) {
      return invalid_argument(fmt::format("tasks[{}]: rows past the end of document {} ({} tokens): q [{}, {}), "
                                          "kv [{}, {}); pass the plan's batch", i, t.doc, length, t.q0, t.q1, t.k0, t.k1));
    }
  }
  return Status::ok();
}

}  // namespace

Result<TaskSplit> split_attention_tasks(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                        TaskSplitOptions options) {
  DISTCA_RETURN_IF_ERROR(check_inputs(batch, tasks, options));
  const int32_t R = batch.num_ranks;
  const std::vector<double> pairs = pairs_of(tasks);
  std::vector<double> whole(static_cast<size_t>(R), 0.0);
  for (size_t i = 0; i < tasks.size(); ++i) whole[tasks[i].server] += pairs[i];
  TaskSplit out;
  out.cap = (1.0 + options.tolerance) * std::max(0.0, *std::max_element(whole.begin(), whole.end())) / 2;
  out.level = out.cap;
  out.remote_kv_rows = remote_kv_rows(batch, tasks);
  out.parts = {tasks};
  if (tasks.size() < 2) return out;

  // 1. Atoms dealt to each server's halves.
  const Atoms atoms = kv_atoms(tasks);
  const Dealt dealt = deal_atoms(atom_weights(tasks, atoms, pairs), R);
  std::vector<int> side(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) side[i] = dealt.side[atoms.of[i]];

  // 2. Cuts: the lowest level (from cap up) that every server's heavier half can be brought to,
  // one cut each, within the budget of duplicated K/V rows.
  const auto budget = static_cast<int64_t>(std::floor(options.kv_budget * static_cast<double>(out.remote_kv_rows)));
  std::vector<ServerCuts> servers;
  for (int32_t s = 0; s < R; ++s) {
    if (std::max(dealt.loads[s][0], dealt.loads[s][1]) > out.cap) servers.emplace_back(batch, tasks, pairs, side, s, dealt.loads[s]);
  }
  const double level = lowest_level(servers, out.cap, budget);
  out.level = level;
  std::vector<plan::Task> every = tasks;  // the cut tasks replaced by the piece that stays in their half,
  std::vector<int> every_side = side;     // then the pieces that go to the other half
  for (const ServerCuts& sc : servers) {
    const std::optional<Cut> cut = sc.cut(level);
    if (!cut) continue;
    out.extra_kv_rows += static_cast<int64_t>(cut->cost);
    ++out.num_cuts;
    const plan::Task& t = tasks[cut->task];
    plan::Task early = t, late = t;
    early.q1 = cut->row;
    if (t.is_causal()) early.k1 = cut->row;  // the early rows see keys up to the cut
    late.q0 = cut->row;
    every[cut->task] = cut->moves_early ? late : early;
    every.push_back(cut->moves_early ? early : late);
    every_side.push_back(1 - side[cut->task]);
  }

  // 3. Every server's heavier half in nano-batch 0 (free: a server's halves only trade places):
  // each nano-batch's attention takes as long as its busiest server, so aligned halves keep the
  // two together shortest, max(heavier) + max(lighter).
  const std::vector<double> every_pairs = pairs_of(every);
  std::array<std::vector<double>, 2> halves{std::vector<double>(R, 0.0), std::vector<double>(R, 0.0)};
  for (size_t i = 0; i < every.size(); ++i) halves[every_side[i]][every[i].server] += every_pairs[i];
  for (size_t i = 0; i < every.size(); ++i) {
    const int32_t s = every[i].server;
    if (halves[1][s] > halves[0][s]) every_side[i] = 1 - every_side[i];
  }
  for (int32_t s = 0; s < R; ++s) {
    const double heavier = std::max(halves[0][s], halves[1][s]), lighter = std::min(halves[0][s], halves[1][s]);
    halves[0][s] = heavier, halves[1][s] = lighter;
  }
  if (level > out.cap) fill_to_level(every, every_side, every_pairs, halves, level, 2 * out.cap / (1 + options.tolerance));
  for (int n = 0; n < 2; ++n) out.busiest[n] = *std::max_element(halves[n].begin(), halves[n].end());

  // Plan order within each half (server, doc, q0, k0), as the plan lists its tasks.
  std::array<std::vector<plan::Task>, 2> parts;
  for (size_t i : sorted_by(every, [](const plan::Task& t) { return std::tuple(t.server, t.doc, t.q0, t.k0); })) {
    parts[every_side[i]].push_back(every[i]);
  }
  if (!parts[0].empty() && !parts[1].empty()) {
    out.parts = {std::move(parts[0]), std::move(parts[1])};
    for (const std::vector<plan::Task>& part : out.parts) {
      out.travel_rows.push_back({remote_q_rows(batch, part), remote_kv_rows(batch, part)});
    }
  }
  // The servers left above cap (+ one row's pairs, a cut's rounding): the budget, or no task to
  // cut, stopped them.
  std::vector<double> row_pairs(static_cast<size_t>(R), 0.0);
  for (const plan::Task& t : tasks) row_pairs[t.server] = std::max(row_pairs[t.server], static_cast<double>(t.k1 - t.k0));
  for (int32_t s = 0; s < R; ++s) {
    if (halves[0][s] > out.cap + row_pairs[s]) out.over.push_back(s);
  }
  return out;
}

}  // namespace distca::layout
