// The `distca plan` command line, run as a user runs it (see cli_util.h).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "distca/core/file.h"
#include "distca/plan/plan_io.h"

#include "cli_util.h"

namespace {

using cli::BadInput;
using cli::CmdResult;
using cli::count_lines;
using cli::distca;
using cli::simple_profile;
using cli::scratch;
using cli::write;
namespace fs = std::filesystem;

// Progress lines on stderr while a plan runs (DISTCA_PROGRESS_INTERVAL=0: every stage at once,
// no delay; by default nothing before 2 s, then at most one a second): each rung auto plans, and
// the report after them. A bad interval is refused up front; --quiet has none.
TEST(Cli, PlanSaysWhatItIsDoingOnStderr) {
  const std::string args = " plan --ranks 64 --workload prolong --policy minmax --json";
  CmdResult r = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=0 ") + DISTCA_BIN + args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.rfind("distca plan: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(" s: predicting the step of each eps for minmax (64 ranks; --tolerance auto)\n"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("s: planning minmax at eps 0."), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(64 ranks; --tolerance auto: plan 1 of at most 3)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("s: verifying and pricing the minmax plan\n"), std::string::npos) << r.err;
  EXPECT_NO_THROW((void)nlohmann::json::parse(r.out)) << "stdout stays the report alone";
  CmdResult quiet = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=0 ") + DISTCA_BIN + " --quiet" + args);
  ASSERT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_EQ(quiet.err.find("s: planning"), std::string::npos) << quiet.err;
  for (const char* bad : {"-1", "soon", "7200"}) {
    CmdResult b = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=") + bad + " " + DISTCA_BIN + args);
    cli::expect_refused(b, BadInput{bad, "", "DISTCA_PROGRESS_INTERVAL must be 0 (every stage at once) or a number of "
                                             "seconds in 0.1..3600"});
  }
}

// Issue 72 row 9: a positive interval has a floor of 0.1 s (before, 1e-300 was taken and printed
// 26,262 progress lines in 1.9 s): below it the run is refused, exit 2, one line naming the
// variable; 0 (every stage at once) and 0.1 run.
TEST(Cli, ProgressIntervalBelowATenthOfASecondIsRefused) {
  const std::string args = " plan --ranks 8 --tokens-per-rank 4096 --policy minmax --tolerance 0.1 --json";
  for (const char* bad : {"1e-300", "0.05", "0.0999"}) {
    CmdResult b = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=") + bad + " " + DISTCA_BIN + args);
    cli::expect_refused(b, BadInput{bad, "", "DISTCA_PROGRESS_INTERVAL must be 0 (every stage at once) or a number of "
                                             "seconds in 0.1..3600"});
    EXPECT_NE(b.err.find(std::string("got '") + bad + "'"), std::string::npos) << b.err;
  }
  for (const char* good : {"0", "0.1", "3600"}) {
    CmdResult g = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=") + good + " " + DISTCA_BIN + args);
    EXPECT_EQ(g.exit_code, 0) << good << ": " << g.err;
  }
}

// A plan that runs out of memory ends with one line and exit 1 (before: "terminate called after
// throwing an instance of 'std::bad_alloc'" and SIGABRT). The planning fits (its estimate passes);
// one phase's flows, which --out holds to write them (6.4 million here, about 300 MB) and the
// estimate cannot know, do not: the same run without --out fits. One OpenBLAS thread and one malloc
// arena keep the address space small and the same from run to run (OpenBLAS's threads map their
// buffers while the run starts, 135 MB of address space in some runs and not in others).
TEST(Cli, PlanOutOfMemoryIsOneLineAndExitOne) {
  const std::string out = (scratch() / "oom-plan.json").string();
  // No progress line (a run slowed by a loaded machine passes the default 1 s): the error is the one line.
  CmdResult r = cli::run_shell(std::string("ulimit -v 200000; env OPENBLAS_NUM_THREADS=1 MALLOC_ARENA_MAX=1 "
                                           "DISTCA_PROGRESS_INTERVAL=3600 ") + DISTCA_BIN +
                               " plan --ranks 12000 --tokens-per-rank 16 --policy minbytes --tolerance 0.1 --out " + out);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("distca plan: error: out of memory"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_FALSE(fs::exists(out));
}

// Issue 72 row 8: a plan that cannot fit is refused up front, from its ranks and the documents
// its tokens hold, in one line and exit 2, before anything is sampled or planned (before: the
// kernel's OOM killer, no message). The estimate counts what is left under ulimit -v here, and a
// memory cgroup's limit (MemoryCheck.*).
TEST(Cli, PlanThatCannotFitIsRefusedBeforeAnyWork) {
  for (const std::string args : {"plan --ranks 1000000 --tokens-per-rank 16", "plan --ranks 1000000 --tokens-per-rank 2000 --policy all"}) {
    CmdResult r = cli::run_shell(std::string("ulimit -v 400000; ") + DISTCA_BIN + " " + args);
    cli::expect_refused(r, BadInput{"1M ranks", args, "distca plan: error: plan needs about "});
    EXPECT_NE(r.err.find("1000000 ranks and about "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("lower --ranks or --tokens-per-rank"), std::string::npos) << r.err;
  }
  const std::string batch = write("too-big-batch.json", [] {
    std::string text = R"({"ranks": [)";
    for (int r = 0; r < 200000; ++r) text += r == 0 ? "[16]" : ",[16]";
    return text + "]}";
  }());
  CmdResult b = cli::run_shell(std::string("ulimit -v 400000; ") + DISTCA_BIN + " plan --batch " + batch);
  cli::expect_refused(b, BadInput{"200000-rank batch", "", "plan needs about "});
  EXPECT_NE(b.err.find("200000 ranks and 200000 documents"), std::string::npos) << b.err;
}

// Issue 72 row 8: planning's memory grows with the plan (its tasks and ranks), not with the flows
// between ranks, which number up to R^2 where documents span many ranks (16 tokens a rank: a
// document over thousands). Before, every candidate plan held its flows: 680 MB at 5,000 ranks,
// 5 GB at 12,000, OOM-killed at 20,000 in 6 GiB; now about 1 KiB per task and rank.
TEST(Cli, PlanMemoryGrowsWithItsTasksAndRanksNotItsFlows) {
  // Peak resident memory of one `distca plan ... --json` run, and its report.
  auto run = [](const std::string& args) {
    const std::string out = (scratch() / "memory-plan.json").string();
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      const int null = open("/dev/null", O_WRONLY);
      dup2(null, 2);
      execl("/bin/sh", "sh", "-c", (std::string("exec ") + DISTCA_BIN + " plan --json " + args).c_str(), nullptr);
      _exit(127);
    }
    int status = 0;
    rusage usage{};
    EXPECT_EQ(wait4(pid, &status, 0, &usage), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << args;
    return std::make_pair(int64_t{usage.ru_maxrss} * 1024, nlohmann::json::parse(distca::read_text_file(out).value()));
  };
  const auto [small_peak, small] = run("--ranks 8 --tokens-per-rank 16");
  const auto [peak, report] = run("--ranks 5000 --tokens-per-rank 16");
  const int64_t units = report["tasks"].get<int64_t>() + report["ranks"].get<int64_t>();
  EXPECT_LT(peak - small_peak, 4096 * units) << "peak " << peak << " bytes, " << small_peak << " at 8 ranks, for "
                                             << units << " tasks and ranks";
}

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

// --json-out: the JSON report to a file while the tables print, from one run (the plan's own
// timings differ between runs); with --json both outputs are the same object. A path that cannot
// be written, or one that names an input or --out, is refused before any work.
TEST(Cli, PlanJsonOutWritesTheReportBesideTheTables) {
  const std::string path = (scratch() / "plan-report.json").string();
  fs::remove(path);
  const std::string plan = "plan --ranks 8 --tokens-per-rank 32768 --workload prolong --policy minmax --tolerance 0.05";
  CmdResult r = distca(plan + " --json-out " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("minmax"), std::string::npos) << r.out;
  distca::Result<std::string> written = distca::read_text_file(path);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  const auto j = nlohmann::json::parse(written.value());
  EXPECT_EQ(j["policy"], "minmax");
  EXPECT_TRUE(j["verified"].get<bool>());
  CmdResult both = distca(plan + " --json --json-out " + path);
  ASSERT_EQ(both.exit_code, 0) << both.err;
  EXPECT_EQ(nlohmann::json::parse(both.out), nlohmann::json::parse(distca::read_text_file(path).value()));

  const std::string batch = write("json-out-batch.json", R"({"ranks": [[100, 28], [64, 64]]})");
  const std::string out = (scratch() / "json-out-plan.json").string();
  for (const std::string& args : {plan + " --json-out " + (scratch() / "no_such_folder" / "r.json").string(),
                                  plan + " --json-out " + scratch().string(), plan + " --json-out /dev/null", plan + " --json-out ''",
                                  "plan --batch " + batch + " --json-out " + batch,
                                  plan + " --out " + out + " --json-out " + out}) {
    SCOPED_TRACE(args);
    const std::string before = distca::read_text_file(batch).value();
    CmdResult bad = distca(args);
    EXPECT_EQ(bad.exit_code, 2) << bad.err;
    EXPECT_EQ(count_lines(bad.err), 1) << bad.err;
    EXPECT_NE(bad.err.find("--json-out"), std::string::npos) << bad.err;
    EXPECT_TRUE(bad.out.empty()) << bad.out;
    EXPECT_EQ(distca::read_text_file(batch).value(), before);
  }
  EXPECT_FALSE(fs::exists(out));
}

// Issue 72 row 10: "-" is not standard output for an output flag, and never a file named "-"
// (before, `--json-out -` on plan and simulate wrote one): refused before any work, exit 2, one
// line; for --json-out it points at --json, which prints the JSON report on stdout. The bench
// commands and every other output flag alike (one check, core/file.h's check_output_path).
TEST(Cli, JsonOutDashIsRefusedNotWrittenAsAFileNamedDash) {
  const fs::path dir = scratch() / "dash";
  fs::create_directories(dir);
  for (const std::string args :
       {"plan --ranks 8 --tokens-per-rank 4096 --json-out -", "simulate --gpus 64 --json-out -",
        "simulate --paper --json-out -", "bench planner --json-out -", "bench dispatch --quick --json-out -",
        "bench attention --json-out -", "bench calibration --preset tiny --json-out -"}) {
    CmdResult r = cli::run_shell("cd " + dir.string() + " && " + DISTCA_BIN + " " + args);
    cli::expect_refused(r, BadInput{"--json-out -", args, "--json-out -: '-' is not standard output here: --json prints"});
    EXPECT_FALSE(fs::exists(dir / "-")) << args;
  }
  for (const std::string args : {"simulate --gpus 64 --plot -", "train --preset tiny --steps 1 --json -",
                                 "train --preset tiny --steps 1 --checkpoint -", "profile --out -"}) {
    CmdResult r = cli::run_shell("cd " + dir.string() + " && " + DISTCA_BIN + " " + args);
    cli::expect_refused(r, BadInput{"-", args, " -: '-' is not standard output here (it would write a file named '-')"});
    EXPECT_FALSE(fs::exists(dir / "-")) << args;
  }
}

// The default eps is auto: the report names the eps each plan was made at and what auto tried,
// and --tolerance 0.05 plans at 0.05 with no search.
TEST(Cli, PlanToleranceIsAutoByDefaultAndReportsWhatItPicked) {
  CmdResult r = distca("plan --ranks 32 --workload prolong --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  const auto& a = j["tolerance_auto"];
  ASSERT_TRUE(a.is_object()) << r.out.substr(0, 400);
  EXPECT_EQ(j["tolerance"], a["tolerance"]);
  ASSERT_GE(a["tried"].size(), 1u);
  EXPECT_EQ(a["ladder_predicted"].size(), 8u);  // every rung predicted, a few planned
  double fastest = 1e300;
  for (const auto& t : a["tried"]) fastest = std::min(fastest, t["predicted_step_seconds_per_layer"].get<double>());
  bool found = false;
  for (const auto& t : a["tried"]) {
    if (t["tolerance"] == a["tolerance"]) {
      found = true;
      EXPECT_EQ(t["predicted_step_seconds_per_layer"].get<double>(), fastest);
    }
  }
  EXPECT_TRUE(found);
  EXPECT_LE(j["load_after"]["imbalance"].get<double>(), 1 + a["tolerance"].get<double>() + 1e-9);
  CmdResult table = distca("plan --ranks 32 --workload prolong");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("eps auto"), std::string::npos) << table.out;
  CmdResult fixed = distca("plan --ranks 32 --workload prolong --tolerance 0.05 --json");
  ASSERT_EQ(fixed.exit_code, 0) << fixed.err;
  auto f = nlohmann::json::parse(fixed.out);
  EXPECT_TRUE(f["tolerance_auto"].is_null());
  EXPECT_EQ(f["tolerance"], 0.05);
}

TEST(Cli, PolicyAllComparesEveryPolicy) {
  CmdResult r = distca("plan --ranks 8 --tokens-per-rank 16384 --policy all --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["policies"].size(), 5u);
  CmdResult table = distca("plan --ranks 8 --tokens-per-rank 16384 --policy all");
  ASSERT_EQ(table.exit_code, 0);
  for (const char* name : {"none", "distca", "minmax", "minbytes", "minlink"}) {
    EXPECT_NE(table.out.find(name), std::string::npos);
  }
}

TEST(Cli, BatchFileAndPlanOutputRoundTrip) {
  const std::string batch = write("batch.json", R"({"ranks": [[4096], [512, 512], [16], [1, 7, 1000]]})");
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
      {"tolerance above one", "--tolerance 2", "--tolerance must be in [0, 1]"},
      {"tolerance a word", "--tolerance fast", "--tolerance must be a number in [0, 1] or auto, got 'fast'"},
      {"negative seed", "--seed -1", "--seed must be >= 0"},
      {"zero gpus per node", "--gpus-per-node 0", "--gpus-per-node"},
      {"odd dtype bytes", "--dtype-bytes 3", "--dtype-bytes"},
      {"unknown grad return", "--grad-return fp8", "--grad-return must be bf16 or fp32, got 'fp8'"},
      {"too many layers", "--layers 5000", "--layers must be in [1, 1024]"},
      {"zero heads", "--heads 0", "--heads"},
      {"negative budget", "--max-rank-bytes -1", "--max-rank-bytes"},
      {"negative memory cap", "--max-server-bytes -1", "--max-server-bytes must be a whole number of bytes >= 0"},
      {"memory cap a word", "--max-server-bytes lots", "got 'lots'"},
      {"shrinking elongation", "--elongation 0.5", "--elongation must be 0 (auto) or in [1, 1024]"},
      {"zero long threshold", "--long-threshold 0", "--long-threshold"},
      {"keep-short above one", "--keep-short 1.5", "--keep-short"},
      {"upsample below one", "--upsample 0.5", "--upsample"},
      {"huge tokens per rank", "--tokens-per-rank 3000000000", "--tokens-per-rank must be in"},
      {"missing profile", "--profile /nonexistent/p.json", "no such file"},
  };
  for (const BadInput& c : cases) {
    fs::remove(out);
    CmdResult r = distca("plan " + c.args + " --out " + out);
    cli::expect_refused(r, c);
    EXPECT_FALSE(fs::exists(out)) << c.name;
  }
}

// Runs each bad command line and checks the common contract: exit 2, one line naming the
// problem, nothing on stdout, no plan file.
void expect_refused(const std::vector<BadInput>& cases) {
  const std::string out = (scratch() / "refused.json").string();
  for (const BadInput& c : cases) {
    fs::remove(out);
    CmdResult r = distca("plan " + c.args + " --out " + out);
    cli::expect_refused(r, c);
    EXPECT_FALSE(fs::exists(out)) << c.name;
  }
}

TEST(Cli, PlanGranularityIsAPowerOfTwoFrom16To4096) {
  expect_refused({{"one", "--granularity 1", "power of two from 16 to 4096"},
                  {"seven", "--granularity 7", "power of two from 16 to 4096"},
                  {"eight", "--granularity 8", "power of two from 16 to 4096"},
                  {"not a power of two", "--granularity 96", "power of two from 16 to 4096"},
                  {"one hundred thousand", "--granularity 100000", "power of two from 16 to 4096"},
                  {"above 4096", "--granularity 8192", "power of two from 16 to 4096"}});
  // The ends of the range are honoured: minmax cuts every document at multiples of g.
  const std::string out = (scratch() / "granular.json").string();
  for (int64_t g : {16, 4096}) {
    fs::remove(out);
    CmdResult r = distca("plan --ranks 8 --tokens-per-rank 32768 --workload prolong --policy minmax --granularity " +
                         std::to_string(g) + " --out " + out);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto loaded = distca::plan::plan_from_json(nlohmann::json::parse(distca::read_text_file(out).value())).value();
    int num_cut = 0;
    for (const auto& t : loaded.plan.tasks) {
      EXPECT_EQ(t.q0 % g, 0) << "g " << g;
      EXPECT_TRUE(t.q1 % g == 0 || t.q1 == loaded.batch.doc_lengths[t.doc]) << "g " << g;
      if (t.q0 > 0 || t.q1 < loaded.batch.doc_lengths[t.doc]) ++num_cut;
    }
    EXPECT_GT(num_cut, 0) << "g " << g << ": no document was cut, so the check above proves nothing";
  }
}

TEST(Cli, PlanRefusesFlagsItWouldIgnore) {
  const std::string batch = write("flags_batch.json", R"({"ranks": [[4096], [1024, 1024]]})");
  const std::string lengths = write("flags_lengths.json", R"([100, 2000, 30000])");
  expect_refused({
      {"workload with batch", "--batch " + batch + " --workload prolong", "--workload"},
      {"seed with batch", "--batch " + batch + " --seed 5", "--seed"},
      {"all sampling flags with batch",
       "--batch " + batch + " --workload prolong --seed 5 --upsample 3 --keep-short 0.5 --long-threshold 9 --elongation 2",
       "--workload, --seed, --long-threshold, --keep-short, --upsample, --elongation"},
      {"workload with doc lengths", "--doc-lengths " + lengths + " --workload prolong", "--workload"},
      {"batch with doc lengths", "--batch " + batch + " --doc-lengths " + lengths, "at most one"},
      {"granularity with none", "--policy none --granularity 256", "--granularity"},
      {"budget with none", "--policy none --max-rank-bytes 1000", "--max-rank-bytes"},
      {"budget with distca", "--policy distca --max-rank-bytes 1000", "--max-rank-bytes"},
      {"memory cap with none", "--policy none --max-server-bytes 0", "--max-server-bytes"},
      {"memory cap with distca", "--policy distca --max-server-bytes auto", "no memory cap"},
      {"granularity with distca", "--policy distca --granularity 64", "token granularity"},
      {"custom model without its shape", "--model custom --layers 2 --heads 8", "add --hidden, --kv-heads, --head-dim, --ffn-hidden"},
  });
  for (const char* args : {"--out -", "--out ''", "--out /nonexistent/dir/plan.json", "--out /tmp"}) {
    CmdResult r = distca(std::string("plan --ranks 2 --tokens-per-rank 4096 ") + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find("--out"), std::string::npos) << args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << args;
  }
  // What stays allowed: --ranks and --tokens-per-rank with --batch (a check and a capacity), the
  // sampling flags with --doc-lengths, and a budget with --policy all (minmax keeps it).
  EXPECT_EQ(distca("plan --batch " + batch + " --ranks 2 --tokens-per-rank 4096").exit_code, 0);
  EXPECT_EQ(distca("plan --doc-lengths " + lengths + " --ranks 4 --tokens-per-rank 8192 --seed 3 --upsample 2").exit_code, 0);
  EXPECT_EQ(distca("plan --ranks 4 --tokens-per-rank 8192 --policy all --max-rank-bytes 100000000").exit_code, 0);
}

TEST(Cli, PlanBatchFileErrorsNameTheRank) {
  const std::string folder = (scratch() / "a_folder.json").string();
  fs::create_directories(folder);
  auto batch = [](const std::string& name, const std::string& text) { return "--batch " + write(name, text); };
  expect_refused({
      {"every rank empty", batch("empty.json", R"({"ranks": [[], []]})"), "rank 0 lists no documents"},
      {"one rank empty", batch("one_empty.json", R"({"ranks": [[5], []]})"), "rank 1 lists no documents"},
      {"no ranks", batch("no_ranks.json", R"({"ranks": []})"), "at least one rank"},
      {"zero length", batch("zero.json", R"({"ranks": [[5, 0]]})"), "rank 0 document 1 has length 0"},
      {"negative length", batch("negative.json", R"({"ranks": [[5], [-3]]})"), "rank 1 document 0 has length -3"},
      {"fractional length", batch("fraction.json", R"({"ranks": [[1.5]]})"), "expected a positive integer"},
      {"string length", batch("string.json", R"({"ranks": [["4"]]})"), "expected a positive integer"},
      {"huge length", batch("unsigned.json", R"({"ranks": [[10000000000000000000]]})"), "more than 2147483647"},
      {"rank not an array", batch("flat.json", R"({"ranks": [4, 5]})"), "rank 0 is 4"},
      {"unknown key", batch("key.json", R"({"ranks": [[4]], "tokens_per_rank": 8})"), "unknown key \"tokens_per_rank\""},
      {"rank over capacity", batch("over.json", R"({"ranks": [[4096], [100]]})") + " --tokens-per-rank 1024",
       "rank 0 holds 4096 tokens"},
      {"batch is a folder", "--batch " + folder, "is a directory"},
      {"doc lengths is a folder", "--doc-lengths " + folder, "is a directory"},
      {"profile is a folder", "--profile " + folder, "is a directory"},
  });
  // Ranks may hold different numbers of tokens: the header says so instead of claiming T each.
  CmdResult r = distca("plan " + batch("unequal.json", R"({"ranks": [[4096], [1000, 24]]})"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("2 ranks x up to 4096 tokens (1024..4096 held)"), std::string::npos) << r.out;
}


TEST(Cli, PlanPricesOneLayerOnTheProfileAndSaysWhetherCommIsHidden) {
  // One eps: the same plan priced on each profile (auto would pick per profile).
  const std::string args = "plan --ranks 16 --tokens-per-rank 32768 --workload prolong --policy minmax --tolerance 0.05 --json";
  // 16 ranks on 8 GPUs per node span two nodes: the inter-node link prices the exchange.
  CmdResult fast = distca(args + " --profile " + simple_profile(1e12));
  ASSERT_EQ(fast.exit_code, 0) << fast.err;
  auto j = nlohmann::json::parse(fast.out);
  EXPECT_EQ(j["profile"], "hand-made");
  EXPECT_EQ(j["link"]["name"], "inter-node");
  EXPECT_EQ(j["link"]["nodes"], 2);
  EXPECT_EQ(j["link"]["bytes_per_second"].get<double>(), 1e12);
  // Linear: llama-8b's 2 x (4096 x 48 x 128 + 32 x 128 x 4096 + 3 x 4096 x 14336) FLOPs per token
  // over 32768 tokens at 1e15 FLOP/s.
  EXPECT_NEAR(j["linear_seconds_per_layer"].get<double>(), 32768.0 * 436207616.0 / 1e15, 1e-12);
  // Comm: the busiest rank's two phases, each max(send, recv) / bandwidth with no latency, lies
  // between the largest per-rank send or receive and their sum, over the bandwidth.
  const double send = j["comm"]["max_send_bytes"].get<double>(), recv = j["comm"]["max_recv_bytes"].get<double>();
  const double comm = j["comm_seconds_per_layer"].get<double>();
  EXPECT_GT(send, 0);
  EXPECT_GE(comm, std::max(send, recv) / 1e12 * (1 - 1e-12));
  EXPECT_LE(comm, (send + recv) / 1e12 * (1 + 1e-12));
  EXPECT_GT(j["attention_seconds_per_layer"].get<double>(), 0);
  EXPECT_TRUE(j["comm_hidden"].get<bool>());
  EXPECT_EQ(fast.err.find("warning"), std::string::npos) << fast.err;

  // The same plan over a link a million times slower cannot hide: the flag flips and one
  // warning line says so.
  CmdResult slow = distca(args + " --profile " + simple_profile(1e6));
  ASSERT_EQ(slow.exit_code, 0) << slow.err;
  auto k = nlohmann::json::parse(slow.out);
  EXPECT_EQ(k["hash"], j["hash"]);
  EXPECT_NEAR(k["comm_seconds_per_layer"].get<double>(), comm * 1e6, comm * 1e6 * 1e-9);
  EXPECT_FALSE(k["comm_hidden"].get<bool>());
  EXPECT_EQ(count_lines(slow.err), 1) << slow.err;
  EXPECT_NE(slow.err.find("warning: communication cannot be hidden"), std::string::npos) << slow.err;

  // One node holds all 16 GPUs: the intra-node link prices the same exchange.
  auto one_node = nlohmann::json::parse(distca(args + " --profile " + simple_profile(1e6) + " --gpus-per-node 16").out);
  EXPECT_EQ(one_node["link"]["name"], "intra-node");
  EXPECT_NEAR(one_node["comm_seconds_per_layer"].get<double>(), comm, comm * 1e-9);
  // With tp 8 each rank is a TP group of 8 GPUs: 2 ranks already span two nodes.
  auto tp8 = nlohmann::json::parse(distca("plan --ranks 2 --tokens-per-rank 8192 --tp 8 --json").out);
  EXPECT_EQ(tp8["link"]["name"], "inter-node");
  EXPECT_EQ(tp8["link"]["gpus"], 16);
}

TEST(Cli, PlanTablesShowUnitsAndTheHiddenColumn) {
  CmdResult r = distca("plan --ranks 512 --tokens-per-rank 131072 --workload prolong --policy all --tolerance 0.02");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* header : {"max load (s)", "total (MiB)", "max send (MiB)", "max recv (MiB)", "comm (ms)",
                             "linear (ms)", "attention (ms)", "hidden", "inter-node link: 45.0 GB/s"}) {
    EXPECT_NE(r.out.find(header), std::string::npos) << header << "\n" << r.out;
  }
  // The issue's case: at 512 ranks the busiest rank sends tens of GB per layer, which the
  // default profile's inter-node link cannot hide behind one layer's compute.
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("minmax:"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("NO"), std::string::npos) << r.out;
}

// --max-rank-bytes auto: the budget is what the profile's link moves in the fullest rank's linear
// time (less two latencies, halved: dispatch then return), and minmax keeps it or says why not.
TEST(Cli, PlanAutoByteBudgetComesFromTheProfileAndIsKept) {
  CmdResult r = distca(
      "plan --ranks 8 --tokens-per-rank 32768 --workload prolong --policy minmax --max-rank-bytes auto --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  const double linear = j["max_rank_bytes_auto"]["linear_seconds_per_layer"];
  const double latency = j["link"]["latency_seconds"], bandwidth = j["link"]["bytes_per_second"];
  EXPECT_DOUBLE_EQ(linear, j["linear_seconds_per_layer"].get<double>());
  const auto budget = j["max_rank_bytes"].get<int64_t>();
  EXPECT_EQ(budget, static_cast<int64_t>((linear - 2 * latency) * bandwidth / 2));
  EXPECT_GT(budget, 0);
  if (j["within_budget"].get<bool>()) {
    EXPECT_LE(j["comm"]["max_send_bytes"].get<int64_t>(), budget);
    EXPECT_LE(j["comm"]["max_recv_bytes"].get<int64_t>(), budget);
  } else {
    EXPECT_NE(j["note"].get<std::string>().find("max-rank-bytes"), std::string::npos) << j["note"];
  }
  CmdResult text = distca("plan --ranks 8 --tokens-per-rank 32768 --policy minmax --max-rank-bytes auto");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("byte budget (--max-rank-bytes auto):"), std::string::npos) << text.out;
  const BadInput cases[] = {
      {"not a number", "--max-rank-bytes 12x", "--max-rank-bytes must be a whole number of bytes >= 0"},
      {"negative", "--max-rank-bytes -5", "got '-5'"},
      {"auto with the paper's planner", "--policy distca --max-rank-bytes auto", "no byte budget"},
  };
  for (const BadInput& c : cases) {
    CmdResult bad = distca("plan " + c.args);
    cli::expect_refused(bad, c);
  }
}

// --max-server-bytes: the report's memory object, a cap every server keeps, and 0 the free plan.
TEST(Cli, PlanReportsEachPlansFullestServerAndKeepsAMemoryCap) {
  const std::string batch = "plan --workload prolong --seed 3 --policy minbytes --tolerance 0.05 --json";
  auto run = [&](const std::string& extra) {
    CmdResult r = distca(batch + extra);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const nlohmann::json free = run(" --max-server-bytes 0"), automatic = run("");
  EXPECT_EQ(automatic["max_server_bytes"], "auto");
  EXPECT_EQ(free["max_server_bytes"], 0);
  const auto& fm = free["memory"];
  const auto& am = automatic["memory"];
  EXPECT_GT(fm["max_server_bytes"].get<int64_t>(), fm["colocated_max_server_bytes"].get<int64_t>());
  EXPECT_TRUE(fm["cap_bytes"].is_null());
  // Auto lowers this batch's fullest server (reports/cpu/2026-12-07-planner-memory: 1.070 -> 1.050).
  EXPECT_LT(am["max_server_bytes"].get<int64_t>(), fm["max_server_bytes"].get<int64_t>());
  EXPECT_LE(am["max_server_bytes"].get<int64_t>(), am["cap_bytes"].get<int64_t>());
  EXPECT_TRUE(am["within_cap"].get<bool>());
  EXPECT_NE(automatic["hash"], free["hash"]);
  // An explicit cap between colocated's fullest and the free plan's is kept by every server.
  const int64_t cap = (fm["max_server_bytes"].get<int64_t>() + fm["colocated_max_server_bytes"].get<int64_t>()) / 2;
  const nlohmann::json capped = run(" --max-server-bytes " + std::to_string(cap));
  EXPECT_EQ(capped["memory"]["cap_bytes"], cap);
  EXPECT_LE(capped["memory"]["max_server_bytes"].get<int64_t>(), cap);
  EXPECT_GT(capped["comm"]["step_link_bytes"].get<int64_t>(), 0);
  // The table's column.
  CmdResult text = distca("plan --workload prolong --seed 3 --policy minbytes --tolerance 0.05");
  EXPECT_NE(text.out.find("held (x coloc)"), std::string::npos) << text.out;
}

}  // namespace
