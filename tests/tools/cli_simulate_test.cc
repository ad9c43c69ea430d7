// The `distca simulate` command line, run as a user runs it (see cli_util.h).
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

TEST(Cli, SimulateJsonAndPaperRecordsHaveTheDocumentedFields) {
  CmdResult r = distca("simulate --gpus 64 --context 128K --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["systems"].size(), 4u);
  for (const auto& s : j["systems"]) {
    for (const char* field : {"seconds", "linear_seconds", "attention_seconds", "comm_seconds", "idle_seconds",
                              "speedup_over_wlb", "speedup_over_colocated", "attention_imbalance"}) {
      EXPECT_TRUE(s[field].is_number()) << field;
    }
    EXPECT_EQ(s["unit_attention_seconds"].size(), 8u);
  }
  const std::string svg = (scratch() / "sim.svg").string();
  CmdResult plot = distca("simulate --gpus 64 --pp 2 --context 128K --plot " + svg);
  ASSERT_EQ(plot.exit_code, 0) << plot.err;
  const std::string drawing = distca::read_text_file(svg).value();
  EXPECT_EQ(drawing.rfind("<svg", 0), 0u);
  for (const char* system : {"colocated", "wlb", "cad-distca", "cad:"}) EXPECT_NE(drawing.find(system), std::string::npos) << system;
  CmdResult paper = distca("simulate --paper --iterations 1 --json");
  ASSERT_EQ(paper.exit_code, 0) << paper.err;
  auto records = nlohmann::json::parse(paper.out);
  ASSERT_GT(records.size(), 10u);
  for (const auto& rec : records) {
    for (const char* field : {"model", "gpus", "context", "dataset", "parallelism", "speedup_cad_distca", "speedup_cad",
                              "paper_low", "paper_high"}) {
      EXPECT_TRUE(rec.contains(field)) << field;
    }
    EXPECT_TRUE(rec["parallelism"] == "3D" || rec["parallelism"] == "4D");
  }
}

TEST(Cli, SimulateBadInputGetsOneLineErrorExitTwo) {
  const std::string bad_profile = write("bad_profile.json", "{\"format\": \"distca-profile\", \"version\": 9}");
  const BadInput cases[] = {
      {"unknown model", "--model llama-1t", "llama-1t"},
      {"gpus not a multiple", "--gpus 60", "--gpus"},
      {"bad context", "--context 12Q", "--context"},
      {"unknown system", "--system magic", "magic"},
      {"unknown workload", "--workload web", "web"},
      {"layers do not split", "--gpus 48 --pp 3", "stages"},
      {"missing profile", "--profile /nonexistent.json", "/nonexistent.json"},
      {"bad profile", "--profile " + bad_profile, "version 9"},
      {"wlb cp does not divide", "--wlb-cp 3", "--wlb-cp 3"},
      {"share above one", "--full-context-share 2", "full-context share"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("simulate " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.name;
  }
}

}  // namespace
