// The `distca train` command line, run as a user runs it (see cli_util.h).
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

TEST(Cli, TrainCompareJsonHasTheDocumentedFields) {
  const std::string json = (scratch() / "train.json").string();
  const std::string ckpt = (scratch() / "train.ckpt").string();
  CmdResult r = distca("train --preset tiny --compare --steps 4 --ranks 2 --json " + json + " --checkpoint " + ckpt);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("speedup of CAD over colocated"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n') >= 8, true);
  auto j = nlohmann::json::parse(distca::read_text_file(json).value());
  EXPECT_EQ(j["format"], "distca-train");
  EXPECT_EQ(j["steps"].size(), 8u);
  const auto& s = j["summary"];
  for (const char* field : {"colocated_step_seconds", "cad_step_seconds", "ideal_step_seconds", "speedup", "loss_first",
                            "loss_last"}) {
    EXPECT_GT(s[field].get<double>(), 0.0) << field;
  }
  EXPECT_LE(s["loss_max_rel_diff"].get<double>(), 1e-5);
  for (const auto& rec : j["steps"]) {
    for (const char* field : {"loss", "step_seconds", "tokens_per_second", "linear_seconds", "attention_seconds",
                              "comm_seconds", "wait_seconds", "attention_imbalance", "ideal_seconds"}) {
      EXPECT_TRUE(rec.contains(field)) << field;
    }
  }
  // Resuming continues at step 4.
  CmdResult resumed = distca("train --preset tiny --compare --steps 6 --ranks 2 --resume " + ckpt);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed at step 4"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("step    5/6"), std::string::npos) << resumed.out;
  EXPECT_EQ(resumed.out.find("step    4/6"), std::string::npos) << resumed.out;
}

TEST(Cli, TrainBadInputGetsOneLineErrorExitTwoAndNoFile) {
  const std::string bad_jsonl = write("bad.jsonl", "{\"text\": \"fine\"}\n{\"txt\": \"typo\"}\n");
  const std::string not_ckpt = write("not.ckpt", "hello\n");
  const std::string json = (scratch() / "never.json").string();
  const BadInput cases[] = {
      {"unknown preset", "--preset huge", "huge"},
      {"unknown backend", "--attention remote", "--attention"},
      {"zero steps", "--steps 0", "--steps"},
      {"tiny context", "--context 4", "--context"},
      {"unknown workload", "--workload web", "web"},
      {"unknown policy", "--policy best", "best"},
      {"unknown backward mode", "--backward-mode sometimes", "--backward-mode"},
      {"save without a path", "--save-every 2", "--checkpoint"},
      {"zero ranks", "--ranks 0", "--ranks"},
      {"missing data", "--data /nonexistent/corpus.jsonl", "/nonexistent/corpus.jsonl"},
      {"bad jsonl line", "--data " + bad_jsonl, "bad.jsonl:2"},
      {"not a checkpoint", "--resume " + not_ckpt, "not a distca checkpoint"},
      {"missing checkpoint", "--resume /nonexistent.ckpt", "/nonexistent.ckpt"},
  };
  for (const BadInput& c : cases) {
    const std::string preset = c.args.find("--preset") == std::string::npos ? "--preset tiny " : "";
    CmdResult r = distca("train " + preset + "--steps 2 --json " + json + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_FALSE(fs::exists(json)) << c.name;
  }
}

}  // namespace
