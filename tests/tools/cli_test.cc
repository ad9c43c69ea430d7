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

}  // namespace
