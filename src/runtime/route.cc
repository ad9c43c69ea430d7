#include "distca/runtime/route.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

#include "distca/plan/verify.h"

namespace distca::runtime {

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

Result<Route> build_partial_route(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                  int32_t rank) {
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

  // K/V: the union of each (server, document)'s key ranges, interval after interval.
  std::vector<std::tuple<int32_t, int32_t, int64_t, int64_t, size_t>> ranges;  // server, doc, k0, k1, task
  ranges.reserve(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    ranges.emplace_back(tasks[i].server, tasks[i].doc, tasks[i].k0, tasks[i].k1, i);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<int64_t> kv_rows(r, 0);
  std::vector<int64_t> task_kv_row(tasks.size());
  for (size_t i = 0; i < ranges.size();) {
    const auto [server, doc, first_k0, first_k1, first_task] = ranges[i];
    int64_t k0 = first_k0;
    int64_t k1 = first_k1;
    size_t j = i;
    // One interval: every range that starts at or before its current end (as count_traffic).
    for (; j < ranges.size() && std::get<0>(ranges[j]) == server && std::get<1>(ranges[j]) == doc &&
           std::get<2>(ranges[j]) <= k1;
         ++j) {
      k1 = std::max(k1, std::get<3>(ranges[j]));
      task_kv_row[std::get<4>(ranges[j])] = kv_rows[server] + (std::get<2>(ranges[j]) - k0);
    }
    route_rows(doc, k0, k1, server, kv_rows[server], route.to_server_kv, route.from_owner_kv);
    kv_rows[server] += k1 - k0;
    i = j;
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

}  // namespace distca::runtime
