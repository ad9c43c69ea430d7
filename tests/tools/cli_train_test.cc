// The `distca train` command line, run as a user runs it (see cli_util.h).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <unistd.h>

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
  EXPECT_EQ(j["version"], 3);
  EXPECT_EQ(j["config"]["pp"], 1);
  EXPECT_EQ(j["steps"].size(), 8u);
  const auto& s = j["summary"];
  for (const char* field : {"colocated_step_seconds", "cad_step_seconds", "cad_over_bound", "speedup", "loss_first",
                            "loss_last"}) {
    EXPECT_GT(s[field].get<double>(), 0.0) << field;
  }
  EXPECT_LE(s["loss_max_rel_diff"].get<double>(), 1e-5);
  int64_t expected_step = 1;
  for (const auto& rec : j["steps"]) {
    for (const char* field : {"loss", "step_seconds", "tokens_per_second", "slowest_rank", "attention_imbalance",
                              "bound_seconds", "micro_batches", "split_micro_batches", "attention_tasks", "ranks"}) {
      EXPECT_TRUE(rec.contains(field)) << field;
    }
    // The JSON numbers steps as the console does (from 1); every rank's parts add up to its
    // step, and the step is the straggler's.
    EXPECT_EQ(rec["step"].get<int64_t>(), expected_step) << rec.dump();
    if (rec["backend"] == "cad") ++expected_step;
    ASSERT_EQ(rec["ranks"].size(), 2u);
    for (const auto& x : rec["ranks"]) {
      double parts = 0;
      for (const char* part : {"linear_seconds", "attention_seconds", "comm_seconds", "pipeline_wait_seconds",
                               "idle_seconds", "wait_seconds", "optimizer_seconds", "other_seconds"}) {
        parts += x[part].get<double>();
      }
      EXPECT_NEAR(parts, x["step_seconds"].get<double>(), 1e-9);
    }
    EXPECT_EQ(rec["step_seconds"], rec["ranks"][rec["slowest_rank"].get<int>()]["step_seconds"]);
    EXPECT_LE(rec["bound_seconds"].get<double>(), rec["step_seconds"].get<double>());
    // Memory: each rank's is its states + activations + attention buffers; the fullest rank's is
    // the max, the mean no larger; states are parameters, gradients and two moments in fp32.
    int64_t most = 0;
    for (const auto& x : rec["ranks"]) {
      const int64_t states = x["memory_states_bytes"], acts = x["memory_activations_bytes"], attn = x["memory_attention_bytes"];
      EXPECT_EQ(x["memory_bytes"].get<int64_t>(), states + acts + attn);
      most = std::max(most, x["memory_bytes"].get<int64_t>());
      EXPECT_EQ(states % 16, 0);
      EXPECT_GT(acts, 0);
      if (rec["backend"] == "cad") {
        EXPECT_GT(attn, 0);
      }
    }
    EXPECT_EQ(rec["memory_max_bytes"].get<int64_t>(), most);
    EXPECT_LE(rec["memory_mean_bytes"].get<double>(), rec["memory_max_bytes"].get<double>());
  }
  for (const char* backend : {"colocated", "cad"}) {
    EXPECT_GE(s["backends"][backend]["memory_max_over_mean"].get<double>(), 1.0) << backend;
    EXPECT_GT(s["backends"][backend]["memory_max_bytes"].get<int64_t>(), 0) << backend;
  }
  EXPECT_NE(r.out.find("memory per rank, the fullest rank's peak"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step    1/4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loss, mean of first 2 -> last 2"), std::string::npos) << r.out;
  // Resuming continues at step 4.
  CmdResult resumed = distca("train --preset tiny --compare --steps 6 --ranks 2 --resume " + ckpt);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed after step 4"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("step    5/6"), std::string::npos) << resumed.out;
  EXPECT_EQ(resumed.out.find("step    4/6"), std::string::npos) << resumed.out;
}

// --pp: the tick tables as printed, the refusals, and a compared run whose every rank's parts add
// up to its step, with the same losses under both schedules.
// --tp: the rank map printed and in the JSON, the model's split named, layouts the model or the
// ranks cannot take refused with the reason.
TEST(Cli, TrainTensorParallelPrintsItsRankMapAndRefusesLayoutsItCannotSplit) {
  const std::string json = (scratch() / "train-tp.json").string();
  CmdResult run = distca("train --preset tiny --tp 2 --ranks 4 --compare --steps 2 --json " + json);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("tensor parallel over 2 ranks: 1/1 heads and ffn 64 each, each key/value head shared by 2 ranks"),
            std::string::npos) << run.out;
  EXPECT_NE(run.out.find("ranks      tp 2 x pp 1 x dp 2 (rank = (pp x 2 + dp) x 2 + tp):"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rank 3: tp 1, pp 0, dp 1; groups tp [2 3], dp [1 3], pp [3], cad servers [1 3]"), std::string::npos) << run.out;
  auto j = nlohmann::json::parse(distca::read_text_file(json).value());
  EXPECT_EQ(j["config"]["tp"], 2);
  EXPECT_EQ(j["rank_map"]["dp"], 2);
  ASSERT_EQ(j["rank_map"]["ranks"].size(), 4u);
  EXPECT_EQ(j["rank_map"]["ranks"][1]["cad_group"], nlohmann::json::array({1, 3}));
  EXPECT_LT(j["summary"]["loss_max_rel_diff"].get<double>(), 1e-6);
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--tp 2 --ranks 3", "--tp 2 x --pp 1 must divide the 3 ranks"},
           {"--tp 4 --ranks 4", "--tp 4 must divide the model's query heads (2)"},
           {"--tp 0", "--tp must be 1..1024"},
           {"--tp 2 --checkpoint x.ckpt", "--tp does not support --checkpoint or --resume yet"}}) {
    CmdResult bad = distca("train --preset tiny --steps 1 " + args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.out;
    EXPECT_NE(bad.err.find(message), std::string::npos) << args << ": " << bad.err;
  }
}

TEST(Cli, TrainPingPongSplitsCadStepsByDefaultAndRefusesWhatItCannotRun) {
  const std::string json = (scratch() / "train-pingpong.json").string();
  CmdResult run = distca("train --preset tiny --ranks 2 --compare --steps 3 --json " + json);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("ping-pong  on for cad: each step splits into two nano-batches"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("off for colocated"), std::string::npos) << run.out;
  auto j = nlohmann::json::parse(distca::read_text_file(json).value());
  EXPECT_EQ(j["config"]["pingpong"], "auto");
  int split = 0;
  for (const auto& r : j["steps"]) {
    EXPECT_EQ(r["micro_batches"], 1);
    if (r["backend"] == "colocated") {
      EXPECT_EQ(r["split_micro_batches"], 0);
    }
    if (r["backend"] == "cad") split += r["split_micro_batches"].get<int>();
  }
  EXPECT_GE(split, 1);
  EXPECT_LT(j["summary"]["loss_max_rel_diff"].get<double>(), 1e-5);
  CmdResult off = distca("train --preset tiny --ranks 2 --steps 2 --pingpong off");
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_NE(off.out.find("ping-pong  off for cad"), std::string::npos) << off.out;
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--pingpong maybe", "--pingpong must be on or off"},
           {"--pingpong sequential", "--pingpong must be on or off"},
           {"--progress spin", "--progress must be none, poll or thread"},
           {"--progress-interval-us 200000", "--progress-interval-us must be 10..100000"},
           {"--grad-sync later", "--grad-sync must be overlap, eager or after"}}) {
    CmdResult bad = distca("train --preset tiny --steps 1 " + args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.out;
    EXPECT_NE(bad.err.find(message), std::string::npos) << args << ": " << bad.err;
  }
}

TEST(Cli, TrainMemoryBudgetAndTraceAreCheckedBeforeTraining) {
  const std::string trace = (scratch() / "train-trace.json").string();
  CmdResult run = distca("train --preset tiny --ranks 2 --compare --steps 2 --trace-steps 1 --trace " + trace);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("memory     budget auto: each step 1.05 x what colocated attention needs"), std::string::npos) << run.out;
  const auto doc = nlohmann::json::parse(distca::read_text_file(trace).value());
  EXPECT_EQ(doc["otherData"]["format"], "distca-trace");
  EXPECT_EQ(doc["otherData"]["config"]["memory_budget"], "auto");
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--memory-budget 1", "--memory-budget 1.000 MiB is below what any plan needs on a rank"},
           {"--memory-budget lots", "--memory-budget must be MiB per rank (a positive number), auto or unlimited"},
           {"--memory-budget -5", "--memory-budget must be MiB per rank (a positive number), auto or unlimited"},
           {"--pp 2 --memory-budget 100", "--memory-budget governs the data-parallel trainer"},
           {"--pp 2 --trace " + trace, "the pipeline trainer (--pp) writes no trace yet"},
           {"--trace-steps 0 --trace " + trace, "--trace-steps must be 1..10000"},
           {"--trace " + trace + " --json " + trace, "name the same file"}}) {
    CmdResult bad = distca("train --preset tiny --ranks 2 --steps 1 " + args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.out;
    EXPECT_NE(bad.err.find(message), std::string::npos) << args << ": " << bad.err;
  }
}

TEST(Cli, TrainPipelinePrintsItsScheduleAndReportsPartsThatAddUp) {
  CmdResult r = distca("train --preset tiny --pp 2 --micro-batches 3 --print-schedule --compare");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("stage 0: F0 F1 .  B0 F2 B1 .  B2\nstage 1: .  F0 B0 F1 B1 F2 B2 .\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stage 0: F0 F1 .  F2 B0 .  B1 B2\nstage 1: .  F0 B0 F1 B1 F2 B2 .\n"), std::string::npos) << r.out;
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--pp 3", "--pp 3 must divide the model's 2 layers"},
           {"--micro-batches 3", "--micro-batches, --print-schedule and --recompute shape a pipeline: add --pp P"},
           {"--recompute", "--micro-batches, --print-schedule and --recompute shape a pipeline: add --pp P"},
           {"--pp 2 --eval-every 1", "--pp does not support --checkpoint, --resume or --eval-every yet"},
           {"--pp 2 --backward-mode stateful", "its backward is stateless: drop --backward-mode stateful"},
           {"--pp 2 --micro-batches -1", "--micro-batches must be 1..4096"},
           {"--pp 4 --ranks 2 --layers 4", "--pp 4 must divide the 2 ranks"}}) {
    CmdResult bad = distca("train --preset tiny --steps 1 " + args);
    EXPECT_EQ(bad.exit_code, 2) << args << ": " << bad.out;
    EXPECT_NE(bad.err.find(message), std::string::npos) << args << ": " << bad.err;
  }
  const std::string json = (scratch() / "train-pp.json").string();
  CmdResult run = distca("train --preset tiny --layers 4 --pp 2 --micro-batches 3 --compare --steps 3 --ranks 4 --json " + json);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("2 pipeline stages x 2 data-parallel replicas, 3 micro-batches"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("ranks      tp 1 x pp 2 x dp 2"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rank 2: tp 0, pp 1, dp 0; groups tp [2], dp [2 3], pp [0 2], cad servers [0 1 2 3]"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("speedup of CAD over colocated 1F1B"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("ping-pong  on for cad: each micro-batch splits into two nano-batches"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("off for colocated"), std::string::npos) << run.out;
  auto j = nlohmann::json::parse(distca::read_text_file(json).value());
  EXPECT_EQ(j["format"], "distca-train");
  EXPECT_EQ(j["version"], 3);
  EXPECT_EQ(j["config"]["pp"], 2);
  EXPECT_EQ(j["config"]["micro_batches"], 3);
  ASSERT_EQ(j["steps"].size(), 6u);
  double served = 0;
  int split = 0;
  for (const auto& rec : j["steps"]) {
    EXPECT_EQ(rec["micro_batches"], 3);
    if (rec["backend"] == "colocated") {
      EXPECT_EQ(rec["split_micro_batches"], 0);
    }
    if (rec["backend"] == "cad") split += rec["split_micro_batches"].get<int>();
    EXPECT_GT(rec["attention_tasks"].get<int64_t>(), 0);
    if (rec["backend"] == "cad") {
      EXPECT_GT(rec["attention_bytes"].get<int64_t>(), 0);  // the pooled plans move work between stages
    }
    ASSERT_EQ(rec["ranks"].size(), 4u);
    for (const auto& x : rec["ranks"]) {
      double parts = 0;
      for (const char* part : {"linear_seconds", "attention_seconds", "comm_seconds", "pipeline_wait_seconds", "idle_seconds",
                               "wait_seconds", "optimizer_seconds", "other_seconds"}) {
        parts += x[part].get<double>();
      }
      EXPECT_NEAR(parts, x["step_seconds"].get<double>(), 1e-9);
      EXPECT_LE(x["served_in_idle_seconds"].get<double>(), x["attention_seconds"].get<double>() + 1e-9);
      if (rec["backend"] == "colocated") {
        EXPECT_EQ(x["served_in_idle_seconds"].get<double>(), 0.0);
      }
      if (rec["backend"] == "cad") served += x["served_in_idle_seconds"].get<double>();
    }
    EXPECT_EQ(rec["step_seconds"], rec["ranks"][rec["slowest_rank"].get<int>()]["step_seconds"]);
  }
  // In the warm-up and cool-down ticks the idle stage's ranks serve attention.
  EXPECT_GT(served, 0.0);
  EXPECT_GE(split, 1);  // cad's micro-batches of several documents ran in ping-pong
  EXPECT_LE(j["summary"]["loss_max_rel_diff"].get<double>(), 1e-5);

  // --recompute: the first stage recomputes (its seconds inside linear), the last none.
  const std::string json2 = (scratch() / "train-pp-recompute.json").string();
  CmdResult again = distca("train --preset tiny --layers 4 --pp 2 --micro-batches 3 --steps 3 --recompute --json " + json2);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("--recompute: every stage holds as many workspaces as the last stage"), std::string::npos) << again.out;
  auto k = nlohmann::json::parse(distca::read_text_file(json2).value());
  EXPECT_EQ(k["config"]["recompute"], true);
  ASSERT_EQ(k["steps"].size(), 3u);
  for (const auto& rec : k["steps"]) {
    const auto& first = rec["ranks"][0];
    EXPECT_GT(first["recompute_seconds"].get<double>(), 0.0);
    EXPECT_LE(first["recompute_seconds"].get<double>(), first["linear_seconds"].get<double>());
    EXPECT_EQ(rec["ranks"][1]["recompute_seconds"].get<double>(), 0.0);
  }
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
      {"unknown grad return", "--grad-return fp16", "--grad-return must be bf16 or fp32"},
      {"grad return without cad", "--attention colocated --grad-return bf16", "--grad-return"},
      {"save without a path", "--save-every 2", "--checkpoint"},
      {"zero ranks", "--ranks 0", "--ranks"},
      {"missing data", "--data /nonexistent/corpus.jsonl", "/nonexistent/corpus.jsonl"},
      {"bad jsonl line", "--data " + bad_jsonl, "bad.jsonl:2"},
      {"not a checkpoint", "--resume " + not_ckpt, "not a distca checkpoint"},
      {"missing checkpoint", "--resume /nonexistent.ckpt", "/nonexistent.ckpt"},
      {"policy all", "--policy all", "one planner"},
      {"workload with data", "--workload prolong --data " + bad_jsonl, "--workload"},
      {"seed with data", "--seed 3 --data " + bad_jsonl, "--seed"},
      {"attention with compare", "--attention colocated --compare", "--compare"},
      {"policy without cad", "--attention colocated --policy distca", "--policy"},
      {"tolerance without cad", "--attention colocated --tolerance 0.1", "--tolerance"},
      {"granularity above the context", "--granularity 100000", "--granularity"},
      {"negative granularity", "--granularity -1", "--granularity"},
      {"granularity not a power of two", "--granularity 7", "power of two"},
      {"granularity below a tile", "--granularity 1", "power of two"},
      {"skip every step", "--skip 10", "--skip"},
      {"zero timeout", "--timeout 0", "--timeout"},
      {"more memory than the machine", "--context 100000000", "GiB"},
      {"json into a missing folder", "--checkpoint /nonexistent/ck.bin", "/nonexistent"},
      {"json and checkpoint on one file", "--checkpoint " + json, "same file"},
      {"unknown schedule", "--lr-schedule step", "--lr-schedule"},
      {"floor without a decay", "--min-lr 0.0001", "--lr-schedule"},
      {"floor above the peak", "--lr-schedule cosine --lr 0.001 --min-lr 0.01", "--min-lr"},
      {"eval docs without eval", "--eval-docs 5", "--eval-every"},
      {"eval docs of the synthetic source", "--eval-every 1 --eval-docs 5", "--eval-docs"},
      {"eval past the last step", "--eval-every 9", "--eval-every"},
  };
  for (const BadInput& c : cases) {
    const std::string preset = c.args.find("--preset") == std::string::npos ? "--preset tiny " : "";
    CmdResult r = distca("train " + preset + "--steps 2 --json " + json + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(r.out, "") << c.name << ": refused before any work";
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_FALSE(fs::exists(json)) << c.name;
  }
}

// More busy threads than cores: the times measure ranks taking turns, and the user is told.
TEST(Cli, TrainWarnsWhenRanksTimesThreadsExceedTheCores) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < 1 || cores > 16) GTEST_SKIP() << cores << " cores: too many ranks to start for this check";
  CmdResult over = distca("train --preset tiny --steps 1 --threads 1 --ranks " + std::to_string(cores + 1));
  ASSERT_EQ(over.exit_code, 0) << over.err;
  EXPECT_NE(over.err.find(fmt::format("{} busy threads on {} cores", cores + 1, cores)), std::string::npos) << over.err;
  CmdResult fits = distca("train --preset tiny --steps 1 --threads 1 --ranks 1");
  ASSERT_EQ(fits.exit_code, 0) << fits.err;
  EXPECT_EQ(fits.err.find("busy threads"), std::string::npos) << fits.err;
}

TEST(Cli, TrainScheduleValidationAndEpochs) {
  // 30 small documents, 10 held out: the other 20 wrap within 8 steps, and the run says so.
  std::string corpus;
  for (int i = 0; i < 30; ++i) corpus += "{\"text\": \"" + std::string(40 + 7 * i, static_cast<char>('a' + i % 26)) + "\"}\n";
  const std::string data = write("corpus.jsonl", corpus);
  const std::string json = (scratch() / "schedule.json").string();
  CmdResult r = distca("train --preset tiny --ranks 2 --steps 8 --warmup 2 --lr-schedule cosine --min-lr 0.0002 --data " +
                       data + " --eval-every 4 --eval-docs 10 --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("data: epoch 2 begins"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("last 10 held out"), std::string::npos) << r.out;
  auto j = nlohmann::json::parse(distca::read_text_file(json).value());
  const auto& steps = j["steps"];
  ASSERT_EQ(steps.size(), 8u);
  EXPECT_NEAR(steps[1]["lr"].get<double>(), 0.001, 1e-12) << "the peak at the end of warm-up";
  EXPECT_NEAR(steps[7]["lr"].get<double>(), 0.0002, 1e-12) << "the floor at the last step";
  for (size_t i = 2; i < steps.size(); ++i) EXPECT_LT(steps[i]["lr"].get<double>(), steps[i - 1]["lr"].get<double>());
  ASSERT_EQ(j["validation"].size(), 2u);  // after steps 4 and 8
  EXPECT_EQ(j["validation"][0]["step"], 4);
  EXPECT_EQ(j["validation"][1]["step"], 8);
  EXPECT_LT(j["validation"][1]["loss"].get<double>(), j["validation"][0]["loss"].get<double>());
}

TEST(Cli, TrainResumeOnRewrittenDataIsRefused) {
  // Same document count, other text: the data is identified by content, not name and count.
  const std::string data = write("resume.jsonl", "{\"text\": \"first document\"}\n{\"text\": \"second one\"}\n");
  const std::string ckpt = (scratch() / "data.ckpt").string();
  ASSERT_EQ(distca("train --preset tiny --ranks 2 --steps 2 --data " + data + " --checkpoint " + ckpt).exit_code, 0);
  write("resume.jsonl", "{\"text\": \"other document\"}\n{\"text\": \"other texts\"}\n");
  CmdResult r = distca("train --preset tiny --ranks 2 --steps 4 --data " + data + " --resume " + ckpt);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("data"), std::string::npos) << r.err;
}

TEST(Cli, TrainResumeAtOrPastTheLastStepIsRefused) {
  // It once crashed (exit 139) summarizing an empty list of steps.
  const std::string ckpt = (scratch() / "done.ckpt").string();
  ASSERT_EQ(distca("train --preset tiny --steps 4 --ranks 2 --checkpoint " + ckpt + " --save-every 2").exit_code, 0);
  for (const char* steps : {"4", "3"}) {
    CmdResult r = distca(std::string("train --preset tiny --ranks 2 --steps ") + steps + " --resume " + ckpt);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("nothing left to train"), std::string::npos) << r.err;
  }
  // --skip that leaves nothing after the resumed step is refused too.
  CmdResult skip = distca("train --preset tiny --ranks 2 --steps 6 --skip 2 --resume " + ckpt);
  EXPECT_EQ(skip.exit_code, 2) << skip.err;
  EXPECT_NE(skip.err.find("--skip"), std::string::npos) << skip.err;
}

TEST(Cli, TrainOutputPathsAreCheckedBeforeTraining) {
  // A missing folder is named at once (not after the run, not as a .tmp file).
  CmdResult r = distca("train --preset tiny --steps 50 --ranks 2 --json /nonexistent/x.json");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("--json /nonexistent/x.json"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".tmp"), std::string::npos) << r.err;
  // The report may not replace the checkpoint it resumes from.
  const std::string ckpt = (scratch() / "keep.ckpt").string();
  ASSERT_EQ(distca("train --preset tiny --steps 2 --ranks 2 --checkpoint " + ckpt).exit_code, 0);
  const std::string before = distca::read_text_file(ckpt).value();
  CmdResult same = distca("train --preset tiny --steps 4 --ranks 2 --resume " + ckpt + " --json " + ckpt);
  EXPECT_EQ(same.exit_code, 2) << same.err;
  EXPECT_EQ(distca::read_text_file(ckpt).value(), before);
}

TEST(Cli, TrainRuntimeFailureExitsOneWithTheRealError) {
  // As root, /proc passes the early check (the folder is there and access() allows root) but
  // the write fails when the checkpoint is saved: a failed run, exit 1, and the message names
  // the path and the reason, whichever rank reports it.
  if (geteuid() != 0) GTEST_SKIP() << "needs root for the early check to pass";
  CmdResult r = distca("train --preset tiny --steps 2 --ranks 2 --checkpoint /proc/distca-ck.bin");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("/proc/distca-ck.bin: cannot open for writing"), std::string::npos) << r.err;
}

#ifdef DISTCA_MPIRUN
using cli::mpirun;

// Under mpirun the same exit codes, one message, and no MPI_Abort banner for errors every rank
// knows.

TEST(Cli, TrainUnderMpirunReportsOnceWithTheSameExitCodes) {
  const std::string bad_jsonl = write("mpi_bad.jsonl", "{\"text\": \"fine\"}\nnot json\n");
  const BadInput cases[] = {
      {"bad data", "train --preset tiny --data " + bad_jsonl, "mpi_bad.jsonl:2"},
      {"--ranks under mpirun", "train --preset tiny --ranks 4", "--ranks"},
      {"missing output folder", "train --preset tiny --checkpoint /nonexistent/ck.bin", "/nonexistent"},
      {"usage error", "train --preset tiny --steps 0", "--steps"},
      {"unknown command", "plna", "plan"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = mpirun(2, c.args);
    expect_refused(r, c);
    EXPECT_EQ(r.err.find("MPI_ABORT"), std::string::npos) << c.name << ": " << r.err;
  }
  if (geteuid() == 0) {
    CmdResult r = mpirun(2, "train --preset tiny --steps 2 --checkpoint /proc/distca-ck.bin");
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("/proc/distca-ck.bin: cannot open for writing"), std::string::npos) << r.err;
  }
  CmdResult good = mpirun(2, "train --preset tiny --steps 2");
  EXPECT_EQ(good.exit_code, 0) << good.err;
}

// plan and simulate run in one process: under mpirun rank 0 alone reports, once.
TEST(Cli, PlanAndSimulateUnderMpirunReportOnce) {
  const BadInput cases[] = {
      {"plan usage error", "plan --granularity 7", "--granularity"},
      {"plan unknown policy", "plan --policy fastest", "fastest"},
      {"simulate usage error", "simulate --paper --iterations 0", "--iterations"},
  };
  for (const BadInput& c : cases) expect_refused(mpirun(2, c.args), c);
  CmdResult good = mpirun(2, "plan --ranks 8 --tokens-per-rank 4096 --policy minmax");
  EXPECT_EQ(good.exit_code, 0) << good.err;
  size_t reports = 0;
  for (size_t at = good.out.find("Balance and bytes"); at != std::string::npos;
       at = good.out.find("Balance and bytes", at + 1)) {
    ++reports;
  }
  EXPECT_EQ(reports, 1u) << good.out;
}
#endif

}  // namespace
