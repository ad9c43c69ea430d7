// `distca plan`: build a CAD plan for one step and report balance and bytes.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace distca::tools {

// Adds the subcommand to `app`; the returned function runs it and gives the exit code
// (0 ok, 1 a run that failed, 2 bad input found before any work).
std::function<int()> add_plan_command(CLI::App& app);

}  // namespace distca::tools
