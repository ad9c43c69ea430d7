// `distca bench link`: the CAD exchange alone over the communicator as it is (under mpirun, the
// network between the hosts), beside the simulator's link model. A sampled batch is planned as
// `bench dispatch` plans it; each of the four phases of one layer (forward dispatch and return,
// backward dispatch and return) is sent as the plan's all-to-all, between barriers, --repeats
// times, and its time taken on the slowest rank. The model's prediction for each phase is
// sim::exchange_seconds: latency + the busiest rank's max(send, receive) bytes / the link's rate,
// with the rate given (--rate-gbit, the rate the link was shaped to) and the latency measured in
// the same run (a one-byte exchange).
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>

#include "distca/comm/communicator.h"
#include "distca/core/status.h"
#include "distca/plan/planner.h"

namespace distca::bench {

struct LinkBenchOptions {
  int ranks = 2;                      // LocalComm ranks (threads) when not under mpirun
  std::string workload = "pretrain";  // a built-in length distribution
  int64_t tokens_per_rank = 8192;
  int64_t q_heads = 4;
  int64_t kv_heads = 1;
  int64_t head_dim = 128;
  int64_t dtype_bytes = 2;            // bytes per element on the wire (2: bf16, 4: fp32)
  std::string policy = std::string(plan::kDefaultPlanner);
  std::string backward_mode = "stateful";
  double rate_gbit = 0;               // the link's rate for the model's prediction; 0: none
  int repeats = 5;
  uint64_t seed = 1;
};

Status validate(const LinkBenchOptions& o);

// Collective over `comm` (every rank calls it); the report is complete on rank 0.
Result<nlohmann::json> run_link_bench(comm::Communicator& comm, const LinkBenchOptions& o,
                                      const std::function<void(const std::string&)>& progress);
void print_link_report(const nlohmann::json& report);

}  // namespace distca::bench
