// `distca simulate`: one training iteration of each system, priced by the cluster simulator.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace distca::tools {

std::function<int()> add_simulate_command(CLI::App& app);

}  // namespace distca::tools
