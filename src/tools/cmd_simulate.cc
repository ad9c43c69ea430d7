#include "cmd_simulate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "distca/core/progress.h"
#include "distca/core/file.h"
#include "distca/plan/model_shape.h"
#include "distca/plan/planner.h"
#include "distca/facade/sim_request.h"
#include "distca/sim/simulate.h"

namespace distca::tools {

namespace {

struct SimArgs {
  facade::SimRequest request;  // one configuration (iterations set from --iterations below)
  std::string tolerance_sweep = "on";
  std::string profile;
  bool is_json = false;
  std::string json_out;  // --json-out: the JSON report also to this file
  const CLI::Option* json_out_option = nullptr;
  bool is_paper = false;
  std::string plot;
  std::optional<int> iterations;  // default: 1, or 15 with --paper
  // The options of one configuration, which --paper sets itself for each of its runs.
  std::vector<const CLI::Option*> one_config_options;
};

constexpr double kGB = 1e9;  // memory is printed in GB, as device datasheets give it

// "does not fit: 1095.2 GB per GPU > 141.0 GB", or "" when it fits (or the device is unknown).
std::string fit_note(const nlohmann::json& s) {
  if (!s["fits_memory"].is_boolean() || s["fits_memory"].get<bool>()) return "";
  return fmt::format("does not fit: {:.1f} GB per GPU > {:.1f} GB", s["memory_bytes_per_gpu"].get<double>() / kGB,
                     s["device_memory_bytes"].get<double>() / kGB);
}

// The CP degrees a system ran at over the iterations: "4", or "4,8" when they differ.
std::string cp_text(const nlohmann::json& s) {
  const auto cps = s["iteration_cp"].get<std::set<int>>();
  return fmt::format("{}", fmt::join(cps, ","));
}

// The tolerances a CAD system's planner ran at over the iterations ("0.0125", "0.05,0.025"), or
// "-" for systems without a planner.
std::string eps_text(const nlohmann::json& s) {
  if (s["iteration_tolerance"].is_null()) return "-";
  const auto eps = s["iteration_tolerance"].get<std::set<double>>();
  std::vector<std::string> parts;
  for (auto it = eps.rbegin(); it != eps.rend(); ++it) parts.push_back(fmt::format("{:g}", *it));
  return fmt::format("{}", fmt::join(parts, ","));
}

// "llama-8b on 64 GPUs (...), context 128K, 4 micro-batches per replica, pretrain workload".
std::string config_text(const nlohmann::json& j) {
  const int batch = j["batch"].get<int>();
  return fmt::format("{} on {} GPUs (tp {}, pp {}, cp {}, dp {}), context {}, {} micro-batch{} per replica, {} workload",
                     j["model"].get<std::string>(), j["gpus"].get<int>(), j["tp"].get<int>(), j["pp"].get<int>(),
                     j["cp"].get<int>(), j["dp"].get<int>(), facade::context_text(j["context"].get<int64_t>()), batch,
                     batch == 1 ? "" : "es", j["workload"].get<std::string>());
}

// "1 iteration (seed 1)" or "mean of 3 iterations (seeds 1..3)".
std::string iterations_text(const nlohmann::json& j) {
  const int iterations = j["iterations"].get<int>();
  const uint64_t seed = j["seed"].get<uint64_t>();
  return iterations == 1 ? fmt::format("1 iteration (seed {})", seed)
                         : fmt::format("mean of {} iterations (seeds {}..{})", iterations, seed, seed + iterations - 1);
}

// The table: each iteration time as the sum of its parts (means over units), so it can be
// checked by eye; every ratio says what it is relative to.
void print_table(const nlohmann::json& j) {
  fmt::print("{}, {}\n", config_text(j), iterations_text(j));
  fmt::print("{:<12} {:>5} {:>20} {:>9}   {:>7}   {:>9}   {:>7}   {:>7} {:>14} {:>7} {:>17} {:>15}\n", "system", "cp", "eps",
             "iter (s)", "linear", "attention", "comm", "idle", "attn max/mean", "GB/GPU", "speedup over wlb", "over colocated");
  for (const auto& s : j["systems"]) {
    auto ratio = [](const nlohmann::json& v) { return v.is_null() ? std::string("-") : fmt::format("{:.3f}x", v.get<double>()); };
    const std::string note = fit_note(s);
    fmt::print("{:<12} {:>5} {:>20} {:>9.3f} = {:>7.3f} + {:>9.3f} + {:>7.3f} + {:>7.3f} {:>14.2f} {:>7.1f} {:>17} {:>15}{}\n",
               s["system"].get<std::string>(), cp_text(s), eps_text(s), s["seconds"].get<double>(), s["linear_seconds"].get<double>(),
               s["attention_seconds"].get<double>(), s["comm_seconds"].get<double>(), s["idle_seconds"].get<double>(),
               s["attention_imbalance"].get<double>(), s["memory_bytes_per_gpu"].get<double>() / kGB,
               ratio(s["speedup_over_wlb"]), ratio(s["speedup_over_colocated"]), note.empty() ? "" : "  " + note);
  }
  const int units = j["units"].get<int>();
  fmt::print("iter: one iteration, its slowest unit (a unit is {} GPUs); linear, attention, comm (exposed, with the gradient "
             "all-reduce) and idle (waiting: stragglers, pipeline bubbles) are means over the {} unit{}\n",
             j["tp"].get<int>(), units, units == 1 ? "" : "s");
  fmt::print("eps: the tolerance each CAD planner ran at, per iteration where they differ ({})\n",
             j["tolerance_sweep"].get<bool>() ? fmt::format("the fastest of {0:g}, {0:g}/2, ..., {0:g}/512", j["tolerance"].get<double>())
                                              : "--tolerance-sweep off");
  fmt::print("attn max/mean: the busiest unit's attention seconds over the mean; GB/GPU: the fullest GPU's peak, activations "
             "+ weights, gradients and optimizer states (1 GB = 1e9 bytes); speedup over X: X's iteration time / the "
             "system's (-: X not simulated)\n");
  fmt::print("dK/dV return: {} for cad and cad-minmax (--grad-return), the activation dtype for cad-distca; summed in "
             "fp32 at the owner\n", j["grad_return"].get<std::string>());
  const auto& device = j["device_memory_bytes"];
  fmt::print("profile: {} ({})\n", j["profile"].get<std::string>(),
             device.is_null() ? std::string("no device memory given: memory not checked")
                              : fmt::format("device memory {:.1f} GB per GPU", device.get<double>() / kGB));
}

// One warning line naming the systems whose memory exceeds the device's.
void warn_memory(const nlohmann::json& j) {
  std::vector<std::string> over;
  for (const auto& s : j["systems"]) {
    if (!fit_note(s).empty()) {
      over.push_back(fmt::format("{} needs {:.1f} GB", s["system"].get<std::string>(), s["memory_bytes_per_gpu"].get<double>() / kGB));
    }
  }
  if (over.empty()) return;
  fmt::print(stderr, "distca simulate: warning: does not fit in {:.1f} GB per GPU: {} (the times assume it did)\n",
             j["device_memory_bytes"].get<double>() / kGB, fmt::join(over, ", "));
}

// --- SVG drawing (hand-written, no dependencies) ---

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

// An axis step of 1, 2 or 5 times a power of ten that cuts `span` into 3 to 10 ticks.
double tick_step(double span) {
  const double raw = span / 5;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

std::string tick_label(double v, double step) {
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  return fmt::format("{:.{}f}", v, decimals);
}

// The parts of a unit's iteration, bottom to top, with their colours.
struct Part {
  const char* name;   // JSON field stem (unit_<name>_seconds, <name>_seconds)
  const char* label;  // legend
  const char* color;
};
constexpr Part kParts[] = {{"linear", "linear layers", "#4c78a8"},
                           {"attention", "core attention", "#f58518"},
                           {"comm", "exposed communication", "#e45756"},
                           {"idle", "idle (waiting for other units, pipeline bubbles)", "#c8c8c8"}};

std::string legend(int x, int y) {
  std::string svg;
  for (const Part& p : kParts) {
    svg += fmt::format(R"(<rect x="{}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>)" "\n", x,
                       y - 10, p.color, x + 16, y, p.label);
    x += 40 + 7 * static_cast<int>(std::string(p.label).size());
  }
  return svg;
}

// The report drawn: (1) per system, the iteration time as a bar of the mean linear, attention,
// exposed communication and idle seconds per unit, with the speedup over the named baseline;
// (2) per system, one stacked bar per unit of the same four parts, each reaching the iteration
// time, so imbalance shows as idle. All panels share one time scale. Every bar part carries
// data-system / data-unit / data-part / data-seconds attributes (data-unit "mean" in (1)).
std::string plot_svg(const nlohmann::json& j) {
  const auto& systems = j["systems"];
  const int n = static_cast<int>(systems.size());
  const int units = j["units"].get<int>();
  const int W = 1000, left = 110, width = 750;  // plot area: x from left to left + width
  const int bar_row = 28, unit_height = 160, panel = unit_height + 80;
  double longest = 0;
  for (const auto& s : systems) longest = std::max(longest, s["seconds"].get<double>());
  const double step = tick_step(longest);
  const double top = std::ceil(longest / step - 1e-9) * step;  // axis end, seconds
  // The baseline the speedups are over: wlb when it ran, else colocated, else none.
  std::string baseline;
  for (const auto& s : systems) {
    if (s["system"] == "wlb" || (s["system"] == "colocated" && baseline.empty())) baseline = s["system"].get<std::string>();
  }
  const int top_a = 110;
  const int top_b = top_a + n * bar_row + 70;
  const int H = top_b + n * panel + 10;
  std::string svg = fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" viewBox="0 0 {} {}" font-family="sans-serif" font-size="12">)" "\n"
      R"(<rect width="100%" height="100%" fill="white"/>)" "\n",
      W, H, W, H);
  svg += fmt::format(R"(<text x="10" y="22" font-size="15" font-weight="bold">{}</text>)" "\n", xml_escape(config_text(j)));
  svg += fmt::format(R"(<text x="10" y="42">{}; profile {}; a unit is {} GPUs (one tensor-parallel group){}</text>)" "\n",
                     iterations_text(j), xml_escape(j["profile"].get<std::string>()), j["tp"].get<int>(),
                     baseline.empty() ? "" : fmt::format("; speedup over {}: {}'s iteration time / the system's", baseline, baseline));
  svg += legend(10, 66);

  // (1) Iteration time per system.
  const double xscale = 0.8 * width / top;  // px per second (room for the labels right of the bars)
  svg += fmt::format(R"(<text x="10" y="{}" font-weight="bold">Iteration time per system (seconds): mean seconds per unit of each part, adding up to the iteration time</text>)" "\n",
                     top_a - 12);
  for (int i = 0; i < n; ++i) {
    const auto& s = systems[i];
    const std::string name = s["system"].get<std::string>();
    const int y = top_a + i * bar_row;
    svg += fmt::format(R"(<text x="{}" y="{}" text-anchor="end">{}</text>)", left - 6, y + 15, name);
    double x = left;
    for (const Part& p : kParts) {
      const double sec = s[fmt::format("{}_seconds", p.name)].get<double>();
      svg += fmt::format(R"(<rect x="{:.2f}" y="{}" width="{:.2f}" height="20" fill="{}" data-system="{}" data-unit="mean" data-part="{}" data-seconds="{:.9g}"/>)",
                         x, y, sec * xscale, p.color, name, p.name, sec);
      x += sec * xscale;
    }
    const auto& vs = s[fmt::format("speedup_over_{}", baseline.empty() ? "wlb" : baseline)];
    std::string speedup;
    if (name == baseline) {
      speedup = ", the baseline";
    } else if (!vs.is_null()) {
      speedup = fmt::format(", {:.3f}x over {}", vs.get<double>(), baseline);
    }
    svg += fmt::format(R"(<text x="{:.2f}" y="{}">{:.3f} s{}</text>)" "\n", x + 6, y + 15, s["seconds"].get<double>(), speedup);
  }
  const int axis_a = top_a + n * bar_row;
  svg += fmt::format(R"(<line x1="{}" y1="{}" x2="{:.2f}" y2="{}" stroke="black"/>)" "\n", left, axis_a, left + top * xscale, axis_a);
  for (double t = 0; t <= top + step / 2; t += step) {
    const double x = left + t * xscale;
    svg += fmt::format(R"(<line x1="{:.2f}" y1="{}" x2="{:.2f}" y2="{}" stroke="black"/><text x="{:.2f}" y="{}" text-anchor="middle">{}</text>)" "\n",
                       x, axis_a, x, axis_a + 5, x, axis_a + 18, tick_label(t, step));
  }
  svg += fmt::format(R"(<text x="{:.2f}" y="{}" text-anchor="middle">seconds per iteration</text>)" "\n",
                     left + top * xscale / 2, axis_a + 34);

  // (2) Per system, one stacked bar per unit.
  const double yscale = unit_height / top;  // px per second
  const double bar = static_cast<double>(width) / units;
  const int label_every = std::max(1, (units + 15) / 16);
  for (int i = 0; i < n; ++i) {
    const auto& s = systems[i];
    const std::string name = s["system"].get<std::string>();
    const double seconds = s["seconds"].get<double>();
    const int y0 = top_b + i * panel;        // panel title
    const int base = y0 + 16 + unit_height;  // the time axis' zero
    const std::string note = fit_note(s);
    svg += fmt::format(R"(<g data-system="{}" data-seconds="{:.9g}">)" "\n", name, seconds);
    svg += fmt::format(R"(<text x="10" y="{}" font-weight="bold">{} (cp {}) per unit: iteration {:.3f} s; attention max/mean {:.2f}; peak {:.1f} GB per GPU{}</text>)" "\n",
                       y0, name, cp_text(s), seconds, s["attention_imbalance"].get<double>(),
                       s["memory_bytes_per_gpu"].get<double>() / kGB,
                       note.empty() ? "" : fmt::format(R"(; <tspan fill="#c00000">does not fit in {:.1f} GB</tspan>)",
                                                       s["device_memory_bytes"].get<double>() / kGB));
    for (int u = 0; u < units; ++u) {
      double y = base;
      for (const Part& p : kParts) {
        const double sec = s[fmt::format("unit_{}_seconds", p.name)][u].get<double>();
        y -= sec * yscale;
        svg += fmt::format(R"(<rect x="{:.2f}" y="{:.2f}" width="{:.2f}" height="{:.2f}" fill="{}" data-system="{}" data-unit="{}" data-part="{}" data-seconds="{:.9g}"/>)",
                           left + u * bar, y, std::max(bar - 1, 0.5), sec * yscale, p.color, name, u, p.name, sec);
      }
      svg += "\n";
      if (u % label_every == 0) {
        svg += fmt::format(R"(<text x="{:.2f}" y="{}" text-anchor="middle">{}</text>)" "\n", left + (u + 0.5) * bar, base + 16, u);
      }
    }
    // Axes: time (seconds) on the left, units along the bottom, the iteration time dashed.
    svg += fmt::format(R"(<line x1="{}" y1="{}" x2="{}" y2="{:.2f}" stroke="black"/><line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>)" "\n",
                       left, base, left, base - top * yscale, left, base, left + width, base);
    for (double t = 0; t <= top + step / 2; t += step) {
      const double y = base - t * yscale;
      svg += fmt::format(R"(<line x1="{}" y1="{:.2f}" x2="{}" y2="{:.2f}" stroke="black"/><text x="{}" y="{:.2f}" text-anchor="end">{}</text>)" "\n",
                         left - 5, y, left, y, left - 8, y + 4, tick_label(t, step));
    }
    svg += fmt::format(R"(<line x1="{}" y1="{:.2f}" x2="{}" y2="{:.2f}" stroke="black" stroke-dasharray="4 3"/><text x="{}" y="{:.2f}">iteration {:.3f} s</text>)" "\n",
                       left, base - seconds * yscale, left + width, base - seconds * yscale, left + width + 4,
                       base - seconds * yscale + 4, seconds);
    svg += fmt::format(R"svg(<text x="30" y="{}" text-anchor="middle" transform="rotate(-90 30 {})">seconds</text>)svg" "\n",
                       base - unit_height / 2, base - unit_height / 2);
    svg += fmt::format(R"(<text x="{}" y="{}" text-anchor="middle">unit ({} GPUs each; in stage, replica, CP-rank order)</text>)" "\n",
                       left + width / 2, base + 34, j["tp"].get<int>());
    svg += "</g>\n";
  }
  return svg + "</svg>\n";
}

// The paper grid drawn: per configuration, the published range of cad-distca's speedup over
// WLB-ideal as a band, and the simulated speedups of cad-distca and cad over wlb as markers.
std::string paper_svg(const nlohmann::json& records, int iterations, const std::string& profile) {
  const int n = static_cast<int>(records.size());
  const int W = 1000, left = 330, width = 560, row = 18, top_y = 100;
  double lo = 1.0, hi = 1.0;
  for (const auto& r : records) {
    for (const char* f : {"speedup_cad_distca", "speedup_cad", "paper_low", "paper_high"}) {
      lo = std::min(lo, r[f].get<double>()), hi = std::max(hi, r[f].get<double>());
    }
  }
  const double step = tick_step(hi - lo);
  lo = std::floor(lo / step) * step, hi = std::ceil(hi / step) * step;
  auto x_of = [&](double v) { return left + width * (v - lo) / (hi - lo); };
  const int axis = top_y + n * row + 6;
  const int H = axis + 60;
  std::string svg = fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" viewBox="0 0 {} {}" font-family="sans-serif" font-size="12">)" "\n"
      R"(<rect width="100%" height="100%" fill="white"/>)" "\n",
      W, H, W, H);
  svg += fmt::format(R"(<text x="10" y="22" font-size="15" font-weight="bold">distca simulate --paper: speedup over wlb (WLB-ideal) per configuration, mean of {} iteration{}</text>)" "\n",
                     iterations, iterations == 1 ? "" : "s");
  svg += fmt::format(R"(<text x="10" y="42">speedup over wlb: wlb's iteration time / the system's; profile {}</text>)" "\n", xml_escape(profile));
  svg += R"(<rect x="10" y="56" width="24" height="10" fill="#c8c8c8"/><text x="40" y="66">the paper's published range (cad-distca over WLB-ideal)</text>)"
         R"(<circle cx="400" cy="61" r="5" fill="#4c78a8"/><text x="410" y="66">cad-distca (simulated)</text>)"
         R"(<rect x="575" y="56" width="10" height="10" fill="#f58518"/><text x="591" y="66">cad (simulated)</text>)" "\n";
  for (int i = 0; i < n; ++i) {
    const auto& r = records[i];
    const int y = top_y + i * row;
    svg += fmt::format(R"(<text x="{}" y="{}" text-anchor="end">{} {} GPUs pp {} {} {} {}</text>)", left - 8, y + 4,
                       r["model"].get<std::string>(), r["gpus"].get<int>(), r["pp"].get<int>(),
                       facade::context_text(r["context"].get<int64_t>()), r["dataset"].get<std::string>(), r["parallelism"].get<std::string>());
    svg += fmt::format(R"(<rect x="{:.2f}" y="{}" width="{:.2f}" height="10" fill="#c8c8c8"/>)", x_of(r["paper_low"].get<double>()), y - 5,
                       x_of(r["paper_high"].get<double>()) - x_of(r["paper_low"].get<double>()));
    svg += fmt::format(R"(<rect x="{:.2f}" y="{}" width="10" height="10" fill="#f58518" data-record="{}" data-speedup-cad="{:.9g}"/>)",
                       x_of(r["speedup_cad"].get<double>()) - 5, y - 5, i, r["speedup_cad"].get<double>());
    svg += fmt::format(R"(<circle cx="{:.2f}" cy="{}" r="5" fill="#4c78a8" data-record="{}" data-speedup-cad-distca="{:.9g}"/>)",
                       x_of(r["speedup_cad_distca"].get<double>()), y, i, r["speedup_cad_distca"].get<double>());
    if (r["fits_memory"] == false) {
      std::vector<std::string> over;
      for (const auto& [system, bytes] : r["memory_bytes_per_gpu"].items()) {
        if (bytes.get<double>() > r["device_memory_bytes"].get<double>()) over.push_back(system);
      }
      svg += fmt::format(R"(<text x="{}" y="{}" fill="#c00000">{} does not fit</text>)", left + width + 8, y + 4, fmt::join(over, ", "));
    }
    svg += "\n";
  }
  svg += fmt::format(R"(<line x1="{:.2f}" y1="{}" x2="{:.2f}" y2="{}" stroke="black" stroke-dasharray="4 3"/>)" "\n", x_of(1.0),
                     top_y - 10, x_of(1.0), axis);
  svg += fmt::format(R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>)" "\n", left, axis, left + width, axis);
  for (double t = lo; t <= hi + step / 2; t += step) {
    svg += fmt::format(R"(<line x1="{:.2f}" y1="{}" x2="{:.2f}" y2="{}" stroke="black"/><text x="{:.2f}" y="{}" text-anchor="middle">{}x</text>)" "\n",
                       x_of(t), axis, x_of(t), axis + 5, x_of(t), axis + 18, tick_label(t, step));
  }
  svg += fmt::format(R"(<text x="{}" y="{}" text-anchor="middle">speedup over wlb (1.0x: as fast as wlb)</text>)" "\n",
                     left + width / 2, axis + 36);
  return svg + "</svg>\n";
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

int run_paper(const SimArgs& a, int iterations, const sim::Profile& profile) {
  nlohmann::json records = nlohmann::json::array();
  const auto begin = std::chrono::steady_clock::now();
  if (!a.is_json) {
    fmt::print("speedup over wlb (WLB-ideal): wlb's iteration time / the system's, mean of {} iteration{} per configuration; "
               "cad and cad-minmax return dK/dV in {}\n",
               iterations, iterations == 1 ? "" : "s", a.request.grad_return);
    fmt::print("{:<10} {:>5} {:>3} {:>7} {:<9} {:<3} {:>11} {:>8} {:>13} {:>18}  {}\n", "model", "gpus", "pp", "context", "dataset",
               "par", "cad-distca", "cad", "cad-minmax", "paper (cad-distca)", "");
  }
  int over_memory = 0;
  Progress progress("distca simulate --paper");  // lines on stderr once the run lasts (core/progress.h)
  const std::vector<PaperCase> cases = paper_cases();
  for (const PaperCase& pc : cases) {
    progress.set_context(fmt::format("configuration {} of {} ({}, {} GPUs, pp {}, {} tokens, {})",
                                     &pc - cases.data() + 1, cases.size(), pc.model, pc.gpus, pc.pp, pc.context,
                                     pc.dataset));
    sim::SimOptions o;
    o.model = plan::model_preset(pc.model).value();
    o.model.grad_return = plan::parse_grad_return(a.request.grad_return).value();  // checked by check_args
    o.cluster.gpus = pc.gpus;
    o.cluster.pp = pc.pp;
    o.cluster.cp = pc.gpus / 8 / pc.pp / pc.sequences;
    o.context = pc.context;
    o.batch = pc.micro_batches;
    o.sampling = paper_sampling(pc.dataset);
    o.workload = pc.dataset;
    o.seed = static_cast<uint64_t>(a.request.seed);
    o.tolerance = a.request.tolerance;
    o.tolerance_sweep = a.tolerance_sweep == "on";
    // Mean iteration times over several sampled iterations (one iteration's documents are a
    // small sample of the workload).
    o.iterations = iterations;
    const std::vector<std::string> systems = {"wlb", "cad-distca", "cad", "colocated", "cad-minmax"};
    auto rs = sim::simulate(profile, o, systems, &progress);
    if (!rs.is_ok()) {
      fmt::print(stderr, "distca simulate --paper: error: {}\n", rs.status().message());
      return 1;
    }
    const auto& r = rs.value();
    const double s_distca = r[0].seconds / r[1].seconds, s_cad = r[0].seconds / r[2].seconds;
    const double s_minmax = r[0].seconds / r[4].seconds;
    const bool inside = s_distca >= pc.low - 0.05 && s_distca <= pc.high + 0.05;
    std::vector<std::string> over;  // systems that do not fit in device memory, with their GB per GPU
    nlohmann::json memory = nlohmann::json::object();
    for (size_t k = 0; k < systems.size(); ++k) {
      memory[systems[k]] = r[k].memory_per_gpu;
      if (!r[k].fits_memory()) over.push_back(fmt::format("{} {:.1f} GB", systems[k], r[k].memory_per_gpu / kGB));
    }
    over_memory += over.empty() ? 0 : 1;
    records.push_back({{"model", pc.model}, {"gpus", pc.gpus}, {"pp", pc.pp}, {"context", pc.context},
                       {"dataset", pc.dataset}, {"parallelism", pc.parallelism}, {"iterations", iterations},
                       {"grad_return", a.request.grad_return},
                       {"speedup_over", "wlb"}, {"speedup_cad_distca", s_distca}, {"speedup_cad", s_cad},
                       {"speedup_cad_minmax", s_minmax},
                       {"speedup_cad_distca_over_colocated", r[3].seconds / r[1].seconds},
                       {"paper_low", pc.low}, {"paper_high", pc.high}, {"within_0.05", inside},
                       {"memory_bytes_per_gpu", memory},
                       {"device_memory_bytes", profile.device_memory_bytes > 0 ? nlohmann::json(profile.device_memory_bytes) : nlohmann::json(nullptr)},
                       {"fits_memory", profile.device_memory_bytes > 0 ? nlohmann::json(over.empty()) : nlohmann::json(nullptr)}});
    if (!a.is_json) {
      std::string note = inside ? "" : "outside";
      if (!over.empty()) {
        note += fmt::format("{}does not fit: {} per GPU > {:.1f} GB", note.empty() ? "" : "; ", fmt::join(over, ", "),
                            profile.device_memory_bytes / kGB);
      }
      fmt::print("{:<10} {:>5} {:>3} {:>6}K {:<9} {:<3} {:>10.3f}x {:>7.3f}x {:>12.3f}x {:>11.2f}-{:.2f}x  {}\n", pc.model,
                 pc.gpus, pc.pp, pc.context >> 10, pc.dataset, pc.parallelism, s_distca, s_cad, s_minmax, pc.low, pc.high,
                 note);
      std::fflush(stdout);
    }
  }
  if (!a.plot.empty()) {
    if (Status st = write_file_atomic(a.plot, paper_svg(records, iterations, profile.name)); !st.is_ok()) {
      fmt::print(stderr, "distca simulate --paper: error: {}\n", st.message());
      return 1;
    }
  }
  if (over_memory > 0) {
    fmt::print(stderr, "distca simulate --paper: warning: {} of {} configurations do not fit in {:.1f} GB per GPU\n",
               over_memory, records.size(), profile.device_memory_bytes / kGB);
  }
  if (!a.json_out.empty()) {
    if (Status st = write_file_atomic(a.json_out, records.dump(2) + "\n"); !st.is_ok()) {
      fmt::print(stderr, "distca simulate --paper: error: {}\n", st.message());
      return 1;
    }
  }
  if (a.is_json) {
    fmt::print("{}\n", records.dump(2));
  } else {
    int inside = 0, at_least = 0;
    double worst = 0;
    for (const auto& r : records) {
      inside += r["within_0.05"].get<bool>() ? 1 : 0;
      const double ratio = r["speedup_cad"].get<double>() / r["speedup_cad_distca"].get<double>();
      at_least += ratio >= 1 ? 1 : 0;
      worst = worst == 0 ? ratio : std::min(worst, ratio);
    }
    fmt::print("cad ({}) at least as fast as cad-distca in {} of {} configurations; the least cad / cad-distca {:.4f}\n",
               plan::kDefaultPlanner, at_least, records.size(), worst);
    fmt::print("{} of {} configurations within 0.05 of the published range; profile {}; {:.1f} s\n", inside, records.size(),
               profile.name, std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  return 0;
}

// Everything about the command line that can be wrong, checked before any work: a failure
// here is bad input (exit 2).
Status check_args(const SimArgs& a, int iterations) {
  if (a.is_paper) {
    std::vector<std::string> fixed;
    for (const CLI::Option* opt : a.one_config_options) {
      if (opt->count() > 0) fixed.push_back(opt->get_name());
    }
    if (!fixed.empty()) {
      return invalid_argument(fmt::format("--paper runs the paper's own configurations, which set {} themselves: drop {} "
                                          "(or drop --paper to simulate one configuration)",
                                          fmt::join(fixed, ", "), fixed.size() == 1 ? "it" : "them"));
    }
  }
  facade::SimRequest request = a.request;
  request.iterations = iterations;
  DISTCA_RETURN_IF_ERROR(request.validate());
  if (a.json_out_option->count() > 0) DISTCA_RETURN_IF_ERROR(check_output_path("--json-out", a.json_out));  // refuses ""
  return check_output_paths({{"--plot", a.plot}, {"--json-out", a.json_out}}, {{"--profile", a.profile}});
}

int run_simulate(const SimArgs& a) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "distca simulate: error: {}\n", s.message());
    return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
  };
  const int iterations = a.iterations.value_or(a.is_paper ? 15 : 1);
  if (Status st = check_args(a, iterations); !st.is_ok()) return fail(st);
  sim::SimOptions o;
  facade::SimRequest request = a.request;
  request.iterations = iterations;
  request.tolerance_sweep = a.tolerance_sweep == "on";
  if (!a.is_paper) {
    auto options = request.options();
    if (!options.is_ok()) return fail(options.status());
    o = options.value();
  }
  sim::Profile profile = sim::default_h200_profile();
  if (!a.profile.empty()) {
    auto loaded = sim::load_profile(a.profile);
    if (!loaded.is_ok()) return fail(loaded.status());
    profile = loaded.value();
  }
  if (a.is_paper) return run_paper(a, iterations, profile);
  std::optional<Result<std::vector<sim::SystemResult>>> rs;
  {
    Progress progress("distca simulate");  // lines on stderr once the run lasts (core/progress.h)
    rs = sim::simulate(profile, o, request.systems(), &progress);
  }
  if (!rs->is_ok()) {  // the options were checked: what fails here is the run
    fmt::print(stderr, "distca simulate: error: {}\n", rs->status().message());
    return 1;
  }
  const nlohmann::json j = facade::simulation_report(o, profile, rs->value());
  if (!a.plot.empty()) {
    if (Status st = write_file_atomic(a.plot, plot_svg(j)); !st.is_ok()) {
      fmt::print(stderr, "distca simulate: error: {}\n", st.message());
      return 1;
    }
  }
  if (!a.json_out.empty()) {
    if (Status st = write_file_atomic(a.json_out, j.dump(2) + "\n"); !st.is_ok()) {
      fmt::print(stderr, "distca simulate: error: {}\n", st.message());
      return 1;
    }
  }
  warn_memory(j);
  if (a.is_json) {
    fmt::print("{}\n", j.dump(2));
  } else {
    print_table(j);
  }
  return 0;
}

}  // namespace

std::function<int()> add_simulate_command(CLI::App& app) {
  auto args = std::make_shared<SimArgs>();
  SimArgs& a = *args;
  CLI::App* cmd = app.add_subcommand("simulate", "Price one training iteration of colocated, WLB-style and CAD training on a "
                                                 "simulated cluster (profiles: the default H200 one, or --profile)");
  auto& one = a.one_config_options;
  one.push_back(cmd->add_option("--model", a.request.model, "llama-8b | llama-34b")->capture_default_str());
  one.push_back(cmd->add_option("--gpus", a.request.gpus, "GPUs in all")->capture_default_str());
  one.push_back(cmd->add_option("--gpus-per-node", a.request.gpus_per_node, "GPUs per node")->capture_default_str());
  one.push_back(cmd->add_option("--tp", a.request.tp, "tensor-parallel degree (one unit = tp GPUs)")->capture_default_str());
  one.push_back(cmd->add_option("--pp", a.request.pp, "pipeline stages")->capture_default_str());
  one.push_back(cmd->add_option("--cp", a.request.cp, "context-parallel units per sequence (0: context / 64K, as the GPUs allow)")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--wlb-cp", a.request.wlb_cp, "wlb's context-parallel degree (0: WLB-ideal, the faster of the two largest it may use)")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--context", a.request.context, "tokens per sequence (one micro-batch of a replica, over cp units), e.g. 128K, 512K")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--batch", a.request.batch, "micro-batches per data-parallel replica per iteration")->capture_default_str());
  one.push_back(cmd->add_option("--workload", a.request.workload, "document lengths: pretrain | prolong")->capture_default_str());
  one.push_back(cmd->add_option("--keep-short", a.request.sampling.keep_short, "sampling: share of documents of at most 64K tokens kept")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--upsample", a.request.sampling.upsample, "sampling: how many times more often longer documents are drawn")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--elongation", a.request.sampling.elongation, "sampling: length multiplier (0: context / 64K)")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--full-context-share", a.request.sampling.full_context_share,
                                "sampling: share of longer documents made exactly one sequence long")
                    ->capture_default_str());
  one.push_back(cmd->add_option("--system", a.request.system, "colocated | wlb | cad-distca | cad (the default planner) | cad-minmax | all")->capture_default_str());
  cmd->add_option("--profile", a.profile, "a profile JSON (distca-profile, version 1); default: the built-in H200 one");
  cmd->add_option("--tolerance", a.request.tolerance,
                  "the CAD planners' balance bound eps (the busiest server's attention <= (1 + eps) x the mean)")
      ->capture_default_str();
  cmd->add_option("--tolerance-sweep", a.tolerance_sweep,
                  "on: each CAD system runs every iteration at the fastest of eps, eps/2, ..., eps/512 (tighter "
                  "balance where the link hides its bytes); off: at eps")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  cmd->add_option("--grad-return", a.request.grad_return,
                  "bf16 | fp32: the dtype cad and cad-minmax return dK/dV partial sums in, summed in fp32 at the "
                  "owner (cad-distca, the paper's system, always returns them in the activation dtype, bf16)")
      ->capture_default_str();
  cmd->add_option("--seed", a.request.seed, "sampling seed of the first iteration (iteration i uses seed + i)")->capture_default_str();
  cmd->add_flag("--json", a.is_json, "print JSON instead of the table");
  a.json_out_option =
      cmd->add_option("--json-out", a.json_out, "also write the JSON report to this file (the table still prints)");
  cmd->add_option("--plot", a.plot,
                  "also draw an SVG into this file: per system, the iteration time and each unit's linear / attention / "
                  "communication / idle seconds (with --paper: each configuration's speedups beside the published range)");
  cmd->add_option("--iterations", a.iterations,
                  "sampled iterations averaged, 1..1000 (default 1, or 15 with --paper as the paper's runs)");
  cmd->add_flag("--paper", a.is_paper,
                "run the paper's 3D and 4D configurations and compare with its published speedups (sets the model, "
                "cluster, context, batch, workload, sampling and systems itself)");
  return [args] { return run_simulate(*args); };
}

}  // namespace distca::tools
