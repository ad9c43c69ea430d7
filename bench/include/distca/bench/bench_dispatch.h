// `distca bench dispatch`: the CAD runtime measured. A sampled batch, split into two
// nano-batches and planned; L layers of forward and backward, each layer a stand-in linear
// stage (OpenBLAS sgemm sized against the attention FLOPs) and a CAD attention stage through
// the Dispatcher. Reports the bytes per phase (checked against the plan's counts), the achieved
// GB/s, and sequential against ping-pong time on the communicator as it is and over an emulated
// link, all in the same run: each figure the median of --repeats runs with its min..max, taken
// on the slowest rank of each run. With --link auto the link's bandwidth is calibrated on the
// compute time measured in the same runs (communication = compute) and checked on the repeats.
// A hidden fraction outside [0, 1] is reported as a measurement error, never clamped.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>

#include "distca/comm/communicator.h"
#include "distca/core/status.h"
#include "distca/plan/planner.h"

namespace distca::bench {

struct DispatchBenchOptions {
  int ranks = 2;                       // LocalComm ranks (threads) when not under mpirun
  std::string workload = "pretrain";   // a built-in length distribution
  int64_t tokens_per_rank = 4096;
  int64_t q_heads = 4;
  int64_t kv_heads = 1;
  int64_t head_dim = 128;
  int layers = 2;
  std::string policy = std::string(plan::kDefaultPlanner);
  std::string backward_mode = "stateless";
  int threads = 1;                     // attention and BLAS threads per rank
  double linear_ratio = 2.0;           // linear FLOPs per stage / attention FLOPs per stage
  std::string link = "auto";           // emulated link: "auto" (comm = compute), "off", or GB/s
  double latency_us = 20;
  int repeats = 5;                     // sequential + ping-pong runs per link: median and min..max
  uint64_t seed = 1;
};

Status validate(const DispatchBenchOptions& o);

// Collective over `comm` (every rank calls it); the report is complete on rank 0.
Result<nlohmann::json> run_dispatch_bench(comm::Communicator& comm, const DispatchBenchOptions& o,
                                          const std::function<void(const std::string&)>& progress);
void print_dispatch_report(const nlohmann::json& report);

}  // namespace distca::bench
