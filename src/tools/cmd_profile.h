// `distca profile` (measure this machine into a simulator profile) and `distca bench
// calibration` (the simulator's prediction of `distca train --compare` against the measured
// step times, in the same run).
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace distca::tools {

std::function<int()> add_profile_command(CLI::App& app);
// Adds `calibration` under `bench`; the returned function runs it.
std::function<int()> add_calibration_command(CLI::App& bench);

}  // namespace distca::tools
