// `distca train`: the training loop, colocated or CAD attention, or both compared.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace distca::tools {

std::function<int()> add_train_command(CLI::App& app);

}  // namespace distca::tools
