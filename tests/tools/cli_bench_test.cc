// The `distca bench` command line, run as a user runs it (see cli_util.h).
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

TEST(Cli, BenchAttentionJsonHasTheDocumentedFields) {
  CmdResult r = distca("bench attention --docs 512 --shard-doc 1024 --shards 64,128 --head-dim 64 --heads 4 --kv-heads 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format"], "distca-bench-attention");
  for (const char* field : {"fwd_gflops", "bwd_gflops", "sgemm_gflops", "gemm_attention_gflops"}) {
    EXPECT_GT(j[field].get<double>(), 0.0) << field;
  }
  for (const char* size : {"64", "128"}) EXPECT_GT(j["shard_fwd_gflops"][size].get<double>(), 0.0) << size;
  EXPECT_LT(j["check"]["fused_o"].get<double>(), 1e-3);
  // Whole documents 512 and 1024 (fused fwd/bwd and GEMM fwd, each on 1 and all threads), then
  // two shard sizes (fused fwd/bwd on 1 and all threads).
  EXPECT_EQ(j["results"].size(), 2u * 6 + 2u * 4);
  EXPECT_NE(r.err.find("correctness check against the reference passed"), std::string::npos);
}

TEST(Cli, BenchAttentionBadInputGetsOneLineErrorExitTwo) {
  const BadInput cases[] = {
      {"head dim not built", "--head-dim 48", "--head-dim 48"},
      {"zero document", "--docs 0", "--docs"},
      {"huge document", "--docs 99999999", "--docs"},
      {"zero shard", "--shards 0", "--shards"},
      {"gqa mismatch", "--heads 6 --kv-heads 4", "--heads 6"},
      {"zero repeats", "--repeats 0", "--repeats"},
      {"negative threads", "--threads -1", "--threads"},
      {"non-numeric", "--docs many", "docs"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("bench attention " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.name;
  }
  EXPECT_EQ(distca("bench").exit_code, 2);
}

TEST(Cli, BenchDispatchJsonHasTheDocumentedFields) {
  CmdResult r = distca("bench dispatch --quick --link 2 --latency-us 5 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format"], "distca-bench-dispatch");
  EXPECT_EQ(j["comm"], "local");
  EXPECT_EQ(j["headline"], "emulated");
  for (const char* field : {"bytes_fwd", "bytes_bwd", "bytes_bwd_stateless", "bytes_bwd_stateful"}) {
    EXPECT_GT(j[field].get<int64_t>(), 0) << field;
  }
  EXPECT_LT(j["bytes_bwd_stateful"].get<int64_t>(), j["bytes_bwd_stateless"].get<int64_t>());
  for (const char* run : {"real", "emulated"}) {
    for (const char* field : {"seq_seconds", "pingpong_seconds", "compute_seconds", "comm_seconds"}) {
      EXPECT_GT(j[run][field].get<double>(), 0.0) << run << "." << field;
    }
    EXPECT_TRUE(std::isfinite(j[run]["hidden_fraction"].get<double>())) << run;
  }
  EXPECT_DOUBLE_EQ(j["emulated"]["link_gbps"].get<double>(), 2.0);
  EXPECT_EQ(j["seq_seconds"], j["emulated"]["seq_seconds"]);
  EXPECT_EQ(j["hidden_fraction"], j["emulated"]["hidden_fraction"]);
}

TEST(Cli, BenchDispatchBadInputGetsOneLineErrorExitTwo) {
  const BadInput cases[] = {
      {"zero ranks", "--ranks 0", "--ranks"},
      {"head dim not built", "--head-dim 48", "--head-dim"},
      {"gqa mismatch", "--heads 6 --kv-heads 4", "--heads (6)"},
      {"unknown workload", "--workload web", "web"},
      {"unknown policy", "--policy best", "best"},
      {"unknown backward", "--backward sometimes", "--backward"},
      {"bad link", "--link fast", "--link"},
      {"negative latency", "--latency-us -1", "--latency-us"},
      {"zero layers", "--layers 0", "--layers"},
      {"tiny batch", "--tokens-per-rank 10", "--tokens-per-rank"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("bench dispatch --quick " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.name;
  }
}

TEST(Cli, ProfileWritesAProfileTheSimulatorReads) {
  const std::string out = (scratch() / "cpu_profile.json").string();
  CmdResult r = distca("profile --preset tiny --ranks 2 --repeats 1 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(distca::read_text_file(out).value());
  EXPECT_EQ(j["format"], "distca-profile");
  EXPECT_EQ(j["version"], 1);
  EXPECT_GE(j["attention"][0]["points"].size(), 2u);
  EXPECT_GT(j["linear_models"][0]["seconds_per_token_layer"].get<double>(), 0.0);
  EXPECT_GT(j["inter_node"]["bytes_per_second"].get<double>(), 0.0);
  CmdResult sim = distca("simulate --gpus 16 --tp 8 --context 16K --profile " + out + " --json");
  EXPECT_EQ(sim.exit_code, 0) << sim.err;
  EXPECT_EQ(distca("profile --preset tiny --context 10").exit_code, 2);
}

TEST(Cli, BenchCalibrationReportsPredictedAndMeasuredSteps) {
  CmdResult r = distca("bench calibration --preset tiny --steps 3 --ranks 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  for (const char* field : {"predicted_colocated", "measured_colocated", "predicted_cad", "measured_cad"}) {
    EXPECT_GT(j[field].get<double>(), 0.0) << field;
  }
  EXPECT_EQ(j["steps"].size(), 6u);
  EXPECT_EQ(distca("bench calibration --steps 1").exit_code, 2);
}

}  // namespace
