// Runs the real `distca` binary: good runs print the documented JSON; every bad input gets a
// one-line error naming the problem, exit code 2, and no output file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "distca/core/file.h"
#include "distca/plan/plan_io.h"

#include "cli_util.h"
#include "distca/kernels/cpu.h"

namespace {

using cli::BadInput;
using cli::CmdResult;
using cli::count_lines;
using cli::distca;
using cli::scratch;
using cli::write;
namespace fs = std::filesystem;

TEST(Cli, HelpExitsZero) {
  CmdResult r = distca("plan --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--tokens-per-rank"), std::string::npos);
  EXPECT_EQ(distca("").exit_code, 2);
  CmdResult train = distca("train --help");
  EXPECT_EQ(train.exit_code, 0);
  EXPECT_NE(train.out.find("--compare"), std::string::npos);
}

TEST(Cli, UnknownCommandsAndOptionsAreNamed) {
  CmdResult typo = distca("plna");
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_EQ(count_lines(typo.err), 1) << typo.err;
  EXPECT_NE(typo.err.find("unknown command 'plna'"), std::string::npos) << typo.err;
  EXPECT_NE(typo.err.find("did you mean 'plan'"), std::string::npos) << typo.err;
  EXPECT_NE(typo.err.find("simulate"), std::string::npos) << "lists the commands: " << typo.err;
  CmdResult option = distca("--foo");
  EXPECT_EQ(option.exit_code, 2);
  EXPECT_NE(option.err.find("'--foo'"), std::string::npos) << option.err;
  CmdResult none = distca("");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("plan, simulate, train, bench, profile"), std::string::npos) << none.err;
  CmdResult bench = distca("bench nothing");
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_NE(bench.err.find("'nothing'"), std::string::npos) << bench.err;
  EXPECT_NE(bench.err.find("attention, dispatch, step, link, planner, calibration"), std::string::npos) << bench.err;
}

TEST(Cli, VersionNamesTheBuild) {
  CmdResult r = distca("--version");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("distca 0."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("git "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("build"), std::string::npos) << r.out;
  // What is built, not what was found; what ran where is in reports/gpu/, not in the binary.
#if defined(DISTCA_HAVE_CUDA)
  EXPECT_NE(r.out.find("CUDA attention kernels: built for "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("distca's kernels (mma.sync, sm_80 and up) for each"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("what has run on which GPU: reports/gpu/"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("validated"), std::string::npos) << r.out;
#else
  EXPECT_NE(r.out.find("CUDA attention kernels: not built"), std::string::npos) << r.out;
#endif
  EXPECT_NE(r.out.find("NcclComm: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CPU attention kernels: " + distca::kernels::cpu_isas_supported().front() +
                       ", the fastest this CPU runs"),
            std::string::npos)
      << r.out;
}

TEST(Cli, DistcaCpuIsaForcesABuildAndABadOneIsRefused) {
  const CmdResult forced = cli::run_shell("DISTCA_CPU_ISA=portable " + std::string(DISTCA_BIN) + " --version");
  EXPECT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_NE(forced.out.find("CPU attention kernels: portable, forced by DISTCA_CPU_ISA"), std::string::npos)
      << forced.out;
  const CmdResult bad = cli::run_shell("DISTCA_CPU_ISA=avx9000 " + std::string(DISTCA_BIN) + " simulate");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.err.find("DISTCA_CPU_ISA=avx9000: no 'avx9000' build"), std::string::npos) << bad.err;
  EXPECT_EQ(bad.out, "") << "nothing runs before the check";
}

// Issue 72 row 15: DISTCA_CPU_ISA=auto asks for what unset gives, so --version says "the fastest
// this CPU runs", not "forced by DISTCA_CPU_ISA".
TEST(Cli, DistcaCpuIsaAutoIsTheFastestThisCpuRunsNotForced) {
  const CmdResult r = cli::run_shell("DISTCA_CPU_ISA=auto " + std::string(DISTCA_BIN) + " --version");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("CPU attention kernels: " + distca::kernels::cpu_isas_supported().front() +
                       ", the fastest this CPU runs"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("forced"), std::string::npos) << r.out;
}

// Issue 72 row 15: a command after --version is an error (exit 2, one line, nothing on stdout),
// not the version with the command silently skipped.
TEST(Cli, VersionFollowedByACommandIsAnError) {
  for (const std::string args : {"--version plan --ranks 2", "-v --version simulate", "--version bench planner"}) {
    const CmdResult r = distca(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.out;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("--version prints the version and runs no command"), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << args << ": " << r.out;
  }
  EXPECT_EQ(distca("-q --version").exit_code, 0);
}

}  // namespace
