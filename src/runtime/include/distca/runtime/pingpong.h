// Ping-pong (docs/design.md §4.5): the schedules that run two nano-batches' work alternately, so
// that the communication of one overlaps the compute of the other (the split into nano-batches
// is the layout layer's: layout/step_split.h).
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

namespace distca::runtime {

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
