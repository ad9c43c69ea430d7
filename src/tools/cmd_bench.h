// `distca bench <what>`: measured benchmarks that report ratios against a baseline measured in
// the same run, as a table or as JSON.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace distca::tools {

// Adds `bench` and its subcommands to `app`; the returned function runs the chosen one and gives
// the exit code (0 ok, 1 a correctness check failed, 2 bad input).
std::function<int()> add_bench_command(CLI::App& app);

}  // namespace distca::tools
