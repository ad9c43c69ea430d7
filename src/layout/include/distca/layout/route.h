// Routing of one plan on one rank (docs/design.md §4): where every row of this rank's linear layout
// goes when the rank acts as an owner, and where every row arrives when it acts as a server.
// Pure data, computed the same way on every rank from the same batch and task list.
//
// Server layout of rank s: the Q rows of its tasks, task after task in plan order; then its K/V
// rows, once per (document, server): the union of the key ranges of s's tasks of the document,
// interval after interval in (document, first key) order.
//
// Key-range splits: a query row may be in several tasks (one causal task over keys [k0, q] and
// non-causal tasks tiling [0, k0), plan::verify_tasks). Each of them has the row in its Q slot,
// so a row can reach one server twice, and each returns a partial result that the owner combines
// (O/LSE by the LSE merge, dQ summed). A task is split when k0 > 0 or it is non-causal; then
// every one of its rows is in several tasks, and a task with k0 = 0 that is causal is its rows'
// only task. The Q segments of the two kinds are kept apart (q and split_q) so that unsplit rows
// are plainly copied and split rows combined.
//
// Held K/V (ping-pong, layout::split_step): a server may already hold some of a task's key rows
// from an earlier dispatcher's forward of the same layer (nano-batch A's). Those rows are not
// sent again: the route lists them (held_kv), the server copies them from the earlier buffer, and
// its dK/dV of them are added to the earlier buffer's before that one's backward return.
//
// A message from owner o to server s holds o's unsplit Q segments for s in server order, then
// its split Q segments in server order, then its K/V segments; the reverse message holds the
// same segments in the same order. Rows the server owns itself are copied, never sent.
#pragma once

#include <cstdint>
#include <vector>

#include "distca/core/status.h"
#include "distca/kernels/attention.h"
#include "distca/plan/batch.h"
#include "distca/plan/plan.h"

namespace distca::layout {

// Heads of one rank (after tensor parallelism) and the head size.
struct HeadShape {
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;      // D
  Status validate() const;
};

// Rows [local_row, local_row + rows) of the owner's linear layout are rows
// [server_row, server_row + rows) of the server's Q (or K/V) buffer.
struct Segment {
  int64_t local_row = 0;
  int64_t server_row = 0;
  int64_t rows = 0;
};

// Document rows [k0, k1) of `doc` are rows [server_row, server_row + k1 - k0) of `server`'s
// K/V buffer.
struct KvInterval {
  int32_t server = 0;
  int32_t doc = 0;
  int64_t k0 = 0, k1 = 0;
  int64_t server_row = 0;
  bool operator==(const KvInterval&) const = default;
};

// Every server's K/V layout of a task list (see above), in (server, document, first key) order.
std::vector<KvInterval> kv_layout(const std::vector<plan::Task>& tasks);

struct Route {
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int64_t num_local_rows = 0;  // tokens this rank holds in the linear layout

  // As a server.
  int64_t num_server_q_rows = 0;
  int64_t num_server_kv_rows = 0;
  std::vector<kernels::AttnTask> tasks;  // this server's tasks, in server-buffer rows

  // As an owner: [server] the segments this rank sends to that server (its own index holds
  // the rows it serves itself). Q rows of unsplit tasks, Q rows of split tasks, K/V rows.
  std::vector<std::vector<Segment>> to_server_q, to_server_split_q, to_server_kv;
  // As a server: [owner] the segments that owner sends here (local_row is the owner's row).
  std::vector<std::vector<Segment>> from_owner_q, from_owner_split_q, from_owner_kv;
  // As a server: K/V rows it holds from the earlier dispatch (build_partial_route's `held`):
  // local_row is the row in the earlier server buffer, server_row the row in this one.
  std::vector<Segment> held_kv;

  // Whether this rank owns a query row of a split task (its O/LSE are merged and its dQ summed
  // here, and a stateful backward sends it the final O/LSE).
  bool owns_split_rows() const;
};

// Checks the tasks (plan::verify_tasks: every causal pair of every document exactly once) and
// lays them out. Tasks may split the key range (see above).
Result<Route> build_route(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                          int32_t rank);

// The route of a part of a verified plan's tasks (a ping-pong nano-batch): each task is checked
// to be well formed, not that the tasks cover every pair, so rows whose tasks are all elsewhere
// get no entry. REQUIRES: the tasks are a subset of tasks that passed plan::verify_tasks, and
// the tasks of one query range (its key splits) are all in it or all out of it.
// `held`: the K/V layout of an earlier dispatch of the same layer (kv_layout of its tasks, in
// this batch's document numbering); the rows of this route's K/V intervals that a server holds
// there are taken from it (held_kv) instead of from their owners.
Result<Route> build_partial_route(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                  int32_t rank, const std::vector<KvInterval>& held = {});

}  // namespace distca::layout
