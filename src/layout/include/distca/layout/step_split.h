// The C++ trainer's split of a micro-batch into ping-pong's two nano-batches (docs/design.md
// §4.5): the whole step is divided, its linear rows and their work as well as its attention, so
// each nano-batch is a batch of its own (its rows on every rank) with a plan of its own.
// distca.torch's split, which divides only the attention tasks, is task_split.h.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "distca/core/status.h"
#include "distca/layout/route.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/plan.h"

namespace distca::layout {

struct NanoBatches {
  std::array<plan::Batch, 2> batches;
  // [nano][rank] rows of the micro-batch's linear layout that form the nano-batch's own rows (its
  // linear work), in its layout's order.
  std::array<std::vector<std::vector<int64_t>>, 2> rows;
  // [nano] the micro-batch document of each of the nano-batch's documents.
  std::array<std::vector<int32_t>, 2> docs;
  // split_step: [rank] how many rows nano-batch B's layout begins with that are not its own: the
  // last rows of A's (the prefixes of the documents split between the two), whose K/V B's
  // attention reads and whose dK/dV it returns. Empty for a split by whole documents.
  std::vector<int64_t> context_rows;
};

// By whole documents, longest first, each to the nano-batch with fewer causal pairs (then fewer
// tokens) so far; each nano-batch is then planned on its own.
Result<NanoBatches> split_step_by_documents(const plan::Batch& batch);

// One plan, split: the micro-batch is planned once and its plan's tasks divided between the two
// nano-batches at a position in each document: the queries before it in A, from it on in B (a
// document may go whole to either). With SplitOptions::hold_kv, B's servers keep the K/V rows A's
// forward brought them (route.h's held K/V), so a position may also cut a causal task over keys
// [0, q1) in two (A's part reads keys [0, p), B's all of them, the first p held from A): then
// nothing travels twice, and a server's share of a long document can go half to each. A is the prefix, so B's tasks read K/V rows that A's linear
// stage made first in the forward (B's layout begins with them: context_rows), and in the
// backward B's attention must run first, its dK/dV for those rows added to A's before A's
// linear backward (the schedule's `b_leads_from`, runtime/pingpong.h). The positions come from the
// plan's task boundaries (and with hold_kv, points inside the tasks that may be cut), chosen greedily, heaviest document first, then
// revisited twice, so that every server's attention seconds and every rank's tokens (the linear
// work) are as close as they get to half of the plan's in each nano-batch, while the K/V a
// server would receive twice (a document's prefix for tasks on both sides; none with hold_kv)
// stays within 4 % of the plan's forward dispatch. The two plans hold exactly the whole plan's
// (query, key) pairs: its tasks, some of them cut in two.
// nano.batches[1] is empty (and plans[1]) when no split leaves work on both sides.
struct SplitOptions {
  // B's servers keep A's K/V rows (DispatchOptions::held_kv): the stateful backward only.
  bool hold_kv = false;
};
struct NanoSplit {
  NanoBatches nano;
  std::array<plan::Plan, 2> plans;  // nano.batches[n]'s plan, in its document numbering
  // hold_kv: A's K/V layout (kv_layout of plans[0]'s tasks) in B's document numbering, for B's
  // DispatchOptions::held_kv. plans[1].traffic counts those rows as sent; the runtime does not.
  std::vector<KvInterval> held_kv;
};
Result<NanoSplit> split_step(const plan::Batch& batch, const plan::Plan& plan, const plan::CostModel& cost,
                             SplitOptions options = {});

}  // namespace distca::layout
