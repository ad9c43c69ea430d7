// Measures this machine for the simulator (`distca profile`): the CPU attention kernels over
// whole documents of several lengths (forward and backward), the model's linear work per token
// per layer (the real training model, attention replaced by a no-op), the optimizer step, and
// the communicator's link (all-to-all latency and bandwidth between the ranks).
#pragma once
#include <functional>
#include <string>

#include "distca/comm/communicator.h"
#include "distca/model/config.h"
#include "distca/sim/profile.h"

namespace distca::tools {

struct CpuProfileOptions {
  model::ModelConfig model;
  int64_t max_tokens = 8192;  // the longest document timed, and the tokens of the linear run
  int threads = 1;
  int repeats = 3;            // best of
};

// The key a LinearEntry is stored under for a model configuration.
std::string linear_model_key(const model::ModelConfig& m);

// Collective (every rank measures at the same time, as in training; rank 0's numbers count).
Result<sim::Profile> measure_cpu_profile(comm::Communicator& c, const CpuProfileOptions& o,
                                         const std::function<void(const std::string&)>& progress);

}  // namespace distca::tools
