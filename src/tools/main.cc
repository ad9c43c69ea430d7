// The `distca` command line: one binary, one subcommand per job.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <functional>
#include <map>
#include <string>

#include "cmd_bench.h"
#include "cmd_plan.h"
#include "cmd_profile.h"
#include "cmd_simulate.h"
#include "cmd_train.h"
#include "distca/core/log.h"

int main(int argc, char** argv) {
  CLI::App app{"distca: core attention disaggregation for long-context LLM training"};
  app.require_subcommand(1);
  bool is_verbose = false;
  bool is_quiet = false;
  app.add_flag("-v,--verbose", is_verbose, "log debug messages to stderr");
  app.add_flag("-q,--quiet", is_quiet, "log only errors");

  std::map<std::string, std::function<int()>> commands;
  commands["plan"] = distca::tools::add_plan_command(app);
  commands["bench"] = distca::tools::add_bench_command(app);
  commands["train"] = distca::tools::add_train_command(app);
  commands["simulate"] = distca::tools::add_simulate_command(app);
  commands["profile"] = distca::tools::add_profile_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "distca: error: {} (see --help)\n", e.what());
    return 2;
  }
  distca::set_log_level(is_verbose ? distca::LogLevel::kDebug
                                   : (is_quiet ? distca::LogLevel::kError : distca::LogLevel::kInfo));
  for (const CLI::App* sub : app.get_subcommands()) return commands.at(sub->get_name())();
  return 2;
}
