// The `distca plan` command line, run as a user runs it (see cli_util.h).
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

TEST(Cli, PlanJsonHasTheDocumentedFields) {
  CmdResult r = distca("plan --ranks 8 --tokens-per-rank 32768 --workload prolong --policy minmax --tolerance 0.05 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["policy"], "minmax");
  EXPECT_EQ(j["ranks"], 8);
  EXPECT_EQ(j["tokens_per_rank"], 32768);
  EXPECT_TRUE(j["verified"].get<bool>());
  EXPECT_GT(j["tasks"].get<int>(), 0);
  EXPECT_GE(j["load_before"]["imbalance"].get<double>(), j["load_after"]["imbalance"].get<double>());
  for (const char* key : {"total_bytes", "max_send_bytes", "max_recv_bytes", "q_bytes", "kv_bytes", "out_bytes"}) {
    EXPECT_TRUE(j["comm"].contains(key)) << key;
  }
}

TEST(Cli, PolicyAllComparesEveryPolicy) {
  CmdResult r = distca("plan --ranks 8 --tokens-per-rank 16384 --policy all --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["policies"].size(), 3u);
  CmdResult table = distca("plan --ranks 8 --tokens-per-rank 16384 --policy all");
  ASSERT_EQ(table.exit_code, 0);
  for (const char* name : {"none", "distca", "minmax"}) EXPECT_NE(table.out.find(name), std::string::npos);
}

TEST(Cli, BatchFileAndPlanOutputRoundTrip) {
  const std::string batch = write("batch.json", R"({"ranks": [[4096], [512, 512], [], [1, 7, 1000]]})");
  const std::string out = (scratch() / "plan.json").string();
  fs::remove(out);
  CmdResult r = distca("plan --batch " + batch + " --ranks 4 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto loaded = distca::plan::plan_from_json(nlohmann::json::parse(distca::read_text_file(out).value()));
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded.value().batch.num_ranks, 4);
  // Same input, same plan, byte for byte.
  const std::string first = distca::read_text_file(out).value();
  ASSERT_EQ(distca("plan --batch " + batch + " --out " + out).exit_code, 0);
  EXPECT_EQ(distca::read_text_file(out).value(), first);
}

TEST(Cli, BadInputGetsOneLineErrorExitTwoAndNoFile) {
  const std::string malformed = write("malformed.json", R"({"ranks": [[1, 2], )");
  const std::string three = write("three.json", R"({"ranks": [[1], [2], [3]]})");
  const std::string bad_lengths = write("lengths.json", R"([100, -2])");
  const std::string out = (scratch() / "should_not_exist.json").string();
  const BadInput cases[] = {
      {"zero ranks", "--ranks 0", "--ranks"},
      {"negative ranks", "--ranks -4", "--ranks"},
      {"zero tokens", "--tokens-per-rank 0", "--tokens-per-rank"},
      {"negative tokens", "--tokens-per-rank -5", "tokens-per-rank"},
      {"non-numeric ranks", "--ranks lots", "ranks"},
      {"malformed batch", "--batch " + malformed, "malformed JSON"},
      {"rank count mismatch", "--batch " + three + " --ranks 4", "--ranks is 4"},
      {"unknown policy", "--policy fastest", "unknown policy"},
      {"unknown workload", "--workload books", "unknown workload"},
      {"unknown model", "--model gpt-9", "unknown model"},
      {"bad tp", "--tp 3", "tp 3"},
      {"negative tolerance", "--tolerance -1", "tolerance"},
      {"zero granularity", "--granularity 0", "granularity"},
      {"huge granularity", "--granularity 99999999999999", "granularity"},
      {"huge step", "--ranks 1000000 --tokens-per-rank 1000000", "tokens per step"},
      {"huge elongation", "--elongation 1e300", "elongation"},
      {"huge document", "--batch " + write("huge.json", R"({"ranks": [[99999999999]]})"), "tokens"},
      {"missing batch file", "--batch /nonexistent/b.json", "no such file"},
      {"bad lengths", "--doc-lengths " + bad_lengths, "positive integer"},
      {"two sources", "--batch " + three + " --doc-lengths " + bad_lengths, "at most one"},
      {"unknown flag", "--frobnicate 3", "frobnicate"},
      {"out with all", "--policy all", "--out"},
  };
  for (const BadInput& c : cases) {
    fs::remove(out);
    CmdResult r = distca("plan " + c.args + " --out " + out);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.name;
    EXPECT_FALSE(fs::exists(out)) << c.name;
  }
}

}  // namespace
