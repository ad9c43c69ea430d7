// `distca --help-env` prints the table of knobs (core/knobs.h), as text and as JSON, and takes
// nothing else; a DISTCA_* variable the table does not know is one warning line on stderr when a
// command starts (none with --quiet), and the command still runs.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sstream>
#include <string>

#include "cli_util.h"
#include "distca/core/knobs.h"

namespace {

using cli::CmdResult;
using cli::count_lines;
using cli::distca;

TEST(Cli, HelpEnvListsEveryKnobWithItsDefault) {
  const CmdResult r = distca("--help-env");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  for (const distca::Knob& k : distca::knobs()) {
    const size_t at = r.out.find("\n  " + std::string(k.name) + " ");
    ASSERT_NE(at, std::string::npos) << k.name << " missing from:\n" << r.out;
    const std::string line = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
    EXPECT_NE(line.find(k.default_text), std::string::npos) << line;
  }
  std::istringstream lines(r.out);
  std::string line;
  while (std::getline(lines, line)) EXPECT_LE(line.size(), 100u) << line;
  EXPECT_NE(distca("--help").out.find("--help-env"), std::string::npos) << "distca --help names it";
}

TEST(Cli, HelpEnvJsonIsTheTable) {
  const CmdResult r = distca("--help-env --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format"], "distca-knobs");
  EXPECT_EQ(j["version"], 1);
  ASSERT_EQ(j["knobs"].size(), distca::knobs().size());
  for (size_t i = 0; i < distca::knobs().size(); ++i) {
    const distca::Knob& k = distca::knobs()[i];
    EXPECT_EQ(j["knobs"][i]["name"], k.name);
    EXPECT_EQ(j["knobs"][i]["default"], k.default_text);
    EXPECT_EQ(j["knobs"][i]["meaning"], k.meaning);
    EXPECT_EQ(j["knobs"][i]["used_by"], distca::knob_user_names(k.users));
  }
  EXPECT_EQ(distca("--json --help-env").out, r.out);
}

TEST(Cli, HelpEnvTakesOnlyJson) {
  for (const std::string args : {"--help-env plan", "--help-env --version", "--help-env --foo", "--version --help-env"}) {
    const CmdResult r = distca(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("--help-env prints the environment variables and runs nothing"), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "") << args;
  }
  EXPECT_EQ(distca("-q --help-env").exit_code, 0);
}

TEST(Cli, AnUnknownDistcaVariableIsOneWarningLineAndTheCommandRuns) {
  // A progress interval of an hour: no progress line on stderr beside the warning, however slow the machine.
  const std::string bin = std::string("DISTCA_PROGRESS_INTERVAL=3600 ") + DISTCA_BIN;
  const CmdResult r = cli::run_shell("DISTCA_CPU_ISAA=avx2 " + bin + " simulate --json");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err,
            "distca: warning: DISTCA_CPU_ISAA is not a distca setting (did you mean DISTCA_CPU_ISA? distca --help-env "
            "lists them)\n");
  EXPECT_TRUE(nlohmann::json::accept(r.out)) << "stdout is the report alone";
  const CmdResult quiet = cli::run_shell("DISTCA_CPU_ISAA=avx2 " + bin + " -q simulate --json");
  EXPECT_EQ(quiet.exit_code, 0);
  EXPECT_EQ(quiet.err, "") << "--quiet: errors only";
  const CmdResult help_env = cli::run_shell("DISTCA_FOO=1 DISTCA_CPU_ISAA=1 " + bin + " --help-env --json");
  EXPECT_EQ(help_env.exit_code, 0);
  EXPECT_EQ(count_lines(help_env.err), 1) << help_env.err;
  EXPECT_NE(help_env.err.find("DISTCA_CPU_ISAA (did you mean DISTCA_CPU_ISA?), DISTCA_FOO are not distca settings"),
            std::string::npos)
      << help_env.err;
  const CmdResult known = cli::run_shell("DISTCA_TEST_LONG=0 DISTCA_SHARED_DATA=/nowhere " + bin + " simulate --json");
  EXPECT_EQ(known.exit_code, 0);
  EXPECT_EQ(known.err, "") << "known variables: no warning";
}

}  // namespace
