// `distca bench step`: ping-pong inside the real training step, measured. Four CAD trainers of
// one model train on the same data, step by step interleaved, so every figure of a step comes
// from the same run and the same batch:
//   sequential  each step split into the two nano-batches of ping-pong, run one after the other
//               (the same plans and bytes as ping-pong: the two differ by the overlap alone);
//   ping-pong   the same nano-batches interleaved layer by layer;
//   zero-cost   ping-pong over a link that costs nothing (what is left when communication is free);
//   whole       ping-pong off: the step unsplit, one plan (what ping-pong is measured against on a
//               real link).
// With --link auto the attention's dispatch and return go over an emulated link whose bandwidth
// is set, on a calibration step, so that the step's communication time equals its linear compute
// time (--ratio): hidden = (sequential - ping-pong) / (sequential - zero-cost), per step and of
// the medians; every other step runs the variants in the reverse order. With --link off the
// communicator itself (mpirun: MPI) carries them and ping-pong
// is compared with the whole step. The three ping-pong forms run the same plans, so their losses
// must agree exactly; the benchmark checks it.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>

#include "distca/comm/communicator.h"
#include "distca/core/status.h"

namespace distca::bench {

struct StepBenchOptions {
  int ranks = 2;                 // LocalComm ranks (threads) when not under mpirun
  std::string preset = "demo";
  int64_t context = 0;           // tokens per rank; 0: the preset's
  int64_t layers = 0;            // 0: the preset's
  std::string workload;          // "": the preset's
  int steps = 5;                 // measured steps (after a warm-up and a calibration step)
  int threads = 1;
  std::string link = "auto";     // "auto": emulated, communication = ratio x linear; "off": the communicator
  double ratio = 1.0;            // emulated communication time / linear compute time per step
  double latency_us = 20;
  std::string backward_mode = "stateful";
  std::string progress = "poll";  // how transfers advance while a rank computes: none | poll | thread
  int64_t progress_interval_us = 1000;  // with progress "thread": between its polls
  std::string grad_sync = "overlap";  // the gradient all-reduce: overlap | eager | after (train::TrainOptions)
};

Status validate(const StepBenchOptions& o);
// The memory of the run on this machine (every rank here holds one trainer per variant, each the
// estimate `distca train` checks) against what the machine can give a benchmark
// (core/memory.h): kInvalidArgument naming both where it does not fit. REQUIRES: validate(o).
Status check_step_memory(const StepBenchOptions& o);
// The share of the exposed communication that ping-pong hid: (sequential - ping-pong) /
// (sequential - zero-cost), or nothing when the zero-cost step was no faster than the sequential
// one (no exposed communication was measured: the share is undefined, not 0 %). It is not
// clamped: outside 0..1 is noise and reported as such.
std::optional<double> hidden_fraction(double sequential, double pingpong, double zero_cost);
// Collective; the report is complete on rank 0.
Result<nlohmann::json> run_step_bench(comm::Communicator& comm, const StepBenchOptions& o,
                                      const std::function<void(const std::string&)>& progress);
void print_step_report(const nlohmann::json& report);

}  // namespace distca::bench
