// Ping-pong (docs/design.md §4.5): a micro-batch split into two nano-batches whose work alternates,
// so that the communication of one overlaps the compute of the other.
//
// Each nano-batch's work is a chain of stages: stage i computes, then starts a communication
// that must finish before stage i + 1 computes. run_sequential runs nano-batch 0's chain, then
// nano-batch 1's, waiting on each communication at once; run_pingpong interleaves them:
//   compute A(i), start A(i); [finish B(i-1)] compute B(i), start B(i); finish A(i), compute A(i+1) ...
// so A's communication i is in flight while B computes stage i, and B's while A computes
// stage i + 1. Every rank runs the same schedule, so collectives are posted in the same order.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/plan.h"
#include "distca/runtime/route.h"

namespace distca::runtime {

struct NanoBatches {
  std::array<plan::Batch, 2> batches;
  // [nano][rank] rows of the micro-batch's linear layout that form the nano-batch's own rows (its
  // linear work), in its layout's order.
  std::array<std::vector<std::vector<int64_t>>, 2> rows;
  // [nano] the micro-batch document of each of the nano-batch's documents.
  std::array<std::vector<int32_t>, 2> docs;
  // split_plan: [rank] how many rows nano-batch B's layout begins with that are not its own: the
  // last rows of A's (the prefixes of the documents split between the two), whose K/V B's
  // attention reads and whose dK/dV it returns. Empty for a split by whole documents.
  std::vector<int64_t> context_rows;
};

Result<NanoBatches> split_nano_batches(const plan::Batch& batch);

// One plan, split: the micro-batch is planned once and its plan's tasks divided between the two
// nano-batches at a position in each document: the queries before it in A, from it on in B (a
// document may go whole to either). With SplitOptions::hold_kv, B's servers keep the K/V rows A's
// forward brought them (route.h's held K/V), so a position may also cut a causal task over keys
// [0, q1) in two (A's part reads keys [0, p), B's all of them, the first p held from A): then
// nothing travels twice, and a server's share of a long document can go half to each. A is the prefix, so B's tasks read K/V rows that A's linear
// stage made first in the forward (B's layout begins with them: context_rows), and in the
// backward B's attention must run first, its dK/dV for those rows added to A's before A's
// linear backward (runtime::pingpong_schedule's `b_leads_from`). The positions come from the
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
Result<NanoSplit> split_plan(const plan::Batch& batch, const plan::Plan& plan, const plan::CostModel& cost,
                             SplitOptions options = {});

struct Stage {
  std::function<Status()> compute;
  std::function<Status()> start_comm;   // may be empty: no communication after this stage
  std::function<Status()> finish_comm;  // set with start_comm
  std::string name;       // what compute does ("L0 linear"), for schedules printed and tested
  std::string comm_name;  // what the communication moves ("L0 dispatch")
};

// A schedule is plain data: the order in which two chains' operations run, each operation one
// stage's compute, start of its communication, or finish (wait) of it. Communication i of a
// nano-batch is in flight from its start to its finish, while whatever computes in between runs.
enum class OpKind { kCompute, kStart, kFinish };
struct ScheduleOp {
  OpKind kind;
  int nano;   // 0: chain a, 1: chain b
  int stage;  // index in its chain
  bool operator==(const ScheduleOp&) const = default;
};
// Chain a whole (compute, start, finish of each stage), then chain b. With b_leads_from = k <
// stages: a's stages [0, k), b's [0, k), then b's [k, stages), a's [k, stages) (a positional
// split: B's backward before A's).
std::vector<ScheduleOp> sequential_schedule(int stages, int b_leads_from = -1);
// The interleaving (stages >= 1): compute A(i), start A(i); finish B(i-1), compute B(i),
// start B(i); finish A(i), compute A(i+1), ...; so A's communication i is in flight while B
// computes stage i, and B's while A computes stage i + 1. With a chain of linear and attention
// stages per layer this is the paper's four ticks: A's linear work under B's return, B's linear
// work under A's dispatch, A's attention under B's dispatch, B's attention under A's return.
// With b_leads_from = k < stages, the two swap roles from stage k on: B computes stage i first,
// then A (B's communication k - 1 is the one exposed at the turn).
std::vector<ScheduleOp> pingpong_schedule(int stages, int b_leads_from = -1);

// Per compute operation of a schedule, in order: the communications in flight while it runs
// (started, not yet finished), as (nano, stage).
struct ComputeOverlap {
  int nano = 0, stage = 0;
  std::vector<std::pair<int, int>> in_flight;
};
std::vector<ComputeOverlap> overlaps(const std::vector<ScheduleOp>& schedule);
// One line per compute: "A L0 attention | in flight: B L0 dispatch" (names from the chains;
// a stage without communication is never in flight).
std::vector<std::string> describe(const std::vector<ScheduleOp>& schedule, const std::vector<Stage>& a,
                                  const std::vector<Stage>& b);

struct ScheduleTiming {
  double seconds = 0;          // wall time of the whole schedule
  double compute_seconds = 0;  // in compute
  double comm_seconds = 0;     // in start_comm and finish_comm (packing, waiting, unpacking)
  // The same two, per nano-batch (chain a, chain b); they add up to the totals above.
  std::array<double, 2> nano_compute_seconds{0, 0};
  std::array<double, 2> nano_comm_seconds{0, 0};
};

// Runs the chains in the schedule's order. Both chains must have the same number of stages, and
// the schedule must start every communication it finishes, finish every one it starts, and
// compute every stage once, after its predecessor's communication finished.
Result<ScheduleTiming> run_schedule(const std::vector<ScheduleOp>& schedule, std::vector<Stage>& a,
                                    std::vector<Stage>& b);
Result<ScheduleTiming> run_sequential(std::vector<Stage>& a, std::vector<Stage>& b, int b_leads_from = -1);
Result<ScheduleTiming> run_pingpong(std::vector<Stage>& a, std::vector<Stage>& b, int b_leads_from = -1);

// While it lives, a thread that calls `poll` (Communicator::progress) every `interval`: the
// transfers of a communicator that moves data only inside its own calls (MPI) advance while this
// rank computes. The first error poll returns stops the polling and is returned by stop().
class ProgressThread {
 public:
  ProgressThread(std::function<Status()> poll, std::chrono::microseconds interval);
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;
  Status stop();
  int64_t polls() const { return polls_.load(); }

 private:
  std::function<Status()> poll_;
  std::chrono::microseconds interval_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> polls_{0};
  Status error_ = Status::ok();
  std::thread thread_;
};

}  // namespace distca::runtime
