// The `distca` command line: one binary, one subcommand per job.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "distca/kernels/blas_setup.h"
#include "build_info.h"
#include "cmd_bench.h"
#include "cmd_plan.h"
#include "cmd_profile.h"
#include "cmd_simulate.h"
#include "cmd_train.h"
#include "distca/core/knobs.h"
#include "distca/core/log.h"
#include "distca/core/progress.h"
#include "distca/kernels/cpu.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"
#include "distca_git_hash.h"
#include "distca/core/memory.h"
#include "world.h"

namespace {

// The CPU kernels' build in use (and why), the builds compiled in and the ones this CPU runs.
std::string cpu_kernels_text() {
  const distca::Result<std::string> isa = distca::kernels::resolve_cpu_isa("");
  // DISTCA_CPU_ISA=auto asks for what unset gives: the fastest build this CPU runs.
  const char* env = distca::knob(distca::kernels::kCpuIsaEnv);
  const bool is_forced = env != nullptr && *env != '\0' && std::string_view(env) != "auto";
  return fmt::format("{} (built: {}; this CPU runs: {})",
                     isa.is_ok() ? isa.value() + (is_forced ? fmt::format(", forced by {}", distca::kernels::kCpuIsaEnv)
                                                            : std::string(", the fastest this CPU runs"))
                                 : fmt::format("none: {}", isa.status().message()),
                     fmt::join(distca::kernels::cpu_isas_built(), ", "),
                     fmt::join(distca::kernels::cpu_isas_supported(), ", "));
}

std::string version_text() {
#if defined(DISTCA_HAVE_NCCL)
  constexpr bool kNcclBuilt = true;
#else
  constexpr bool kNcclBuilt = false;
#endif
  return fmt::format(
      "distca {} (git {}, {} build)\n"
      "  CPU attention kernels: {}\n"
      "  MpiComm (mpirun): {}\n"
      "  CUDA attention kernels: {}\n"
      "  NcclComm: {}\n",
      DISTCA_VERSION, DISTCA_GIT_HASH, DISTCA_BUILD_TYPE, cpu_kernels_text(), DISTCA_BUILT_MPI ? "built" : "not built (no MPI at configure time)",
      distca::tools::cuda_kernels_text(distca::kernels::cuda_kernels_built(), distca::kernels::cuda_kernels_archs(),
                                       distca::kernels::cudnn_built()),
      distca::tools::nccl_text(kNcclBuilt));
}

// Before CLI11 parses: the first word that is not one of distca's own options must be a command.
// CLI11 alone answers "A subcommand is required" for `distca plna` and `distca --foo`; this names
// the word and what is valid. Returns the error, or "" when the command line starts well.
std::string check_command_word(int argc, char** argv, const std::vector<std::string>& commands) {
  const std::vector<std::string> global = {"-v", "--verbose", "-q", "--quiet", "-h", "--help", "--help-all", "--version"};
  const std::string valid = fmt::format("{}", fmt::join(commands, ", "));
  bool is_help_or_version = false;
  bool is_version = false;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (std::find(global.begin(), global.end(), word) != global.end()) {
      is_help_or_version = is_help_or_version || (word != "-v" && word != "--verbose" && word != "-q" && word != "--quiet");
      is_version = is_version || word == "--version";
      continue;
    }
    if (word.starts_with("-")) {
      return fmt::format("unknown option '{}' before the command; distca's own options are -v/--verbose, -q/--quiet, "
                         "--version, --help and --help-env, and each command's options follow it (distca <command> "
                         "--help lists them)",
                         word);
    }
    if (std::find(commands.begin(), commands.end(), word) != commands.end()) {
      // `distca --version plan ...` would print the version and run nothing: say so instead.
      if (is_version) {
        return fmt::format("--version prints the version and runs no command, so '{}' would not run: drop --version, "
                           "or run `distca --version` alone",
                           word);
      }
      return "";
    }
    std::string hint;
    for (const std::string& c : commands) {
      if (distca::edit_distance(word, c) <= 2) hint = fmt::format(" (did you mean '{}'?)", c);
    }
    return fmt::format("unknown command '{}'{}; the commands are {}", word, hint, valid);
  }
  return is_help_or_version ? "" : fmt::format("a command is required: {}", valid);
}

// One line naming the DISTCA_* variables set that the table does not know (a misspelt one would
// otherwise do nothing), from rank 0 only and not with --quiet.
void warn_unknown_knobs() {
  if (distca::log_level() > distca::LogLevel::kWarn || !distca::tools::is_primary_process()) return;
  const std::string line = distca::unknown_knobs_warning(distca::distca_names_in_environment());
  if (!line.empty()) fmt::print(stderr, "{}\n", line);
}

// `distca --help-env [--json]`: the table of DISTCA_* variables (distca/core/knobs.h), answered
// before CLI11, which would ask for a command. The exit code, or nothing when the words before the
// command do not ask for it.
std::optional<int> help_env(int argc, char** argv) {
  bool is_asked = false;
  bool is_json = false;
  std::string other;  // the first word before the command that --help-env does not take
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    if (word == "--help-env") {
      is_asked = true;
    } else if (word == "--json") {
      is_json = true;
    } else if (word == "-q" || word == "--quiet") {
      distca::set_log_level(distca::LogLevel::kError);  // and so no warning below
    } else if (word != "-v" && word != "--verbose" && other.empty()) {
      other = word;
    }
    if (!word.starts_with("-")) break;  // a command: the words after it are its own
  }
  if (!is_asked) return std::nullopt;
  if (!other.empty()) {
    distca::tools::print_error_line(fmt::format(
        "distca: error: --help-env prints the environment variables and runs nothing; it takes only --json, got '{}'",
        other));
    return distca::tools::kExitBadInput;
  }
  if (!distca::tools::is_primary_process()) return distca::tools::kExitOk;
  warn_unknown_knobs();
  fmt::print("{}", is_json ? distca::knobs_json_text() : distca::knobs_help_text());
  return distca::tools::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  distca::kernels::prepare_blas(argv);  // first: may re-execute this binary (kernels/blas_setup.h)
  CLI::App app{"distca: core attention disaggregation for long-context LLM training"};
  app.require_subcommand(1);
  bool is_verbose = false;
  bool is_quiet = false;
  app.add_flag("-v,--verbose", is_verbose, "log debug messages to stderr");
  app.add_flag("-q,--quiet", is_quiet, "log only errors");
  app.set_version_flag("--version", version_text(), "print the version, git hash, build type and built parts");
  bool is_help_env = false;  // answered by help_env() before CLI11 parses; declared here for --help
  app.add_flag("--help-env", is_help_env,
               "print the DISTCA_* environment variables distca, its scripts and its tests read: name, default and "
               "meaning (with --json: as JSON)");

  std::map<std::string, std::function<int()>> commands;
  commands["plan"] = distca::tools::add_plan_command(app);
  commands["simulate"] = distca::tools::add_simulate_command(app);
  commands["train"] = distca::tools::add_train_command(app);
  commands["bench"] = distca::tools::add_bench_command(app);
  commands["profile"] = distca::tools::add_profile_command(app);

  if (const std::optional<int> code = help_env(argc, argv)) return *code;
  const std::string bad_word = check_command_word(argc, argv, {"plan", "simulate", "train", "bench", "profile"});
  if (!bad_word.empty()) {
    distca::tools::print_error_line(fmt::format("distca: error: {}{}", bad_word,
                                                bad_word.find("--help") == std::string::npos ? " (see distca --help)" : ""));
    return distca::tools::kExitBadInput;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return distca::tools::is_primary_process() ? app.exit(e) : 0;
  } catch (const CLI::CallForAllHelp& e) {
    return distca::tools::is_primary_process() ? app.exit(e) : 0;
  } catch (const CLI::CallForVersion& e) {
    if (distca::tools::is_primary_process()) fmt::print("{}", version_text());
    return 0;
  } catch (const CLI::ParseError& e) {
    {
      const CLI::App* sub = app.get_subcommands().empty() ? nullptr : app.get_subcommands().front();
      std::string what = e.what();
      if (sub != nullptr && !sub->get_subcommands({}).empty() && sub->get_subcommands().empty()) {
        // `distca bench` alone: name its commands rather than CLI11's "A subcommand is required".
        std::vector<std::string> names;
        for (const CLI::App* s : sub->get_subcommands({})) names.push_back(s->get_name());
        if (what.find("ubcommand") != std::string::npos) {
          std::string unknown;  // the word after the command, if any
          for (int i = 1; i + 1 < argc; ++i) {
            if (argv[i] == sub->get_name() && argv[i + 1][0] != '-') unknown = argv[i + 1];
          }
          what = unknown.empty() ? fmt::format("{} needs one of: {}", sub->get_name(), fmt::join(names, ", "))
                                 : fmt::format("unknown {} command '{}'; the {} commands are {}", sub->get_name(), unknown,
                                               sub->get_name(), fmt::join(names, ", "));
        }
      }
      distca::tools::print_error_line(fmt::format("distca{}: error: {} (see distca {}--help)",
                                                  sub ? " " + sub->get_name() : "", what, sub ? sub->get_name() + " " : ""));
    }
    return distca::tools::kExitBadInput;
  }
  distca::set_log_level(is_verbose ? distca::LogLevel::kDebug
                                   : (is_quiet ? distca::LogLevel::kError : distca::LogLevel::kInfo));
  warn_unknown_knobs();
  // A DISTCA_CPU_ISA this CPU cannot run (or no build has) is bad input, refused before any work.
  if (const distca::Result<std::string> isa = distca::kernels::resolve_cpu_isa(""); !isa.is_ok()) {
    distca::tools::print_error_line(fmt::format("distca: error: {}", isa.status().message()));
    return distca::tools::kExitBadInput;
  }
  if (const distca::Result<double> interval = distca::progress_interval_from_env(); !interval.is_ok()) {
    distca::tools::print_error_line(fmt::format("distca: error: {}", interval.status().message()));
    return distca::tools::kExitBadInput;
  }
  for (const CLI::App* sub : app.get_subcommands()) {
    distca::tools::set_run_settings(sub->config_to_str(/*default_also=*/true, /*write_description=*/false));
    // plan and simulate are one-process commands: under mpirun rank 0 runs them (one report, one
    // error line, its exit code) and the other ranks end at once.
    const bool is_single_process = sub->get_name() == "plan" || sub->get_name() == "simulate";
    if (is_single_process && !distca::tools::is_primary_process()) return distca::tools::kExitOk;
    // A command that runs out of memory (or throws) ends with one line and exit 1, never with an
    // uncaught exception; the commands that allocate by their flags check an estimate up front
    // (exit 2) so that this is rare. Then it ends at once: out of memory, the libraries' exit
    // handlers may not finish (OpenBLAS joins a worker that retries its buffer forever).
    try {
      return commands.at(sub->get_name())();
    } catch (const std::bad_alloc&) {
      distca::tools::print_error_line(fmt::format(
          "distca {}: error: out of memory: this machine could not give the run the memory it asked for ({} "
          "available now); make the run smaller",
          sub->get_name(), distca::memory_text(distca::available_memory_bytes())));
    } catch (const std::exception& e) {
      distca::tools::print_error_line(fmt::format("distca {}: internal error: {}", sub->get_name(), e.what()));
    }
    std::fflush(nullptr);
    std::_Exit(distca::tools::kExitFailed);
  }
  return distca::tools::kExitBadInput;
}
