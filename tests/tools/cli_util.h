// Shared by the CLI tests: runs the real `distca` binary in a per-process scratch folder.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "distca/core/file.h"

namespace cli {

namespace fs = std::filesystem;

struct CmdResult {
  int exit_code;
  std::string out;
  std::string err;
};

inline const fs::path& scratch() {
  static const fs::path dir = [] {
    // One folder per process: ctest runs the tests of this file in parallel processes.
    fs::path d = fs::temp_directory_path() / ("distca_cli_test." + std::to_string(getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// Runs `distca ARGS` (ARGS may hold shell syntax) with no standard input.
inline CmdResult run_shell(const std::string& command) {
  const std::string out = (scratch() / "stdout").string();
  const std::string err = (scratch() / "stderr").string();
  const std::string cmd = command + " >" + out + " 2>" + err + " </dev/null";
  const int status = std::system(cmd.c_str());
  return CmdResult{WIFEXITED(status) ? WEXITSTATUS(status) : -1, distca::read_text_file(out).value(),
                   distca::read_text_file(err).value()};
}

inline CmdResult distca(const std::string& args) { return run_shell(std::string(DISTCA_BIN) + " " + args); }

#ifdef DISTCA_MPIRUN
// `distca ARGS` on np ranks under mpirun, after `prefix` (e.g. "env -u OPENBLAS_CORETYPE "). mpirun -q
// keeps mpirun's own "a process returned non-zero" note out; the docs' commands use it.
inline CmdResult mpirun(int np, const std::string& args, const std::string& prefix = "") {
  return run_shell(prefix + DISTCA_MPIRUN + " -q --allow-run-as-root --oversubscribe --bind-to none -np " +
                   std::to_string(np) + " " + DISTCA_BIN + " " + args);
}
#endif

inline std::string write(const std::string& name, const std::string& text) {
  const std::string path = (scratch() / name).string();
  EXPECT_TRUE(distca::write_file_atomic(path, text).is_ok());
  return path;
}

// A bad command line and a word its one-line error must contain.
struct BadInput {
  const char* name;
  std::string args;
  const char* expected;
};

inline int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// A refused command line: exit 2, one line on stderr that contains `c.expected`, nothing on stdout.
inline void expect_refused(const CmdResult& r, const BadInput& c) {
  EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
  EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
  EXPECT_TRUE(r.out.empty()) << c.name << ": " << r.out;
}

// A profile whose numbers make every per-layer time easy to compute by hand.
inline std::string simple_profile(double inter_node_bytes_per_second) {
  nlohmann::json p = {
      {"format", "distca-profile"},
      {"version", 1},
      {"name", "hand-made"},
      {"attention",
       {{{"num_q_heads", 32},
         {"num_kv_heads", 8},
         {"head_dim", 128},
         {"points", {{{"q_tokens", 1024}, {"kv_tokens", 1024}, {"fwd_seconds", 1e-3}, {"bwd_seconds", 2e-3}}}}}}},
      {"linear_flops_per_second", 1e15},
      {"intra_node", {{"latency_seconds", 0.0}, {"bytes_per_second", 1e12}}},
      {"inter_node", {{"latency_seconds", 0.0}, {"bytes_per_second", inter_node_bytes_per_second}}}};
  return write("profile_" + std::to_string(static_cast<int64_t>(inter_node_bytes_per_second)) + ".json", p.dump());
}

}  // namespace cli
