#include "cmd_simulate.h"

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "distca/core/file.h"
#include "distca/plan/model.h"
#include "distca/sim/simulate.h"

namespace distca::tools {

namespace {

struct SimArgs {
  std::string model = "llama-8b";
  int gpus = 64;
  int gpus_per_node = 8;
  int tp = 8;
  int pp = 1;
  int cp = 0;
  int wlb_cp = 0;
  plan::SamplingOptions sampling;
  std::string context = "128K";
  int batch = 4;
  std::string workload = "pretrain";
  std::string system = "all";
  std::string profile;
  uint64_t seed = 1;
  bool is_json = false;
  bool is_paper = false;
  std::string plot;
  int iterations = 0;  // 0: 1, or 5 with --paper
};

// "512K", "1M" or a plain number of tokens.
Result<int64_t> parse_tokens(const std::string& s) {
  if (s.empty()) return invalid_argument("--context is empty");
  int64_t mult = 1;
  std::string digits = s;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M') {
    mult = last == 'K' ? 1024 : 1024 * 1024;
    digits = s.substr(0, s.size() - 1);
  }
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) {
    return invalid_argument(fmt::format("--context must be a token count such as 131072, 128K or 1M, got '{}'", s));
  }
  return std::stoll(digits) * mult;
}

// Context parallelism so that a unit holds at most 64K tokens of a sequence (what an 8-GPU
// group holds in activations for these models), within what the GPUs allow.
int auto_cp(int64_t context, int gpus, int tp, int pp) {
  int cp = 1;
  while (context / cp > 65536 && (gpus / tp / pp) % (2 * cp) == 0) cp *= 2;
  return cp;
}

double imbalance(const std::vector<double>& v) {
  double sum = 0, mx = 0;
  for (double x : v) sum += x, mx = std::max(mx, x);
  return sum > 0 ? mx / (sum / static_cast<double>(v.size())) : 1.0;
}

std::pair<double, double> min_max(const std::vector<double>& v) {
  if (v.empty()) return {0, 0};
  return {*std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end())};
}

nlohmann::json report(const sim::SimOptions& o, const std::vector<sim::SystemResult>& rs) {
  nlohmann::json systems = nlohmann::json::array();
  double wlb = 0, col = 0;
  for (const auto& r : rs) {
    if (r.system == "wlb") wlb = r.seconds;
    if (r.system == "colocated") col = r.seconds;
  }
  for (const auto& r : rs) {
    nlohmann::json j = r.to_json();
    j["attention_imbalance"] = imbalance(r.unit_attention);
    j["speedup_over_wlb"] = wlb > 0 ? nlohmann::json(wlb / r.seconds) : nlohmann::json(nullptr);
    j["speedup_over_colocated"] = col > 0 ? nlohmann::json(col / r.seconds) : nlohmann::json(nullptr);
    systems.push_back(j);
  }
  return {{"model", o.model.name}, {"gpus", o.cluster.gpus}, {"tp", o.cluster.tp}, {"pp", o.cluster.pp}, {"cp", o.cluster.cp},
          {"dp", o.cluster.dp()},  {"context", o.context},   {"batch", o.batch},     {"workload", o.workload},
          {"systems", systems}};
}

void print_table(const nlohmann::json& j) {
  fmt::print("{} on {} GPUs (tp {}, pp {}, cp {}, dp {}), context {}, {} micro-batches per replica, {} workload\n",
             j["model"].get<std::string>(), j["gpus"].get<int>(), j["tp"].get<int>(), j["pp"].get<int>(), j["cp"].get<int>(), j["dp"].get<int>(),
             j["context"].get<int64_t>(), j["batch"].get<int>(), j["workload"].get<std::string>());
  fmt::print("{:<11} {:>3} {:>9} {:>8} {:>9} {:>7} {:>7} {:>9} {:>13} {:>8} {:>8}\n", "system", "cp", "iter (s)", "linear", "attention",
             "comm", "idle", "attn imb", "mem GiB min-max", "vs wlb", "vs coloc");
  for (const auto& s : j["systems"]) {
    const auto mem = min_max(s["unit_memory_bytes"].get<std::vector<double>>());
    auto ratio = [](const nlohmann::json& v) { return v.is_null() ? std::string("-") : fmt::format("{:.3f}x", v.get<double>()); };
    fmt::print("{:<11} {:>3} {:>9.3f} {:>8.3f} {:>9.3f} {:>7.3f} {:>7.3f} {:>9.2f} {:>6.1f}-{:<6.1f} {:>8} {:>8}\n",
               s["system"].get<std::string>(), s["cp"].get<int>(), s["seconds"].get<double>(), s["linear_seconds"].get<double>(),
               s["attention_seconds"].get<double>(), s["comm_seconds"].get<double>(), s["idle_seconds"].get<double>(),
               s["attention_imbalance"].get<double>(), mem.first / (1 << 30), mem.second / (1 << 30),
               ratio(s["speedup_over_wlb"]), ratio(s["speedup_over_colocated"]));
  }
}

// The paper's experiment grid (its Tables 3 and 4), as its published benchmark scripts run it
// (hao-ai-lab/distca, benchmarks/_250918_large_scale_v11_dpcp and _250915_large_scale_v10_dpcp):
// 3D is TP 8 with one micro-batch of `sequences` packed sequences of `context` tokens per
// iteration: Llama-8B holds 64K tokens per 8-GPU node (4 x 128K on 8 nodes ... 4 x 512K on 32),
// Llama-34B one sequence per 8 nodes; CAD runs over all nodes, and WLB-ideal is the faster of
// its sweep's CP degrees. 4D (benchmarks2/_251025_perseq_pp) is PP 2, a stage's nodes holding
// 64K tokens each per micro-batch, 8 micro-batches at 128K and 4 above, with WLB-ideal's sweep.
struct PaperCase {
  std::string model;
  int gpus;
  int pp;
  int64_t context;
  int sequences;  // per micro-batch, all replicas
  int micro_batches;
  std::string dataset;
  std::string parallelism;
  double low, high;
};

std::vector<PaperCase> paper_cases() {
  std::vector<PaperCase> cases;
  for (const std::string dataset : {"pretrain", "prolong"}) {
    const double low3 = dataset == "pretrain" ? 1.07 : 1.05, high3 = dataset == "pretrain" ? 1.20 : 1.12;
    for (const std::string model : {"llama-8b", "llama-34b"}) {
      for (int gpus : {64, 128, 256}) {
        for (int64_t context : {int64_t{128} << 10, int64_t{256} << 10, int64_t{512} << 10}) {
          const int units = gpus / 8;
          const int sequences = model == "llama-8b" ? static_cast<int>(units * int64_t{65536} / context) : units / 8;
          cases.push_back({model, gpus, 1, context, sequences, 1, dataset, "3D", low3, high3});
        }
      }
    }
    const double low4 = dataset == "pretrain" ? 1.15 : 1.10, high4 = dataset == "pretrain" ? 1.30 : 1.35;
    for (int gpus : {128, 256, 512}) {
      for (int64_t context : {int64_t{128} << 10, int64_t{256} << 10, int64_t{512} << 10}) {
        const int stage_units = gpus / 8 / 2;
        const int sequences = static_cast<int>(stage_units * int64_t{65536} / context);
        cases.push_back({"llama-8b", gpus, 2, context, sequences, context == int64_t{128} << 10 ? 8 : 4, dataset, "4D",
                         low4, high4});
      }
    }
  }
  return cases;
}

// The scripts' sampling. Pretrain: half the documents of under 64K tokens kept, longer ones
// drawn 4x as often, lengths x context / 64K. ProLong draws its documents of 64K tokens or more
// in file order, so every measured iteration holds only those, unscaled, 30% of them made one
// sequence long (CHANGE_LONG_DOC_RATIO 0.3).
plan::SamplingOptions paper_sampling(const std::string& dataset) {
  plan::SamplingOptions so;
  if (dataset == "pretrain") {
    so.keep_short = 0.5;
    so.upsample = 4;
  } else {
    so.keep_short = 0;
    so.elongation = 1;
    so.full_context_share = 0.3;
  }
  return so;
}

int run_paper(const SimArgs& a, const sim::Profile& profile) {
  nlohmann::json records = nlohmann::json::array();
  const auto begin = std::chrono::steady_clock::now();
  if (!a.is_json) {
    fmt::print("{:<10} {:>5} {:>3} {:>7} {:<9} {:<3} {:>11} {:>8} {:>13}  {}\n", "model", "gpus", "pp", "context", "dataset",
               "par", "cad-distca", "cad", "paper", "");
  }
  for (const PaperCase& pc : paper_cases()) {
    sim::SimOptions o;
    o.model = plan::model_preset(pc.model).value();
    o.cluster.gpus = pc.gpus;
    o.cluster.pp = pc.pp;
    o.cluster.cp = pc.gpus / 8 / pc.pp / pc.sequences;
    o.context = pc.context;
    o.batch = pc.micro_batches;
    o.sampling = paper_sampling(pc.dataset);
    o.workload = pc.dataset;
    o.seed = a.seed;
    // Mean iteration times over several sampled iterations (one iteration's documents are a
    // small sample of the workload).
    std::array<double, 4> mean{0, 0, 0, 0};
    for (int it = 0; it < a.iterations; ++it) {
      o.seed = a.seed + static_cast<uint64_t>(it);
      auto rs = sim::simulate(profile, o, {"wlb", "cad-distca", "cad", "colocated"});
      if (!rs.is_ok()) {
        fmt::print(stderr, "distca simulate --paper: error: {}\n", rs.status().message());
        return 1;
      }
      for (size_t k = 0; k < 4; ++k) mean[k] += rs.value()[k].seconds / a.iterations;
    }
    const double s_distca = mean[0] / mean[1], s_cad = mean[0] / mean[2];
    const bool inside = s_distca >= pc.low - 0.05 && s_distca <= pc.high + 0.05;
    records.push_back({{"model", pc.model}, {"gpus", pc.gpus}, {"pp", pc.pp}, {"context", pc.context},
                       {"dataset", pc.dataset}, {"parallelism", pc.parallelism}, {"speedup_cad_distca", s_distca},
                       {"speedup_cad", s_cad}, {"speedup_cad_distca_over_colocated", mean[3] / mean[1]},
                       {"paper_low", pc.low}, {"paper_high", pc.high}, {"within_0.05", inside}});
    if (!a.is_json) {
      fmt::print("{:<10} {:>5} {:>3} {:>6}K {:<9} {:<3} {:>10.3f}x {:>7.3f}x {:>6.2f}-{:.2f}x  {}\n", pc.model, pc.gpus,
                 pc.pp, pc.context >> 10, pc.dataset, pc.parallelism, s_distca, s_cad, pc.low, pc.high,
                 inside ? "" : "outside");
      std::fflush(stdout);
    }
  }
  if (a.is_json) {
    fmt::print("{}\n", records.dump(2));
  } else {
    int inside = 0;
    for (const auto& r : records) inside += r["within_0.05"].get<bool>() ? 1 : 0;
    fmt::print("{} of {} configurations within 0.05 of the published range; {:.1f} s\n", inside, records.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  return 0;
}

// An SVG of the report: iteration time per system (with its speedup over wlb), then each
// system's per-unit attention seconds as bars, so stragglers show.
std::string plot_svg(const nlohmann::json& j) {
  const auto& systems = j["systems"];
  const int W = 900, row = 150, top = 60;
  const int H = top + 40 * static_cast<int>(systems.size()) + row * static_cast<int>(systems.size()) + 20;
  std::string svg = fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">)"
                                "\n",
                                W, H);
  svg += fmt::format(R"(<text x="10" y="20" font-size="14">{} on {} GPUs (tp {}, pp {}, cp {}, dp {}), context {}, {}</text>)" "\n",
                     j["model"].get<std::string>(), j["gpus"].get<int>(), j["tp"].get<int>(), j["pp"].get<int>(),
                     j["cp"].get<int>(), j["dp"].get<int>(), j["context"].get<int64_t>(), j["workload"].get<std::string>());
  double longest = 0, peak = 0;
  for (const auto& s : systems) {
    longest = std::max(longest, s["seconds"].get<double>());
    for (double a : s["unit_attention_seconds"].get<std::vector<double>>()) peak = std::max(peak, a);
  }
  const char* colors[] = {"#888888", "#d08c2c", "#4c78a8", "#2ca02c"};
  int y = top - 20;
  for (size_t i = 0; i < systems.size(); ++i) {
    const auto& s = systems[i];
    const double w = 600 * s["seconds"].get<double>() / longest;
    const auto& vs = s["speedup_over_wlb"];
    svg += fmt::format(R"(<text x="10" y="{}">{}</text><rect x="110" y="{}" width="{:.1f}" height="22" fill="{}"/>)"
                       R"(<text x="{:.1f}" y="{}">{:.3f} s{}</text>)" "\n",
                       y + 15, s["system"].get<std::string>(), y, w, colors[i % 4], 115 + w, y + 15, s["seconds"].get<double>(),
                       vs.is_null() ? std::string() : fmt::format(" ({:.2f}x over wlb)", vs.get<double>()));
    y += 30;
  }
  y += 20;
  for (size_t i = 0; i < systems.size(); ++i) {
    const auto& s = systems[i];
    const auto units = s["unit_attention_seconds"].get<std::vector<double>>();
    svg += fmt::format(R"(<text x="10" y="{}">{}: attention per unit (max/mean {:.2f})</text>)" "\n", y + 12,
                       s["system"].get<std::string>(), s["attention_imbalance"].get<double>());
    const double bw = 780.0 / std::max<size_t>(units.size(), 1);
    for (size_t u = 0; u < units.size(); ++u) {
      const double h = peak > 0 ? 110 * units[u] / peak : 0;
      svg += fmt::format(R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}"/>)", 110 + u * bw,
                         y + 130 - h, std::max(bw - 1, 0.5), h, colors[i % 4]);
    }
    svg += "\n";
    y += row;
  }
  return svg + "</svg>\n";
}

int run_simulate(const SimArgs& a) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "distca simulate: error: {}\n", s.message());
    return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
  };
  sim::Profile profile = sim::default_h200_profile();
  if (!a.profile.empty()) {
    auto loaded = sim::load_profile(a.profile);
    if (!loaded.is_ok()) return fail(loaded.status());
    profile = loaded.value();
  }
  if (a.is_paper) {
    SimArgs p = a;
    if (p.iterations == 0) p.iterations = 15;
    if (p.iterations < 1 || p.iterations > 1000) return fail(invalid_argument("--iterations must be 1..1000"));
    return run_paper(p, profile);
  }
  auto model = plan::model_preset(a.model);
  if (!model.is_ok()) return fail(model.status());
  auto context = parse_tokens(a.context);
  if (!context.is_ok()) return fail(context.status());
  sim::SimOptions o;
  o.model = model.value();
  o.cluster = {a.gpus, a.gpus_per_node, a.tp, a.pp, a.cp};
  if (a.cp == 0 && a.tp > 0 && a.pp > 0) o.cluster.cp = auto_cp(context.value(), a.gpus, a.tp, a.pp);
  o.context = context.value();
  o.batch = a.batch;
  o.wlb_cp = a.wlb_cp;
  o.sampling = a.sampling;
  o.workload = a.workload;
  o.seed = a.seed;
  std::vector<std::string> systems = sim::system_names();
  if (a.system != "all") systems = {a.system};
  auto rs = sim::simulate(profile, o, systems);
  if (!rs.is_ok()) return fail(rs.status());
  const nlohmann::json j = report(o, rs.value());
  if (!a.plot.empty()) {
    if (Status st = write_file_atomic(a.plot, plot_svg(j)); !st.is_ok()) return fail(st);
  }
  if (a.is_json) {
    fmt::print("{}\n", j.dump(2));
  } else {
    print_table(j);
    fmt::print("profile: {}\n", profile.name);
  }
  return 0;
}

}  // namespace

std::function<int()> add_simulate_command(CLI::App& app) {
  auto args = std::make_shared<SimArgs>();
  SimArgs& a = *args;
  CLI::App* cmd = app.add_subcommand("simulate", "Price one training iteration of colocated, WLB-style and CAD training on a "
                                                 "simulated cluster (profiles: the default H200 one, or --profile)");
  cmd->add_option("--model", a.model, "llama-8b | llama-34b")->capture_default_str();
  cmd->add_option("--gpus", a.gpus, "GPUs in all")->capture_default_str();
  cmd->add_option("--gpus-per-node", a.gpus_per_node, "GPUs per node")->capture_default_str();
  cmd->add_option("--tp", a.tp, "tensor-parallel degree (one unit = tp GPUs)")->capture_default_str();
  cmd->add_option("--pp", a.pp, "pipeline stages")->capture_default_str();
  cmd->add_option("--cp", a.cp, "context-parallel units per sequence (0: context / 64K, as the GPUs allow)")->capture_default_str();
  cmd->add_option("--wlb-cp", a.wlb_cp, "wlb's context-parallel degree (0: WLB-ideal, the faster of the two largest it may use)")->capture_default_str();
  cmd->add_option("--context", a.context, "tokens per sequence (one micro-batch of a replica, over cp units), e.g. 128K, 512K")
      ->capture_default_str();
  cmd->add_option("--batch", a.batch, "micro-batches per data-parallel replica per iteration")->capture_default_str();
  cmd->add_option("--workload", a.workload, "document lengths: pretrain | prolong")->capture_default_str();
  cmd->add_option("--keep-short", a.sampling.keep_short, "sampling: share of documents of at most 64K tokens kept")
      ->capture_default_str();
  cmd->add_option("--upsample", a.sampling.upsample, "sampling: how many times more often longer documents are drawn")
      ->capture_default_str();
  cmd->add_option("--elongation", a.sampling.elongation, "sampling: length multiplier (0: context / 64K)")->capture_default_str();
  cmd->add_option("--full-context-share", a.sampling.full_context_share,
                  "sampling: share of longer documents made exactly one sequence long")
      ->capture_default_str();
  cmd->add_option("--system", a.system, "colocated | wlb | cad-distca | cad | all")->capture_default_str();
  cmd->add_option("--profile", a.profile, "a profile JSON (distca-profile, version 1); default: the built-in H200 one");
  cmd->add_option("--seed", a.seed, "sampling seed")->capture_default_str();
  cmd->add_flag("--json", a.is_json, "print JSON");
  cmd->add_option("--plot", a.plot, "also draw the iteration times and per-unit attention bars into this SVG file");
  cmd->add_option("--iterations", a.iterations, "--paper: sampled iterations averaged per configuration (default 15, as the paper's runs)");
  cmd->add_flag("--paper", a.is_paper, "run the paper's 3D and 4D configurations and compare with its published speedups");
  return [args] { return run_simulate(*args); };
}

}  // namespace distca::tools
