#include "distca/layout/route.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

#include "distca/core/check.h"
#include "distca/plan/verify.h"

namespace distca::layout {

Status HeadShape::validate() const {
  if (num_q_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return invalid_argument(fmt::format("heads: Hq, Hkv and D must be positive, got {}, {}, {}",
                                        num_q_heads, num_kv_heads, head_dim));
  }
  if (num_q_heads % num_kv_heads != 0) {
    return invalid_argument(fmt::format("heads: Hq ({}) must be a multiple of Hkv ({})",
                                        num_q_heads, num_kv_heads));
  }
  return Status::ok();
}

namespace {

// Appends a segment, extending the previous one when the rows continue on both sides.
void append(std::vector<Segment>& segments, Segment s) {
  if (!segments.empty()) {
    Segment& last = segments.back();
    if (last.local_row + last.rows == s.local_row && last.server_row + last.rows == s.server_row) {
      last.rows += s.rows;
      return;
    }
  }
  segments.push_back(s);
}

}  // namespace

Result<Route> build_route(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                          int32_t rank) {
  DISTCA_RETURN_IF_ERROR(batch.validate());
  DISTCA_RETURN_IF_ERROR(plan::verify_tasks(batch, tasks));
  return build_partial_route(batch, tasks, rank);
}

std::vector<KvInterval> kv_layout(const std::vector<plan::Task>& tasks) {
  std::vector<std::tuple<int32_t, int32_t, int64_t, int64_t>> ranges;  // server, doc, k0, k1
  ranges.reserve(tasks.size());
  for (const plan::Task& t : tasks) ranges.emplace_back(t.server, t.doc, t.k0, t.k1);
  std::sort(ranges.begin(), ranges.end());
  std::vector<KvInterval> out;
  std::vector<int64_t> rows;  // per server, its K/V rows so far
  for (size_t i = 0; i < ranges.size();) {
    const auto [server, doc, k0, first_k1] = ranges[i];
    int64_t k1 = first_k1;
    size_t j = i;
    // One interval: every range that starts at or before its current end (as count_traffic).
    for (; j < ranges.size() && std::get<0>(ranges[j]) == server && std::get<1>(ranges[j]) == doc &&
           std::get<2>(ranges[j]) <= k1;
         ++j) {
      k1 = std::max(k1, std::get<3>(ranges[j]));
    }
    if (static_cast<size_t>(server) >= rows.size()) rows.resize(static_cast<size_t>(server) + 1, 0);
    out.push_back(KvInterval{server, doc, k0, k1, rows[server]});
    rows[server] += k1 - k0;
    i = j;
  }
  return out;
}

Result<Route> build_partial_route(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                  int32_t rank, const std::vector<KvInterval>& held) {
  const int32_t r = batch.num_ranks;
  if (rank < 0 || rank >= r) {
    return invalid_argument(fmt::format("rank {} outside the batch's {} ranks", rank, r));
  }
  DISTCA_RETURN_IF_ERROR(batch.validate());
  DISTCA_RETURN_IF_ERROR(plan::verify_task_shapes(batch, tasks));

  // Each piece's first row in its owner's linear layout.
  std::vector<int64_t> piece_row(batch.pieces.size());
  std::vector<int64_t> rank_rows(r, 0);
  for (size_t i = 0; i < batch.pieces.size(); ++i) {
    const plan::Piece& p = batch.pieces[i];
    piece_row[i] = rank_rows[p.rank];
    rank_rows[p.rank] += p.length();
  }

  Route route;
  route.rank = rank;
  route.num_ranks = r;
  route.num_local_rows = rank_rows[rank];
  route.to_server_q.resize(r);
  route.to_server_split_q.resize(r);
  route.to_server_kv.resize(r);
  route.from_owner_q.resize(r);
  route.from_owner_split_q.resize(r);
  route.from_owner_kv.resize(r);

  // Cuts document rows [begin, end), which start at `server_row` on `server`, at the owners'
  // piece boundaries and records the segments this rank sends or receives.
  auto route_rows = [&](int32_t doc, int64_t begin, int64_t end, int32_t server, int64_t server_row,
                        std::vector<std::vector<Segment>>& to_server,
                        std::vector<std::vector<Segment>>& from_owner) {
    for (int32_t i : batch.doc_pieces[doc]) {
      const plan::Piece& p = batch.pieces[i];
      if (p.end <= begin) continue;
      if (p.begin >= end) break;
      const int64_t lo = std::max(begin, p.begin);
      const int64_t hi = std::min(end, p.end);
      const Segment s{piece_row[i] + (lo - p.begin), server_row + (lo - begin), hi - lo};
      if (p.rank == rank) append(to_server[server], s);
      if (server == rank) append(from_owner[p.rank], s);
    }
  };

  // Q: task after task in plan order, per server; split tasks' rows in their own lists (verified
  // above: a causal task with k0 > 0 or a non-causal task shares each of its rows with others).
  std::vector<int64_t> q_rows(r, 0);
  std::vector<size_t> order(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return tasks[a].server < tasks[b].server; });
  std::vector<int64_t> task_q_row(tasks.size());
  for (size_t i : order) {
    const plan::Task& t = tasks[i];
    task_q_row[i] = q_rows[t.server];
    const bool is_split = t.k0 > 0 || !t.is_causal();
    route_rows(t.doc, t.q0, t.q1, t.server, q_rows[t.server],
               is_split ? route.to_server_split_q : route.to_server_q,
               is_split ? route.from_owner_split_q : route.from_owner_q);
    q_rows[t.server] += t.q_len();
  }

  // K/V: the union of each (server, document)'s key ranges, interval after interval; the rows
  // the server holds from the earlier dispatch come from there.
  const std::vector<KvInterval> layout = kv_layout(tasks);
  std::vector<KvInterval> held_sorted = held;
  auto by_place = [](const KvInterval& a, const KvInterval& b) {
    return std::tie(a.server, a.doc, a.k0) < std::tie(b.server, b.doc, b.k0);
  };
  std::sort(held_sorted.begin(), held_sorted.end(), by_place);
  std::vector<int64_t> kv_rows(r, 0);
  for (const KvInterval& in : layout) {
    int64_t at = in.k0;  // rows [in.k0, at) are placed
    auto place_from_owners = [&](int64_t end) {
      if (end > at) route_rows(in.doc, at, end, in.server, in.server_row + (at - in.k0), route.to_server_kv, route.from_owner_kv);
      at = std::max(at, end);
    };
    const auto [first, last] = std::equal_range(
        held_sorted.begin(), held_sorted.end(), KvInterval{in.server, in.doc, 0, 0, 0},
        [](const KvInterval& a, const KvInterval& b) { return std::tie(a.server, a.doc) < std::tie(b.server, b.doc); });
    for (auto h_it = first; h_it != last; ++h_it) {
      const KvInterval& h = *h_it;
      if (h.k1 <= at || h.k0 >= in.k1) continue;
      place_from_owners(h.k0);
      const int64_t end = std::min(h.k1, in.k1);
      if (end > at && in.server == rank) {
        append(route.held_kv, Segment{h.server_row + (at - h.k0), in.server_row + (at - in.k0), end - at});
      }
      at = std::max(at, end);
    }
    place_from_owners(in.k1);
    kv_rows[in.server] = in.server_row + (in.k1 - in.k0);
  }
  std::vector<int64_t> task_kv_row(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    const plan::Task& t = tasks[i];
    // The interval of (server, doc) that holds the task's first key.
    auto it = std::upper_bound(layout.begin(), layout.end(), std::tuple(t.server, t.doc, t.k0),
                               [](const auto& key, const KvInterval& in) { return key < std::tuple(in.server, in.doc, in.k0); });
    DISTCA_CHECK(it != layout.begin()) << "task keys outside the K/V layout";
    --it;
    task_kv_row[i] = it->server_row + (t.k0 - it->k0);
  }

  route.num_server_q_rows = q_rows[rank];
  route.num_server_kv_rows = kv_rows[rank];
  for (size_t i : order) {
    const plan::Task& t = tasks[i];
    if (t.server != rank) continue;
    route.tasks.push_back(kernels::AttnTask{task_q_row[i], t.q_len(), task_kv_row[i], t.k1 - t.k0,
                                            t.is_causal()});
  }
  return route;
}

bool Route::owns_split_rows() const {
  for (const std::vector<Segment>& segments : to_server_split_q) {
    if (!segments.empty()) return true;
  }
  return false;
}

}  // namespace distca::layout
