// Runs the real `distca` binary: good runs print the documented JSON; every bad input gets a
// one-line error naming the problem, exit code 2, and no output file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "distca/core/file.h"
#include "distca/plan/plan_io.h"

namespace {

namespace fs = std::filesystem;

struct CmdResult {
  int exit_code;
  std::string out;
  std::string err;
};

const fs::path& scratch() {
  static const fs::path dir = [] {
    // One folder per process: ctest runs the tests of this file in parallel processes.
    fs::path d = fs::temp_directory_path() / ("distca_cli_test." + std::to_string(getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

CmdResult distca(const std::string& args) {
  const std::string out = (scratch() / "stdout").string();
  const std::string err = (scratch() / "stderr").string();
  const std::string cmd = std::string(DISTCA_BIN) + " " + args + " >" + out + " 2>" + err + " </dev/null";
  const int status = std::system(cmd.c_str());
  return CmdResult{WIFEXITED(status) ? WEXITSTATUS(status) : -1, distca::read_text_file(out).value(),
             distca::read_text_file(err).value()};
}

std::string write(const std::string& name, const std::string& text) {
  const std::string path = (scratch() / name).string();
  EXPECT_TRUE(distca::write_file_atomic(path, text).is_ok());
  return path;
}

int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

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

struct BadInput {
  const char* name;
  std::string args;
  const char* expected;  // a word the one-line error must contain
};

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
      {"missing batch file", "--batch /nonexistent/b.json", "cannot open"},
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
