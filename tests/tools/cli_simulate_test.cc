// The `distca simulate` command line, run as a user runs it (see cli_util.h).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
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

// Progress lines on stderr while a simulation runs (DISTCA_PROGRESS_INTERVAL=0: every stage at
// once): each system, each eps of the sweep and each micro-batch it plans.
TEST(Cli, SimulateSaysWhatItIsDoingOnStderr) {
  CmdResult r = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=0 ") + DISTCA_BIN +
                               " simulate --gpus 64 --system all --tolerance-sweep off --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.rfind("distca simulate: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(" s: colocated\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("s: wlb\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("s: cad: eps 0.05, micro-batch 1 of 4: planning 8 ranks with minlink\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("s: cad-distca: eps 0.05, micro-batch 4 of 4: planning 8 ranks with distca\n"), std::string::npos)
      << r.err;
  EXPECT_NO_THROW((void)nlohmann::json::parse(r.out)) << "stdout stays the report alone";
  CmdResult sweep = cli::run_shell(std::string("DISTCA_PROGRESS_INTERVAL=0 ") + DISTCA_BIN +
                                   " simulate --gpus 64 --system cad --iterations 2 --json");
  ASSERT_EQ(sweep.exit_code, 0) << sweep.err;
  EXPECT_NE(sweep.err.find("s: iteration 2 of 2, cad: eps 0.025 (2 of 10 in the sweep), micro-batch 3 of 4: planning 8 "
                           "ranks with minlink\n"),
            std::string::npos)
      << sweep.err;
}

TEST(Cli, SimulateJsonAndPaperRecordsHaveTheDocumentedFields) {
  CmdResult r = distca("simulate --gpus 64 --context 128K --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["systems"].size(), 5u);
  EXPECT_EQ(j["iterations"], 1);
  EXPECT_EQ(j["device_memory_bytes"], 141e9);
  EXPECT_EQ(j["grad_return"], "bf16");  // the default, as the paper's system returns dK/dV
  for (const auto& s : j["systems"]) {
    for (const char* field : {"seconds", "linear_seconds", "attention_seconds", "comm_seconds", "idle_seconds",
                              "speedup_over_wlb", "speedup_over_colocated", "attention_imbalance", "memory_bytes_per_gpu",
                              "device_memory_bytes"}) {
      EXPECT_TRUE(s[field].is_number()) << field;
    }
    EXPECT_EQ(s["fits_memory"], true);
    for (const char* field : {"unit_linear_seconds", "unit_attention_seconds", "unit_comm_seconds", "unit_idle_seconds",
                              "unit_activation_bytes"}) {
      EXPECT_EQ(s[field].size(), 8u) << field;
    }
  }
  CmdResult paper = distca("simulate --paper --iterations 1 --json");
  ASSERT_EQ(paper.exit_code, 0) << paper.err;
  auto records = nlohmann::json::parse(paper.out);
  ASSERT_GT(records.size(), 10u);
  for (const auto& rec : records) {
    for (const char* field : {"model", "gpus", "context", "dataset", "parallelism", "speedup_cad_distca", "speedup_cad", "speedup_cad_minmax",
                              "paper_low", "paper_high", "fits_memory", "memory_bytes_per_gpu", "grad_return"}) {
      EXPECT_TRUE(rec.contains(field)) << field;
    }
    EXPECT_EQ(rec["speedup_over"], "wlb");
    EXPECT_TRUE(rec["parallelism"] == "3D" || rec["parallelism"] == "4D");
  }
}

// Every speedup names its baseline, in the table and in the JSON.
TEST(Cli, SimulateSpeedupsNameTheirBaseline) {
  CmdResult table = distca("simulate --gpus 64 --context 128K");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("speedup over wlb"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("over colocated"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("speedup over X: X's iteration time / the system's"), std::string::npos) << table.out;
  CmdResult j = distca("simulate --gpus 64 --context 128K --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const auto report = nlohmann::json::parse(j.out);
  double wlb = 0;
  for (const auto& s : report["systems"]) {
    if (s["system"] == "wlb") wlb = s["seconds"].get<double>();
  }
  for (const auto& s : report["systems"]) {
    EXPECT_NEAR(s["speedup_over_wlb"].get<double>(), wlb / s["seconds"].get<double>(), 1e-12) << s["system"];
  }
  CmdResult paper = distca("simulate --paper --iterations 1");
  ASSERT_EQ(paper.exit_code, 0) << paper.err;
  EXPECT_EQ(paper.out.rfind("speedup over wlb (WLB-ideal): wlb's iteration time / the system's", 0), 0u) << paper.out;
}

// In the table and the JSON, iter = linear + attention + comm + idle.
TEST(Cli, SimulateSummaryTermsAddUpToTheIterationTime) {
  for (const std::string args : {"--gpus 64 --context 128K", "--gpus 128 --pp 2 --context 256K --iterations 2"}) {
    SCOPED_TRACE(args);
    CmdResult table = distca("simulate " + args);
    ASSERT_EQ(table.exit_code, 0) << table.err;
    int rows = 0;
    std::istringstream lines(table.out);
    for (std::string line; std::getline(lines, line);) {
      // "cad  2  0.0125  4.087 =  2.775 +  1.143 +  0.116 +  0.054  ..."
      std::istringstream in(line);
      std::string system, cp, eps, eq, p1, p2, p3;
      double iter = 0, linear = 0, attention = 0, comm = 0, idle = 0;
      if (!(in >> system >> cp >> eps >> iter >> eq >> linear >> p1 >> attention >> p2 >> comm >> p3 >> idle) || eq != "=") continue;
      ++rows;
      // Five numbers rounded to 0.001: the printed parts add up to the printed time within 0.0025.
      EXPECT_NEAR(linear + attention + comm + idle, iter, 0.0025) << line;
      EXPECT_GE(idle, 0) << line;
    }
    EXPECT_EQ(rows, 5) << table.out;
    CmdResult j = distca("simulate " + args + " --json");
    ASSERT_EQ(j.exit_code, 0) << j.err;
    const auto report = nlohmann::json::parse(j.out);
    for (const auto& s : report["systems"]) {
      const double seconds = s["seconds"].get<double>();
      EXPECT_NEAR(s["linear_seconds"].get<double>() + s["attention_seconds"].get<double>() + s["comm_seconds"].get<double>() +
                      s["idle_seconds"].get<double>(),
                  seconds, 1e-9 * seconds)
          << s["system"];
      for (size_t u = 0; u < s["unit_linear_seconds"].size(); ++u) {
        EXPECT_NEAR(s["unit_linear_seconds"][u].get<double>() + s["unit_attention_seconds"][u].get<double>() +
                        s["unit_comm_seconds"][u].get<double>() + s["unit_idle_seconds"][u].get<double>(),
                    seconds, 1e-9 * seconds)
            << s["system"] << " unit " << u;
      }
    }
  }
}

// --iterations without --paper is honoured, averaging seeds seed, seed + 1, ...
TEST(Cli, SimulateIterationsAverageSampledIterations) {
  CmdResult three = distca("simulate --system cad --seed 4 --iterations 3 --json");
  ASSERT_EQ(three.exit_code, 0) << three.err;
  const auto mean = nlohmann::json::parse(three.out);
  EXPECT_EQ(mean["iterations"], 3);
  const auto& cad = mean["systems"][0];
  ASSERT_EQ(cad["iteration_seconds"].size(), 3u);
  double sum = 0;
  for (int seed : {4, 5, 6}) {
    CmdResult one = distca("simulate --system cad --seed " + std::to_string(seed) + " --json");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    const double t = nlohmann::json::parse(one.out)["systems"][0]["seconds"].get<double>();
    EXPECT_EQ(cad["iteration_seconds"][seed - 4].get<double>(), t) << seed;
    sum += t;
  }
  EXPECT_NEAR(cad["seconds"].get<double>(), sum / 3, 1e-12 * sum);
  CmdResult table = distca("simulate --system cad --seed 4 --iterations 3");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("mean of 3 iterations (seeds 4..6)"), std::string::npos) << table.out;
}

// A configuration whose memory exceeds the device's is marked in the
// table, the JSON and a warning line; it still runs (exit 0).
TEST(Cli, SimulateFlagsConfigurationsThatDoNotFitInDeviceMemory) {
  const std::string args = "simulate --gpus 8 --context 2M --batch 1 --system cad";
  CmdResult table = distca(args);
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("does not fit: "), std::string::npos) << table.out;
  EXPECT_NE(table.out.find(" GB per GPU > 141.0 GB"), std::string::npos) << table.out;
  EXPECT_EQ(count_lines(table.err), 1) << table.err;
  EXPECT_EQ(table.err.rfind("distca simulate: warning: does not fit in 141.0 GB per GPU: cad needs ", 0), 0u) << table.err;
  CmdResult j = distca(args + " --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const auto report = nlohmann::json::parse(j.out);
  const auto& cad = report["systems"][0];
  EXPECT_EQ(cad["fits_memory"], false);
  EXPECT_GT(cad["memory_bytes_per_gpu"].get<double>(), cad["device_memory_bytes"].get<double>());
  EXPECT_EQ(count_lines(j.err), 1) << j.err;
  // A fitting configuration: no marker, no warning.
  CmdResult fits = distca("simulate --gpus 64 --context 128K");
  ASSERT_EQ(fits.exit_code, 0) << fits.err;
  EXPECT_EQ(fits.out.find("does not fit"), std::string::npos) << fits.out;
  EXPECT_TRUE(fits.err.empty()) << fits.err;
}

// The SVG has axes, tick labels, units, a legend and a title; every
// unit's stacked parts add up to its system's iteration time, in seconds and in pixels.
TEST(Cli, SimulatePlotStacksEachUnitsPartsUpToTheIterationTime) {
  const std::string svg = (scratch() / "sim.svg").string();
  CmdResult r = distca("simulate --gpus 64 --pp 2 --context 128K --json --plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto report = nlohmann::json::parse(r.out);
  const std::string drawing = distca::read_text_file(svg).value();
  EXPECT_EQ(drawing.rfind("<svg", 0), 0u);
  for (const char* text : {"llama-8b on 64 GPUs (tp 8, pp 2, cp 2, dp 2), context 128K", "seconds per iteration", ">seconds<",
                           "unit (8 GPUs each", "linear layers", "core attention", "exposed communication", "idle (waiting",
                           "speedup over wlb: wlb's iteration time / the system's", "x over wlb", ">0<"}) {
    EXPECT_NE(drawing.find(text), std::string::npos) << text;
  }
  // Per (system, unit): the seconds of the parts and their bar heights in pixels.
  std::map<std::string, std::map<std::string, double>> seconds, pixels;
  std::map<std::string, std::map<std::string, int>> parts;
  const std::regex rect(R"re(height="([0-9.]+)" fill="#[0-9a-f]+" data-system="([a-z-]+)" data-unit="([0-9]+|mean)" data-part="([a-z]+)" data-seconds="([0-9.e+-]+)")re");
  for (auto it = std::sregex_iterator(drawing.begin(), drawing.end(), rect); it != std::sregex_iterator(); ++it) {
    const std::string system = (*it)[2], unit = (*it)[3];
    pixels[system][unit] += std::stod((*it)[1]);
    seconds[system][unit] += std::stod((*it)[5]);
    ++parts[system][unit];
  }
  ASSERT_EQ(seconds.size(), 5u);
  for (const auto& s : report["systems"]) {
    const std::string system = s["system"];
    SCOPED_TRACE(system);
    ASSERT_EQ(seconds[system].size(), 9u);  // 8 units and the mean
    const double iteration = s["seconds"].get<double>();
    const double unit_pixels = pixels[system]["0"];
    for (const auto& [unit, sum] : seconds[system]) {
      EXPECT_EQ(parts[system][unit], 4) << unit;
      EXPECT_NEAR(sum, iteration, 1e-6 * iteration) << "unit " << unit;
      if (unit != "mean") {
        EXPECT_NEAR(pixels[system][unit], unit_pixels, 0.02) << "unit " << unit;
      }
    }
  }
  // The per-unit bars share one scale: the longer iteration has the taller bars.
  double longest = 0, shortest = 1e300;
  std::string slow, fast;
  for (const auto& s : report["systems"]) {
    const double t = s["seconds"].get<double>();
    if (t > longest) longest = t, slow = s["system"];
    if (t < shortest) shortest = t, fast = s["system"];
  }
  EXPECT_NEAR(pixels[fast]["0"] / pixels[slow]["0"], shortest / longest, 0.001);
}

// One --paper run: the table on stdout, the records through --json-out, the drawing through --plot.
TEST(Cli, SimulatePaperPlotDrawsEveryConfiguration) {
  const std::string svg = (scratch() / "paper.svg").string();
  const std::string json_path = (scratch() / "paper.json").string();
  fs::remove(json_path);
  CmdResult r = distca("simulate --paper --iterations 1 --json-out " + json_path + " --plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  distca::Result<std::string> written = distca::read_text_file(json_path);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  const auto records = nlohmann::json::parse(written.value());
  ASSERT_TRUE(records.is_array());
  // The table has a row per record, each starting with its model.
  size_t rows = 0;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) rows += line.starts_with("llama-") ? 1 : 0;
  EXPECT_EQ(rows, records.size()) << r.out;
  const std::string drawing = distca::read_text_file(svg).value();
  for (const char* text : {"speedup over wlb", "published range", "cad-distca (simulated)", "cad (simulated)", "1.0x"}) {
    EXPECT_NE(drawing.find(text), std::string::npos) << text;
  }
  const std::regex marker(R"re(data-record="([0-9]+)" data-speedup-cad-distca="([0-9.e+-]+)")re");
  size_t markers = 0;
  for (auto it = std::sregex_iterator(drawing.begin(), drawing.end(), marker); it != std::sregex_iterator(); ++it, ++markers) {
    const auto& rec = records[std::stoul((*it)[1])];
    EXPECT_NEAR(std::stod((*it)[2]), rec["speedup_cad_distca"].get<double>(), 1e-6);
  }
  EXPECT_EQ(markers, records.size());
}

TEST(Cli, SimulateBadInputGetsOneLineErrorExitTwo) {
  const std::string bad_profile = write("bad_profile.json", "{\"format\": \"distca-profile\", \"version\": 9}");
  const BadInput cases[] = {
      {"unknown model", "--model llama-1t", "llama-1t"},
      {"gpus not a multiple", "--gpus 60", "--gpus"},
      {"bad context", "--context 12Q", "--context"},
      {"unknown system", "--system magic", "--system must be colocated, wlb, cad-distca, cad, cad-minmax or all, got 'magic'"},
      {"unknown workload", "--workload web", "--workload must be pretrain or prolong, got 'web'"},
      {"layers do not split", "--gpus 48 --pp 3", "stages"},
      {"missing profile", "--profile /nonexistent.json", "/nonexistent.json"},
      {"bad profile", "--profile " + bad_profile, "version 9"},
      {"wlb cp does not divide", "--wlb-cp 3", "--wlb-cp 3"},
      {"share above one", "--full-context-share 2", "full-context share"},
      {"gpus per node zero", "--gpus-per-node 0", "--gpus-per-node must be in [1, 1000000], got 0"},
      {"batch zero", "--batch 0", "--batch must be 1..4096, got 0"},
      {"negative seed", "--seed -1", "--seed must be >= 0"},
      // Options whose 0 means "choose for me" refuse only negative values, and say so.
      {"negative cp", "--cp -1", "--cp must be >= 1, or 0 for context / 64K"},
      {"negative wlb cp", "--wlb-cp -2", "--wlb-cp must be >= 1, or 0 for WLB-ideal"},
      // --iterations has no "0 = default": given, it must be 1..1000, with or without --paper.
      {"zero iterations", "--iterations 0", "--iterations must be 1..1000, got 0"},
      {"negative iterations", "--iterations -1", "--iterations must be 1..1000, got -1"},
      {"zero paper iterations", "--paper --iterations 0", "--iterations must be 1..1000, got 0"},
      {"too many iterations", "--paper --iterations 1001", "--iterations must be 1..1000, got 1001"},
      {"negative tolerance", "--tolerance -0.1", "--tolerance must be in [0, 1], got -0.1"},
      {"paper tolerance above one", "--paper --tolerance 2", "--tolerance must be in [0, 1], got 2"},
      {"bad sweep", "--tolerance-sweep maybe", "--tolerance-sweep"},
      {"unknown grad return", "--grad-return fp16", "--grad-return must be bf16 or fp32, got 'fp16'"},
      {"paper unknown grad return", "--paper --grad-return half", "--grad-return must be bf16 or fp32, got 'half'"},
      // --paper sets the configuration itself: what it would ignore is refused, by name.
      {"paper with model and gpus", "--paper --model llama-34b --gpus 8", "set --model, --gpus themselves"},
      {"paper with workload", "--paper --workload prolong", "set --workload themselves"},
      {"paper with sampling", "--paper --keep-short 0.5", "set --keep-short themselves"},
      {"paper with system", "--paper --system cad", "set --system themselves"},
  };
  for (const BadInput& c : cases) {
    CmdResult r = distca("simulate " + c.args);
    cli::expect_refused(r, c);
  }
  // The workload message lists only what simulate accepts.
  CmdResult skewed = distca("simulate --workload skewed");
  EXPECT_EQ(skewed.exit_code, 2);
  EXPECT_NE(skewed.err.find("--workload must be pretrain or prolong, got 'skewed'"), std::string::npos) << skewed.err;
  for (const char* foreign : {"--doc-lengths", "--batch FILE", "FILE"}) {
    EXPECT_EQ(skewed.err.find(foreign), std::string::npos) << foreign << ": " << skewed.err;
  }
}

// An output that cannot be written is refused at once (exit 2), before any
// work, and nothing is printed or written.
TEST(Cli, SimulateUnwritableOutputsAreRefusedBeforeAnyWork) {
  const std::string missing = (scratch() / "no_such_folder" / "x.svg").string();
  for (const std::string& args : {"simulate --plot " + missing, "simulate --json --plot " + missing,
                                 "simulate --paper --plot " + missing}) {
    SCOPED_TRACE(args);
    CmdResult r = distca(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("--plot"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  EXPECT_FALSE(fs::exists(scratch() / "no_such_folder"));
  // --json-out too, and against --plot and --profile.
  const std::string plot = (scratch() / "same.svg").string();
  for (const std::string& args : {"simulate --json-out " + missing, "simulate --paper --json-out " + missing,
                                 "simulate --json-out " + scratch().string(), std::string("simulate --json-out /dev/null"), std::string("simulate --json-out ''"),
                                 "simulate --plot " + plot + " --json-out " + plot}) {
    SCOPED_TRACE(args);
    CmdResult r = distca(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("--json-out"), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  EXPECT_FALSE(fs::exists(plot));
  // --json prints to standard output and takes no path: a path after it is refused too.
  CmdResult json = distca("simulate --json " + (scratch() / "no_such_folder" / "x.json").string());
  EXPECT_EQ(json.exit_code, 2) << json.err;
  EXPECT_TRUE(json.out.empty()) << json.out;
}

// --json-out writes the JSON report to a file while the table prints (one run, both forms); with
// --json both outputs are the same object. (--paper: SimulatePaperPlotDrawsEveryConfiguration.)
TEST(Cli, SimulateJsonOutWritesTheReportBesideTheTable) {
  const std::string path = (scratch() / "simulate.json").string();
  fs::remove(path);
  CmdResult r = distca("simulate --gpus 64 --tolerance-sweep off --json-out " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("speedup"), std::string::npos) << r.out;
  distca::Result<std::string> written = distca::read_text_file(path);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  const auto j = nlohmann::json::parse(written.value());
  EXPECT_EQ(j["systems"].size(), 5u);
  EXPECT_EQ(j["gpus"], 64);
  CmdResult both = distca("simulate --gpus 64 --tolerance-sweep off --json --json-out " + path);
  ASSERT_EQ(both.exit_code, 0) << both.err;
  EXPECT_EQ(nlohmann::json::parse(both.out), nlohmann::json::parse(distca::read_text_file(path).value()));
}

}  // namespace
