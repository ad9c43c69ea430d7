// Ping-pong (DESIGN.md §4.5): a micro-batch split into two nano-batches whose work alternates,
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
#include <cstdint>
#include <functional>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"

namespace distca::runtime {

struct NanoBatches {
  std::array<plan::Batch, 2> batches;
  // [nano][rank] rows of the micro-batch's linear layout that form the nano-batch's, in order.
  std::array<std::vector<std::vector<int64_t>>, 2> rows;
  // [nano] the micro-batch document of each of the nano-batch's documents.
  std::array<std::vector<int32_t>, 2> docs;
};

// Splits whole documents (a document's queries need its whole prefix, so it is never cut)
// between two nano-batches, longest first, each to the one with fewer causal pairs so far
// (ties: fewer tokens): both halves carry about half the attention work, and planning each
// half with a balancing policy balances both. Pieces keep their ranks, so a document that
// spans ranks spans the same ranks in its nano-batch.
Result<NanoBatches> split_nano_batches(const plan::Batch& batch);

struct Stage {
  std::function<Status()> compute;
  std::function<Status()> start_comm;   // may be empty: no communication after this stage
  std::function<Status()> finish_comm;  // set with start_comm
};

struct ScheduleTiming {
  double seconds = 0;          // wall time of the whole schedule
  double compute_seconds = 0;  // in compute
  double comm_seconds = 0;     // in start_comm and finish_comm (packing, waiting, unpacking)
  // The same two, per nano-batch (chain a, chain b); they add up to the totals above.
  std::array<double, 2> nano_compute_seconds{0, 0};
  std::array<double, 2> nano_comm_seconds{0, 0};
};

// Both chains must have the same number of stages.
Result<ScheduleTiming> run_sequential(std::vector<Stage>& a, std::vector<Stage>& b);
Result<ScheduleTiming> run_pingpong(std::vector<Stage>& a, std::vector<Stage>& b);

}  // namespace distca::runtime
