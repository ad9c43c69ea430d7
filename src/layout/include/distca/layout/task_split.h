// distca.torch's split of one plan into ping-pong's two nano-batches (python/distca/torch/cad/
// nanobatch.py calls it): only the attention tasks are divided, since PyTorch runs the user's
// linear layers on the whole step's rows. The C++ trainer's split, which divides the rows and
// their linear work too, is step_split.h.
//
// What a split must keep, and what it costs (the exchange is laid out by route.h):
//   bytes    Q rows travel once per task, K/V rows once per (document, server) and nano-batch.
//            Tasks of one document on one server whose key ranges overlap share K/V rows: put in
//            different nano-batches, those rows would travel twice. Such tasks form one unit (an
//            atom) that stays in one nano-batch, so a split into atoms moves exactly the plan's
//            bytes.
//   balance  each nano-batch must keep every server near half of its work, or ping-pong's two
//            attention stages together take longer than the plan's one. An atom can be most of a
//            server's work (a long document's task), so a task may be cut at a query row into
//            two tasks, one per nano-batch. Both then read the keys before the cut: rows the
//            server owns never travel (such a cut is free), the others travel twice; those
//            duplicated rows are held within `kv_budget` of the plan's travelling K/V rows.
//   merging  a row's key splits (tasks sharing query rows, on several servers) may land in
//            different nano-batches: the owner merges a row's partial results over both.
//
// The split, in causal (query, key) pairs; M: the plan's busiest server's,
// cap = (1 + tolerance) M / 2:
//   1. each server's atoms are dealt largest first to its lighter half, then single atoms move
//      while that narrows the gap (free: no row travels twice);
//   2. level: the lowest pairs (from cap up) to which every server's heavier half can be cut, one
//      cut each (the cheapest in duplicated rows), with at most kv_budget x the plan's travelling
//      K/V rows duplicated in all; the cuts are made;
//   3. each server's heavier half goes to nano-batch 0 (free). Each nano-batch's attention lasts
//      as long as its busiest server, so where the level is above cap, whole atoms move from
//      lighter halves to heavier ones (up to the level) to shorten nano-batch 1 too (free).
// What holds (tested): both halves of every server are within level + one row's pairs (the
// longest key range of a task on it); level == cap unless the budget (or a heavier half without
// a task larger than the excess) stopped it, and then `over` names the servers above cap; the
// duplicated travelling K/V rows are at most kv_budget x the plan's, so every exchange phase
// moves at most (1 + kv_budget) x the whole plan's bytes whatever the model and dtypes (Q rows
// never travel twice). `busiest` gives each nano-batch's busiest server: their sum over M is
// what ping-pong's two attention stages take against the plan's one.
//
// Pairs are counted in doubles (a causal task's triangle, a non-causal task's rectangle), the
// sums in task order, so the split is the same on every rank and on every machine.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/plan.h"

namespace distca::layout {

// Ping-pong may move at most 1.05x the plan's bytes.
inline constexpr double kKvBudget = 0.05;

struct TaskSplitOptions {
  double tolerance = 0;         // the plan's, in [0, 1]
  double kv_budget = kKvBudget; // a share of the plan's travelling K/V rows, in [0, 1]
};

struct TaskSplit {
  // One task list per nano-batch, each in plan order (server, doc, q0, k0); or one, the tasks as
  // given, where there is nothing to split.
  std::vector<std::vector<plan::Task>> parts;
  double cap = 0;              // pairs: (1 + tolerance) x the plan's busiest server / 2
  double level = 0;            // pairs every server's halves are cut to (cap, or above where the budget ran out)
  int64_t num_cuts = 0;        // tasks cut in two at a query row
  int64_t extra_kv_rows = 0;   // K/V rows that travel twice because of the cuts
  int64_t remote_kv_rows = 0;  // K/V rows the whole plan moves between ranks
  // Per nano-batch (Q rows, K/V rows) sent between ranks (empty with one part): distca.torch
  // orders its nano-batches by them.
  std::vector<std::array<int64_t, 2>> travel_rows;
  std::array<double, 2> busiest{0, 0};  // pairs of each nano-batch's busiest server
  std::vector<int32_t> over;            // servers whose heavier half stays above cap
};

// Splits a plan's tasks (of `batch`) as above. Checks the options and that every task names a
// server of the batch and rows inside a document of it (not that the tasks cover its pairs).
Result<TaskSplit> split_attention_tasks(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                        TaskSplitOptions options = {});

}  // namespace distca::layout
