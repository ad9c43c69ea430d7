// The `distca bench` command line, run as a user runs it (see cli_util.h).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
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
using cli::scratch;
using cli::write;
namespace fs = std::filesystem;

bool cpu_has_avx512f() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.starts_with("flags") && line.find(" avx512f") != std::string::npos) return true;
  }
  return false;
}

bool is_avx512_blas_core(const std::string& core) {
  return core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
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
      {"shard longer than its document", "--shard-doc 1024 --shards 2048", "--shards: size 2048"},
      {"negative seed (would wrap around)", "--seed -1", "--seed"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("bench attention " + c.args);
    cli::expect_refused(r, c);
  }
  EXPECT_EQ(distca("bench").exit_code, 2);
}

// OpenBLAS reads OPENBLAS_CORETYPE when it is loaded, before main(): distca sets it and
// re-executes itself, so the sgemm ceiling is the AVX-512 one whoever starts the program.
TEST(Cli, BenchAttentionRunsTheAvx512BlasCoreWithoutOpenblasCoretype) {
  if (!cpu_has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 (no avx512f in /proc/cpuinfo)";
  // --quick leaves the sizes given on the command line alone.
  CmdResult r = cli::run_shell(std::string("env -u OPENBLAS_CORETYPE ") + DISTCA_BIN +
                               " bench attention --quick --docs 512 --shard-doc 512 --shards 128 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(is_avx512_blas_core(j["blas_core"])) << j["blas_core"];
  EXPECT_EQ(j["machine"]["openblas_coretype"], "SkylakeX");
  EXPECT_EQ(j["machine"]["coretype_set_by_distca"], true);
  EXPECT_EQ(j["machine"]["cpu_isa"], "AVX-512");
  EXPECT_EQ(j["ceiling_trusted"], true);
  EXPECT_EQ(r.err.find("WARNING"), std::string::npos) << r.err;
  EXPECT_EQ(j["config"]["docs"], nlohmann::json::array({512}));
  EXPECT_EQ(j["config"]["shard_doc"], 512);
}

TEST(Cli, BenchAttentionWarnsWhenOpenblasCoretypeIsNarrowerThanTheCpu) {
  if (!cpu_has_avx512f()) GTEST_SKIP() << "this CPU has no AVX-512 (no avx512f in /proc/cpuinfo)";
  const std::string run = std::string("env OPENBLAS_CORETYPE=Haswell ") + DISTCA_BIN +
                          " bench attention --quick --docs 256 --shard-doc 256 --shards 64";
  CmdResult r = cli::run_shell(run + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  if (j["blas_core"] != "Haswell") GTEST_SKIP() << "this OpenBLAS ignores OPENBLAS_CORETYPE (no DYNAMIC_ARCH)";
  EXPECT_EQ(j["machine"]["openblas_coretype"], "Haswell");  // the user's choice is kept...
  EXPECT_EQ(j["machine"]["coretype_set_by_distca"], false);
  EXPECT_EQ(j["ceiling_trusted"], false);  // ...and called out
  EXPECT_NE(j["blas_warning"].get<std::string>().find("Haswell"), std::string::npos);
  EXPECT_NE(r.err.find("WARNING: OpenBLAS runs its Haswell kernels"), std::string::npos) << r.err;
  CmdResult text = cli::run_shell(run);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("WARNING: OpenBLAS runs its Haswell kernels"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("NOT this machine's ceiling"), std::string::npos) << text.out;
}

// One run's figures: each the median of its samples, between its min and max.
void expect_median_and_range(const nlohmann::json& run, int repeats) {
  ASSERT_EQ(run["repeats"], repeats);
  ASSERT_EQ(run["samples"].size(), static_cast<size_t>(repeats));
  for (const char* field : {"seq_seconds", "pingpong_seconds", "compute_seconds", "comm_seconds", "hidden_fraction",
                            "cover_fraction"}) {
    std::vector<double> v;
    for (const auto& s : run["samples"]) v.push_back(s[field].get<double>());
    std::sort(v.begin(), v.end());
    const double median = v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    EXPECT_DOUBLE_EQ(run[field].get<double>(), median) << field;
    EXPECT_DOUBLE_EQ(run["range"][field][0].get<double>(), v.front()) << field;
    EXPECT_DOUBLE_EQ(run["range"][field][1].get<double>(), v.back()) << field;
  }
  int outside = 0;
  for (const auto& s : run["samples"]) {
    // The nano-batches' own times add up to the run's, and the other nano-batch's compute
    // covers a share of the communication between 0 and 1.
    EXPECT_NEAR(s["nano_compute_seconds"][0].get<double>() + s["nano_compute_seconds"][1].get<double>(),
                s["compute_seconds"].get<double>(), 1e-9);
    EXPECT_NEAR(s["nano_comm_seconds"][0].get<double>() + s["nano_comm_seconds"][1].get<double>(),
                s["comm_seconds"].get<double>(), 1e-9);
    EXPECT_GE(s["cover_fraction"].get<double>(), 0.0);
    EXPECT_LE(s["cover_fraction"].get<double>(), 1.0);
    const double hidden = s["hidden_fraction"].get<double>();
    EXPECT_NEAR(hidden, (s["seq_seconds"].get<double>() - s["pingpong_seconds"].get<double>()) / s["comm_seconds"].get<double>(), 1e-12);
    outside += hidden < 0 || hidden > 1;
  }
  EXPECT_EQ(run["hidden_fraction_out_of_range"], outside);
  // A fraction hidden outside [0, 1] is reported as a measurement error, never clamped.
  const double hidden = run["hidden_fraction"];
  EXPECT_EQ(run["hidden_fraction_is_measurement_error"].get<bool>(), hidden < 0 || hidden > 1) << hidden;
  EXPECT_EQ(run.contains("measurement_error"), hidden < 0 || hidden > 1);
}

// bench step: the four variants on the same batches, the link calibrated on the linear compute
// of a measured step, the hidden fraction against the zero-cost link (the benchmark itself fails
// when the split variants' losses differ), and its refusals.
TEST(Cli, BenchStepMeasuresPingPongInTheRealStep) {
  CmdResult r = distca("bench step --preset tiny --steps 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["benchmark"], "step");
  EXPECT_EQ(j["communicator"], "local");
  ASSERT_EQ(j["steps"].size(), 2u);
  for (const char* v : {"sequential", "pingpong", "zero_cost", "whole"}) {
    const std::string key = std::string(v) + "_seconds";
    std::vector<double> per_step;
    for (const auto& s : j["steps"]) per_step.push_back(s[key].get<double>());
    std::sort(per_step.begin(), per_step.end());
    EXPECT_GT(per_step.front(), 0.0) << key;
    EXPECT_DOUBLE_EQ(j[key]["median"].get<double>(), 0.5 * (per_step[0] + per_step[1])) << key;
    EXPECT_DOUBLE_EQ(j[key]["min"].get<double>(), per_step[0]) << key;
    EXPECT_DOUBLE_EQ(j[key]["max"].get<double>(), per_step[1]) << key;
  }
  const auto& c = j["calibration"];
  EXPECT_GT(c["bytes_per_second"].get<double>(), 0.0);
  EXPECT_GT(c["wire_bytes"].get<double>(), 0.0);
  // The link takes ratio x linear per step: latency per operation plus the bytes at that rate.
  EXPECT_NEAR(c["operations"].get<double>() * c["latency_us"].get<double>() * 1e-6 +
                  c["wire_bytes"].get<double>() / c["bytes_per_second"].get<double>(),
              c["ratio"].get<double>() * c["linear_seconds"].get<double>(), 1e-9);
  // The share hidden is undefined (null, flagged, never a made-up 0 %) when the zero-cost step was
  // no faster than the sequential one; otherwise it is the formula, flagged outside [0, 1].
  const double seq = j["sequential_seconds"]["median"], pp = j["pingpong_seconds"]["median"],
               zero = j["zero_cost_seconds"]["median"];
  EXPECT_DOUBLE_EQ(j["zero_cost_over_sequential"].get<double>(), zero / seq);
  if (zero >= seq) {
    EXPECT_TRUE(j["hidden_fraction"].is_null());
    EXPECT_TRUE(j["hidden_fraction_is_measurement_error"].get<bool>());
  } else {
    const double h = j["hidden_fraction"].get<double>();
    EXPECT_DOUBLE_EQ(h, (seq - pp) / (seq - zero));
    EXPECT_EQ(j["hidden_fraction_is_measurement_error"].get<bool>(), h < 0 || h > 1);
  }
  size_t measurable = 0;
  for (const auto& s : j["steps"]) {
    const double ss = s["sequential_seconds"], sz = s["zero_cost_seconds"];
    EXPECT_EQ(s["hidden_fraction"].is_null(), sz >= ss);
    measurable += sz < ss;
  }
  EXPECT_EQ(j["hidden_fraction_measured_steps"].get<size_t>(), measurable);
  // One plan split: the nano-batches move the whole step's bytes (issue 54: at most 1.05x).
  EXPECT_GT(j["whole_attention_bytes"]["median"].get<double>(), 0.0);
  EXPECT_GT(j["pingpong_over_whole_bytes_max"].get<double>(), 0.0);
  EXPECT_LE(j["pingpong_over_whole_bytes_max"].get<double>(), 1.05);
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--ranks 1", "bench step needs 2 or more ranks"},
           {"--link off --ratio 2", "--link off runs none"},
           {"--link maybe", "--link must be auto or off"},
           {"--progress spin", "--progress must be none, poll or thread"},
           {"--progress thread --progress-interval-us 5", "--progress-interval-us must be 10..100000"},
           {"--grad-sync later", "--grad-sync must be overlap, eager or after"},
           {"--steps 0", "--steps must be 1..1000"}}) {
    CmdResult bad = distca("bench step --preset tiny " + args);
    EXPECT_NE(bad.exit_code, 0) << args;
    EXPECT_NE(bad.err.find(message), std::string::npos) << args << ": " << bad.err;
  }
}

TEST(Cli, BenchDispatchJsonHasTheDocumentedFields) {
  // 1024 tokens a rank: the fields and their relations, at a third of --quick's time.
  CmdResult r = distca("bench dispatch --quick --tokens-per-rank 1024 --link 2 --latency-us 5 --repeats 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format"], "distca-bench-dispatch");
  EXPECT_FALSE(j["blas_core"].get<std::string>().empty());
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
    SCOPED_TRACE(run);
    expect_median_and_range(j[run], 2);
  }
  EXPECT_DOUBLE_EQ(j["emulated"]["link_gbps"].get<double>(), 2.0);
  EXPECT_FALSE(j["emulated"].contains("calibration"));  // a given bandwidth is not calibrated
  EXPECT_EQ(j["seq_seconds"], j["emulated"]["seq_seconds"]);
  EXPECT_EQ(j["hidden_fraction"], j["emulated"]["hidden_fraction"]);
  EXPECT_EQ(j["hidden_fraction_is_measurement_error"], j["emulated"]["hidden_fraction_is_measurement_error"]);
}

// --link auto: the bandwidth is chosen on the compute measured in the same runs and verified
// on the repeats; the table says whether it met communication = compute, and names a hidden
// fraction outside 0..100% a measurement error. One run: the table on stdout, the same run's
// JSON through --json-out.
TEST(Cli, BenchDispatchCalibratesTheLinkOnMeasuredComputeAndSaysHowClose) {
  const std::string json_path = (scratch() / "dispatch-calibrates.json").string();
  fs::remove(json_path);
  // One layer: the calibration is the same search on half the work (at 1024 tokens a rank the local
  // communicator alone takes as long as compute, so there is nothing to calibrate).
  CmdResult text = distca("bench dispatch --quick --layers 1 --repeats 1 --json-out " + json_path);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  distca::Result<std::string> written = distca::read_text_file(json_path);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  auto j = nlohmann::json::parse(written.value());
  const auto& cal = j["emulated"]["calibration"];
  ASSERT_GE(cal["tries"].size(), 2u) << cal;  // the first guess comes from another run: always checked
  ASSERT_LE(cal["tries"].size(), 4u) << cal;
  for (const auto& t : cal["tries"]) {
    EXPECT_NEAR(t["comm_over_compute"].get<double>(), t["comm_seconds"].get<double>() / t["compute_seconds"].get<double>(), 1e-12);
    EXPECT_GT(t["run_compute_seconds"].get<double>(), 0.0);
  }
  const double ratio = j["emulated"]["comm_over_compute"];
  EXPECT_NEAR(ratio, j["emulated"]["comm_seconds"].get<double>() / j["emulated"]["compute_seconds"].get<double>(), 1e-12);
  EXPECT_EQ(cal["comm_over_compute"], ratio);
  EXPECT_EQ(cal["is_verified"].get<bool>(), std::abs(ratio - 1) <= 0.1) << ratio;
  // A try within 5 % (the second or later) ends the search; the last one then used the chosen bandwidth.
  const auto& last = cal["tries"].back();
  if (cal["is_met"].get<bool>()) {
    EXPECT_LE(std::abs(last["comm_over_compute"].get<double>() - 1), 0.05);
    EXPECT_DOUBLE_EQ(last["link_gbps"].get<double>(), j["emulated"]["link_gbps"].get<double>());
  }
  EXPECT_NE(text.err.find("try 1:"), std::string::npos) << text.err;

  EXPECT_NE(text.out.find("min..max"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("the other nano-batch's compute covers"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("calibration tries on the measured compute: communication / compute"), std::string::npos)
      << text.out;
  for (const char* run : {"as is", "emulated"}) {
    std::istringstream lines(text.out);
    std::string line;
    while (std::getline(lines, line) && !line.starts_with(run)) {
    }
    ASSERT_TRUE(line.starts_with(run)) << text.out;
    std::istringstream cells(line);
    std::string cell, hidden;
    while (cells >> cell) {
      if (cell.ends_with("%")) hidden = cell;
    }
    ASSERT_FALSE(hidden.empty()) << line;
    const double percent = std::stod(hidden);
    // The table and the file are one run: the cell is the JSON's fraction, rounded to a whole percent.
    const double fraction = j[std::string(run) == "as is" ? "real" : "emulated"]["hidden_fraction"].get<double>();
    EXPECT_NEAR(percent, 100 * fraction, 0.5 + 1e-9) << line;
    const std::string error = std::string("measurement error (") + (std::string(run) == "as is" ? "real" : "emulated");
    // The cell is rounded to a whole percent: "-0%" or "100%" may stand for a fraction just
    // outside 0..100 % (an error) or just inside it, so only cells clear of both ends decide.
    if (std::abs(percent) <= 0.5 || std::abs(percent - 100) <= 0.5) continue;
    EXPECT_EQ(text.out.find(error) != std::string::npos, percent < 0 || percent > 100) << text.out;
  }
}

// --json-out: a path that cannot be written is refused before any work, with one line and exit
// 2, and a file that is there is not touched; with --json both outputs are the same report.
TEST(Cli, BenchJsonOutRefusesBadPathsBeforeWorkAndMatchesJson) {
  const std::string dir = (scratch() / "json-out-dir").string();
  fs::create_directories(dir);
  const std::string quick_dispatch = "bench dispatch --quick --link off --repeats 1 --layers 1 --tokens-per-rank 256";
  for (const std::string& command : {quick_dispatch, std::string("bench link --repeats 1 --tokens-per-rank 1024"),
                                     std::string("bench attention --quick --repeats 1"),
                                     std::string("bench step --preset tiny --steps 1 --link off"),
                                     std::string("bench planner --repeats 1"),
                                     std::string("bench calibration --preset tiny --steps 2")}) {
    for (const std::string& bad : {dir, dir + "/missing-folder/out.json", std::string("/dev/null"), std::string("''")}) {
      CmdResult r = distca(command + " --json-out " + bad);
      EXPECT_EQ(r.exit_code, 2) << command << " --json-out " << bad << "\n" << r.err;
      EXPECT_EQ(count_lines(r.err), 1) << command << " --json-out " << bad << "\n" << r.err;
      EXPECT_NE(r.err.find("--json-out"), std::string::npos) << r.err;
      EXPECT_TRUE(r.out.empty()) << r.out;
    }
  }
  EXPECT_TRUE(fs::is_directory(dir));
  const std::string path = (scratch() / "dispatch.json").string();
  fs::remove(path);
  CmdResult r = distca(quick_dispatch + " --json --json-out " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  distca::Result<std::string> written = distca::read_text_file(path);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  EXPECT_EQ(nlohmann::json::parse(r.out), nlohmann::json::parse(written.value()));
}

// --linear-ratio 0 means no linear stage, not one column of it.
TEST(Cli, BenchDispatchLinearRatioZeroRunsNoLinearStage) {
  CmdResult r = distca("bench dispatch --quick --linear-ratio 0 --link off --repeats 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  for (const auto& nano : j["nano_batches"]) EXPECT_EQ(nano["linear_columns"], 0) << nano;
  EXPECT_EQ(j["headline"], "real");
}

// bench planner: every policy on the shipped reference batches, beside the reference's figures
// and the lower bounds; minbytes balanced, verified, above its bounds and below minmax's bytes.
TEST(Cli, BenchPlannerComparesWithTheReferenceAndTheBounds) {
  CmdResult r = distca("bench planner --repeats 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["batches"].size(), 4u);
  for (const auto& b : j["batches"]) {
    std::map<std::string, nlohmann::json> by;
    for (const auto& p : b["plans"]) by[p["policy"]] = p;
    ASSERT_EQ(by.size(), 3u) << b["batch"];
    for (const auto& [name, p] : by) {
      EXPECT_TRUE(p["verified"].get<bool>()) << name;
      EXPECT_NEAR(p["dispatch_bytes"].get<double>(), p["q_bytes"].get<double>() + p["kv_bytes"].get<double>(), 1.0);
      const auto& bound = p["bound"];
      ASSERT_TRUE(bound.contains("dispatch_bytes")) << bound;  // every shipped document lies on one rank
      EXPECT_LE(bound["dispatch_bytes"].get<double>(), p["dispatch_bytes"].get<double>()) << name;
      EXPECT_LE(bound["max_send_bytes"].get<double>(), p["max_send_bytes"].get<double>()) << name;
      EXPECT_LE(bound["max_recv_bytes"].get<double>(), p["max_recv_bytes"].get<double>()) << name;
    }
    // The faithful reproduction is the reference, figure for figure.
    EXPECT_NEAR(by["distca"]["dispatch_over_reference"].get<double>(), 1.0, 1e-9) << b["batch"];
    const auto& m = by["minbytes"];
    EXPECT_LE(m["imbalance"].get<double>(), 1.03) << b["batch"];
    EXPECT_GT(m["split_tasks"].get<int>(), 0) << b["batch"];
    for (const char* f : {"dispatch_bytes", "max_send_bytes", "max_recv_bytes"}) {
      EXPECT_LT(m[f].get<double>(), by["minmax"][f].get<double>()) << b["batch"] << " " << f;
      EXPECT_LT(m[f].get<double>(), by["distca"][f].get<double>()) << b["batch"] << " " << f;
    }
  }
  CmdResult text = distca("bench planner --repeats 1 --policies minbytes");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("reference planner"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("lower bound"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("busiest link"), std::string::npos) << text.out;
}

// The busiest link per phase beside its bound, at an eps the reference did not run (its figures
// then null), on fresh batches too; minlink's step links the least busy of the policies run.
TEST(Cli, BenchPlannerReportsTheBusiestLinksBesideTheirBounds) {
  CmdResult r = distca("bench planner --repeats 1 --tolerance 0.05 --fresh 1 --policies minmax,minbytes,minlink --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["batches"].size(), 8u);  // 4 shipped + 1 seed x 2 samples x 2 sizes
  for (const auto& b : j["batches"]) {
    if (b["batch"].get<std::string>().rfind("batch_", 0) == 0) {
      EXPECT_TRUE(b["reference"].is_null()) << b["batch"];
    }
    double least = 1e300;
    for (const auto& p : b["plans"]) least = std::min(least, p["links"]["step"].get<double>());
    for (const auto& p : b["plans"]) {
      const auto& l = p["links"];
      EXPECT_EQ(l["step"].get<double>(), l["fwd_dispatch"].get<double>() + l["fwd_return"].get<double>() +
                                             l["bwd_dispatch"].get<double>() + l["bwd_return"].get<double>());
      ASSERT_TRUE(p["link_bound"].contains("step")) << p["link_bound"];
      EXPECT_LE(p["link_bound"]["step"].get<double>(), l["step"].get<double>()) << p["policy"];
      EXPECT_LE(p["link_bound"]["fwd_dispatch"].get<double>(), l["fwd_dispatch"].get<double>()) << p["policy"];
      if (p["policy"] != "distca") {
        EXPECT_LE(p["seconds_imbalance"].get<double>(), 1.05 * (1 + 1e-9)) << p["policy"] << " " << b["batch"];
      }
      if (p["policy"] == "minlink") {
        EXPECT_EQ(l["step"].get<double>(), least) << b["batch"];
      }
    }
  }
  // Its second candidate pays: on ProLong 64 and 512 the largest blocks and host receivers make
  // the step's links less busy than minbytes' own (5.5 against 8.0 and 10.6 against 14.2 GB
  // measured at eps 0.05), and the dispatch bound holds for the hosted plans.
  for (const auto& b : j["batches"]) {
    if (b["batch"] != "batch_prolong_r64.json" && b["batch"] != "batch_prolong_r512.json") continue;
    std::map<std::string, double> step;
    for (const auto& p : b["plans"]) {
      step[p["policy"]] = p["links"]["step"].get<double>();
      EXPECT_LE(p["bound"]["dispatch_bytes"].get<double>(), p["dispatch_bytes"].get<double>()) << p["policy"];
      EXPECT_GE(p["bound"]["dispatch_bytes"].get<double>(), p["bound"]["dispatch_bytes_by_senders"].get<double>());
    }
    EXPECT_LT(step["minlink"], 0.8 * step["minbytes"]) << b["batch"];
  }
  EXPECT_EQ(j["summary"]["minlink"]["least_busy_step_in"], 8);
  EXPECT_EQ(j["summary"]["minlink"]["batches"], 8);
}

// At --tolerance auto every plan is at the eps its search picked (of those it tried), balanced to
// it, and its planning time is the whole search's (at least the sum of its plans').
TEST(Cli, BenchPlannerAtAutoReportsEachPlansEps) {
  CmdResult r = distca("bench planner --repeats 1 --tolerance auto --policies minbytes,minlink --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["tolerance"], "auto");
  ASSERT_EQ(j["batches"].size(), 4u);
  for (const auto& b : j["batches"]) {
    EXPECT_TRUE(b["reference"].is_null());
    for (const auto& p : b["plans"]) {
      const auto& a = p["tolerance_auto"];
      ASSERT_TRUE(a.is_object()) << p["policy"];
      EXPECT_EQ(p["tolerance"], a["tolerance"]);
      EXPECT_LE(p["seconds_imbalance"].get<double>(), (1 + p["tolerance"].get<double>()) * (1 + 1e-9));
      double planned = 0;  // the search plans one rung after another
      for (const auto& t : a["tried"]) planned += t["plan_ms"].get<double>();
      EXPECT_GE(p["plan_ms"].get<double>(), planned);
    }
  }
  for (const char* policy : {"minbytes", "minlink"}) EXPECT_EQ(j["summary"][policy]["imbalance_within_eps_in"], 4);
  CmdResult text = distca("bench planner --repeats 1 --tolerance auto --policies minbytes");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("eps auto"), std::string::npos) << text.out;
}

// Issue 72 row 1: --json-out naming a file the run reads from its DEFAULT reference folder
// ($DISTCA_SHARED_DATA/reference, no --reference-dir given) is refused before any work, and the
// input is left as it was; so is a --fresh sample beside it. On a copy of the shared data.
TEST(Cli, BenchPlannerJsonOutIntoTheDefaultReferenceFolderIsRefused) {
  const char* shared = std::getenv("DISTCA_SHARED_DATA");
  ASSERT_NE(shared, nullptr);
  const fs::path data = scratch() / "shared-copy" / "data";
  fs::remove_all(data.parent_path());
  fs::create_directories(data);
  fs::copy(fs::path(shared) / "reference", data / "reference", fs::copy_options::recursive);
  for (const char* sample : {"dist_wlbllm.json", "dist_prolong.json"}) fs::copy(fs::path(shared) / sample, data / sample);
  const std::string env = "DISTCA_SHARED_DATA=" + data.string() + " ";
  const std::string input = (data / "reference" / "reference_planner.json").string();
  const std::string before = distca::read_text_file(input).value();
  struct Case {
    std::string args, output;
  };
  const Case cases[] = {
      {"", input},
      {"", (data / "reference" / "report.json").string()},  // a new file inside the folder read
      {"--fresh 1", (data / "dist_prolong.json").string()},
  };
  for (const Case& c : cases) {
    const std::string sample_before = fs::exists(c.output) ? distca::read_text_file(c.output).value() : "";
    CmdResult r = cli::run_shell("env " + env + DISTCA_BIN + " bench planner --repeats 1 " + c.args + " --json-out " + c.output);
    EXPECT_EQ(r.exit_code, 2) << c.output << "\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("--reference-dir"), std::string::npos) << r.err;
    if (sample_before.empty()) {
      EXPECT_FALSE(fs::exists(c.output)) << c.output;
    } else {
      EXPECT_EQ(distca::read_text_file(c.output).value(), sample_before) << c.output;
    }
  }
  EXPECT_EQ(distca::read_text_file(input).value(), before);
  // The same run writing elsewhere works, and reads the copy.
  const std::string elsewhere = (scratch() / "planner-report.json").string();
  CmdResult ok = cli::run_shell("env " + env + DISTCA_BIN + " bench planner --repeats 1 --policies minbytes --json-out " + elsewhere);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(nlohmann::json::parse(distca::read_text_file(elsewhere).value())["reference_dir"], (data / "reference").string());
}

TEST(Cli, BenchPlannerBadInputGetsOneLineErrorExitTwo) {
  const BadInput cases[] = {
      {"tolerance a word", "--tolerance balanced", "--tolerance must be a number in [0, 1] or auto"},
      {"too many fresh batches", "--fresh 101", "--fresh"},
      {"negative fresh batches", "--fresh -1", "--fresh"},
      {"tolerance out of range", "--tolerance 2", "--tolerance"},
      {"unknown policy", "--policies minmax,fastest", "fastest"},
      {"zero repeats", "--repeats 0", "--repeats"},
      {"missing folder", "--reference-dir /nonexistent/reference", "/nonexistent/reference"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("bench planner " + c.args);
    cli::expect_refused(r, c);
  }
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
      {"zero repeats", "--repeats 0", "--repeats"},
      {"negative seed (would wrap around)", "--seed -1", "--seed"},
      {"latency of no link", "--link off --latency-us 5", "--latency-us"},
      {"a link with one rank", "--ranks 1", "--ranks 1"},
      {"zero timeout", "--timeout 0", "--timeout"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("bench dispatch --quick " + c.args);
    cli::expect_refused(r, c);
  }
}

// The CAD exchange alone over 2 thread-ranks: four phases with the plan's bytes, the model's
// prediction where a rate is given, and the latency measured in the run.
TEST(Cli, BenchLinkTimesThePlansExchangesBesideTheModel) {
  CmdResult r = distca("bench link --ranks 2 --tokens-per-rank 4096 --workload prolong --repeats 2 --rate-gbit 8 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["phases"].size(), 4u);
  double predicted = 0, measured_sum = 0;
  for (const auto& p : j["phases"]) {
    const double bytes = p["busiest_rank_bytes"].get<double>();
    EXPECT_GE(bytes, 0);
    const double latency = j["latency_seconds"]["median"].get<double>();
    // The model: latency + busiest bytes at 8 Gbit/s = 1e9 bytes/s (0 when nothing moves).
    EXPECT_NEAR(p["predicted_seconds"].get<double>(), bytes > 0 ? latency + bytes / 1e9 : 0.0, 1e-12) << p;
    predicted += p["predicted_seconds"].get<double>();
    measured_sum += p["measured_seconds"]["median"].get<double>();
    EXPECT_LE(p["measured_seconds"]["min"].get<double>(), p["measured_seconds"]["median"].get<double>());
  }
  EXPECT_NEAR(j["predicted_layer_seconds"].get<double>(), predicted, 1e-12);
  EXPECT_GT(j["layer_seconds"]["median"].get<double>(), 0);
  EXPECT_GT(measured_sum, 0);
  EXPECT_GT(j["phases"][0]["total_bytes"].get<int64_t>(), 0) << "a prolong batch moves bytes";
  CmdResult text = distca("bench link --ranks 2 --tokens-per-rank 2048 --repeats 1");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("fwd_dispatch"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("none (--rate-gbit not given)"), std::string::npos) << text.out;
}

TEST(Cli, BenchLinkBadInputGetsOneLineErrorExitTwo) {
  const BadInput cases[] = {
      {"one rank", "--ranks 1", "--ranks"},
      {"gqa mismatch", "--heads 6 --kv-heads 4", "--heads (6)"},
      {"odd element size", "--dtype-bytes 3", "--dtype-bytes"},
      {"negative rate", "--rate-gbit -1", "--rate-gbit"},
      {"zero repeats", "--repeats 0", "--repeats"},
      {"unknown policy", "--policy best", "best"},
      {"tiny batch", "--tokens-per-rank 10", "--tokens-per-rank"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("bench link " + c.args);
    cli::expect_refused(r, c);
  }
}

// bench link and bench step estimate their memory before they allocate, and refuse a run this
// machine cannot hold with one line naming the estimate and what is available (exit 2), at once.
// Before: bench step --context 1000000 ended in "exception: std::bad_alloc" (exit 1), and bench
// link allocated its buffers until the machine ran out.
TEST(Cli, BenchLinkAndStepRefuseARunTooLargeForThisMachineBeforeAllocating) {
  const BadInput cases[] = {
      {"bench link, 1024 heads", "bench link --ranks 64 --heads 1024 --kv-heads 1024 --tokens-per-rank 1048576",
       "bench link needs about"},
      {"bench step, 1M tokens", "bench step --context 1000000", "bench step needs about"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca(c.args);
    cli::expect_refused(r, c);
    EXPECT_NE(r.err.find(" GiB available"), std::string::npos) << r.err;
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

// A bad output path fails at once, before the minutes of measuring: exit 2, one line naming
// the path, no progress line, no file.
TEST(Cli, ProfileRefusesABadOutputPathBeforeAnyWork) {
  const std::string missing = (scratch() / "no-such-folder" / "profile.json").string();
  const std::string folder = scratch().string();
  const BadInput cases[] = {
      {"missing folder", "--out " + missing, "no-such-folder"},
      {"a directory", "--out " + folder, folder.c_str()},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("profile --preset tiny --ranks 2 " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.name << ": " << r.err;  // no "[profile] ..." progress: nothing ran
    EXPECT_NE(r.err.find("--out"), std::string::npos) << c.name << ": " << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.name;
  }
  EXPECT_FALSE(fs::exists(missing));
}

TEST(Cli, BenchCalibrationReportsPredictedAndMeasuredSteps) {
  CmdResult r = distca("bench calibration --preset tiny --steps 3 --ranks 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  for (const char* field : {"predicted_colocated", "measured_colocated", "predicted_cad", "measured_cad"}) {
    EXPECT_GT(j[field].get<double>(), 0.0) << field;
  }
  EXPECT_EQ(j["steps"].size(), 6u);
  // --pp: both pipeline schedules, each step measured and predicted; the table on stdout and the
  // same run's JSON through --json-out.
  const std::string json_path = (scratch() / "calibration-pp.json").string();
  fs::remove(json_path);
  CmdResult pp = distca("bench calibration --preset tiny --pp 2 --micro-batches 3 --steps 2 --skip 0 --ranks 2 --json-out " +
                        json_path);
  ASSERT_EQ(pp.exit_code, 0) << pp.err;
  EXPECT_NE(pp.out.find("pipeline: 2 stages x 1 replica, 3 micro-batches per step"), std::string::npos) << pp.out;
  EXPECT_NE(pp.out.find("speedup: measured"), std::string::npos) << pp.out;
  distca::Result<std::string> written = distca::read_text_file(json_path);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  auto p = nlohmann::json::parse(written.value());
  EXPECT_EQ(p["pp"], 2);
  EXPECT_EQ(p["micro_batches"], 3);
  for (const char* field : {"predicted_colocated", "measured_colocated", "predicted_cad", "measured_cad"}) {
    EXPECT_GT(p[field].get<double>(), 0.0) << field;
  }
  ASSERT_EQ(p["steps"].size(), 4u);
  EXPECT_EQ(p["steps"][0]["schedule"], "colocated");
  EXPECT_EQ(p["steps"][1]["schedule"], "cad");
  for (const char* args : {"bench calibration --preset tiny --pp 3", "bench calibration --micro-batches 2"}) {
    CmdResult bad = distca(args);
    EXPECT_EQ(bad.exit_code, 2) << args;
    EXPECT_EQ(count_lines(bad.err), 1) << args << ": " << bad.err;
  }
  EXPECT_EQ(distca("bench calibration --steps 1").exit_code, 2);
  for (const char* args : {"bench calibration --timeout 0", "profile --timeout 100000", "bench dispatch --timeout -1"}) {
    CmdResult bad = distca(args);
    EXPECT_EQ(bad.exit_code, 2) << args;
    EXPECT_EQ(count_lines(bad.err), 1) << args << ": " << bad.err;
    EXPECT_NE(bad.err.find("--timeout must be 1..86400"), std::string::npos) << args << ": " << bad.err;
  }
}

#ifdef DISTCA_MPIRUN
using cli::mpirun;

// Every rank re-executes itself for OpenBLAS before MPI starts; the job runs as before.
TEST(Cli, BenchDispatchUnderMpirunRunsTheAvx512BlasCore) {
  CmdResult r = mpirun(2, "bench dispatch --quick --link off --repeats 1 --json", "env -u OPENBLAS_CORETYPE ");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["comm"], "mpi");
  EXPECT_EQ(j["ranks"], 2);
  if (cpu_has_avx512f()) {
    EXPECT_TRUE(is_avx512_blas_core(j["blas_core"])) << j["blas_core"];
  }
}

// --ranks sets thread ranks; under mpirun it would be ignored, so it is refused.
TEST(Cli, BenchAndProfileRefuseRanksUnderMpirun) {
  for (const char* args : {"bench dispatch --quick --ranks 2", "bench calibration --ranks 2", "profile --ranks 2"}) {
    CmdResult r = mpirun(2, args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("--ranks"), std::string::npos) << args << ": " << r.err;
  }
  CmdResult r = mpirun(2, "profile --preset tiny --out " + (scratch() / "no-such-folder" / "p.json").string());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("no-such-folder"), std::string::npos) << r.err;
}
#endif

}  // namespace
