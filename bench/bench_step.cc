#include "distca/bench/bench_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <vector>

#include "distca/model/config.h"
#include "distca/train/data_parallel.h"
#include "distca/core/memory.h"
#include "distca/bench/spread.h"

namespace distca::bench {

namespace {

enum Variant { kSequential, kPingPong, kZeroCost, kWhole, kVariants };
constexpr const char* kNames[kVariants] = {"sequential", "pingpong", "zero_cost", "whole"};

nlohmann::json to_json(const Spread& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

train::TrainOptions train_options(const StepBenchOptions& o, const model::Preset& p) {
  train::TrainOptions t;
  t.model = p.model;
  if (o.layers > 0) t.model.num_layers = o.layers;
  t.optim = p.optim;
  t.context = o.context > 0 ? o.context : p.context;
  t.workload = o.workload.empty() ? p.workload : o.workload;
  t.steps = o.steps + 2;
  t.backends = {"cad"};
  t.threads = o.threads;
  t.backward_mode = o.backward_mode == "stateless" ? plan::BackwardMode::kStateless : plan::BackwardMode::kStateful;
  t.progress = o.progress;
  t.grad_sync = o.grad_sync;
  t.progress_interval_us = o.progress_interval_us;
  return t;
}

}  // namespace

Status validate(const StepBenchOptions& o) {
  DISTCA_RETURN_IF_ERROR(model::find_preset(o.preset).status());
  if (o.ranks < 1 || o.ranks > 64) return invalid_argument(fmt::format("--ranks must be 1..64, got {}", o.ranks));
  if (o.steps < 1 || o.steps > 1000) return invalid_argument(fmt::format("--steps must be 1..1000, got {}", o.steps));
  if (o.link != "auto" && o.link != "off") return invalid_argument(fmt::format("--link must be auto or off, got '{}'", o.link));
  if (!(o.ratio > 0) || o.ratio > 100) return invalid_argument(fmt::format("--ratio must be in (0, 100], got {}", o.ratio));
  if (!(o.latency_us >= 0) || o.latency_us > 1e6) {
    return invalid_argument(fmt::format("--latency-us must be 0..1e6, got {}", o.latency_us));
  }
  if (o.backward_mode != "stateful" && o.backward_mode != "stateless") {
    return invalid_argument(fmt::format("--backward must be stateful or stateless, got '{}'", o.backward_mode));
  }
  if (o.context < 0 || o.layers < 0) return invalid_argument("--context and --layers must be >= 0 (0: the preset's)");
  train::TrainOptions t = train_options(o, model::find_preset(o.preset).value());
  t.pingpong = "on";
  return t.validate(world_size(o.ranks));
}

Status check_step_memory(const StepBenchOptions& o) {
  const train::TrainOptions t = train_options(o, model::find_preset(o.preset).value());
  const int variants = o.link == "auto" ? kVariants : kVariants - 1;  // --link off: no zero-cost trainer
  const int here = ranks_on_this_machine(o.ranks);
  const train::MemoryEstimate m = train::estimate_memory(t, world_size(o.ranks));
  const int64_t needed = m.total() * variants * here;
  return check_memory(
      "bench step", needed,
      fmt::format("{} rank{} x {} trainers (one per variant) x {}: model states {}, activations {}, attention buffers "
                  "{}, step data {}, at {} tokens per rank and {} layers",
                  here, here == 1 ? "" : "s", variants, memory_text(m.total()), memory_text(m.states_bytes),
                  memory_text(m.activations_bytes), memory_text(m.attention_bytes), memory_text(m.data_bytes), t.context,
                  t.model.num_layers),
      kBenchMemoryShare, "lower --context or --layers, or run fewer ranks per machine");
}

Result<nlohmann::json> run_step_bench(comm::Communicator& comm, const StepBenchOptions& o,
                                      const std::function<void(const std::string&)>& progress) {
  DISTCA_RETURN_IF_ERROR(validate(o));
  if (comm.size() < 2) {
    return invalid_argument("bench step needs 2 or more ranks: with one, nothing crosses a link and ping-pong hides nothing");
  }
  const bool is_root = comm.rank() == 0;
  auto say = [&](const std::string& line) {
    if (is_root) progress(line);
  };
  const model::Preset preset = model::find_preset(o.preset).value();
  const bool emulated = o.link == "auto";
  std::array<std::unique_ptr<train::DataParallelTrainer>, kVariants> trainers;
  for (int v = 0; v < kVariants; ++v) {
    if (v == kZeroCost && !emulated) continue;
    train::TrainOptions t = train_options(o, preset);
    t.pingpong = v == kSequential ? "sequential" : v == kWhole ? "off" : "on";
    if (emulated) t.attention_link = comm::LinkOptions{};  // unlimited (counting) until calibrated
    DISTCA_ASSIGN_OR_RETURN(trainers[v], train::DataParallelTrainer::create(comm, t));
  }
  // Every other step in the reverse order, so that neither drift nor a variant's place after
  // another (caches, the allocator) favours one.
  int round = 0;
  auto step_all = [&](std::array<train::StepRecord, kVariants>& out) -> Status {
    const bool reverse = round++ % 2 == 1;
    for (int k = 0; k < kVariants; ++k) {
      const int v = reverse ? kVariants - 1 - k : k;
      if (!trainers[v]) continue;
      DISTCA_RETURN_IF_ERROR(comm.barrier());
      DISTCA_ASSIGN_OR_RETURN(std::vector<train::StepRecord> r, trainers[v]->step());
      out[v] = r.at(0);
    }
    return Status::ok();
  };
  std::array<train::StepRecord, kVariants> warm{}, cal{};
  say("warm-up step (every variant)");
  DISTCA_RETURN_IF_ERROR(step_all(warm));
  // Calibration: the sequential variant's link counts this step's bytes; its straggler's linear
  // seconds set the bandwidth at which the step's communication takes ratio x that.
  nlohmann::json calibration = nullptr;
  if (emulated) trainers[kSequential]->attention_link()->reset_counters();
  say("calibration step");
  DISTCA_RETURN_IF_ERROR(step_all(cal));
  if (emulated) {
    const comm::LinkCounters& c = trainers[kSequential]->attention_link()->counters();
    std::vector<float> slots(static_cast<size_t>(2 * comm.size()), 0.0f);
    slots[2 * comm.rank()] = static_cast<float>(c.wire_bytes);
    slots[2 * comm.rank() + 1] = static_cast<float>(c.operations);
    DISTCA_RETURN_IF_ERROR(comm.all_reduce_sum(slots.data(), static_cast<int64_t>(slots.size())));
    double wire = 0, ops = 0;
    for (int r = 0; r < comm.size(); ++r) {
      if (slots[2 * r] > wire) wire = slots[2 * r], ops = slots[2 * r + 1];
    }
    const double linear = cal[kSequential].straggler().linear;
    const double latency = o.latency_us * 1e-6;
    const double budget = o.ratio * linear - ops * latency;
    if (!(budget > 0) || !(wire > 0)) {
      return invalid_argument(fmt::format("the link cannot be calibrated: {} operations of {} us latency take {:.3f} s, "
                                          "more than {} x the step's linear {:.3f} s (lower --latency-us)",
                                          ops, o.latency_us, ops * latency, o.ratio, linear));
    }
    comm::LinkOptions link{latency, wire / budget};
    for (int v : {kSequential, kPingPong, kWhole}) trainers[v]->attention_link()->set_options(link);
    calibration = {{"linear_seconds", linear},    {"wire_bytes", wire},        {"operations", ops},
                   {"latency_us", o.latency_us},  {"bytes_per_second", link.bytes_per_second},
                   {"ratio", o.ratio}};
    say(fmt::format("link: {:.1f} MB/s, {} us per operation ({:.0f} MB and {:.0f} operations per step on the busiest "
                    "rank = {} x the step's linear {:.3f} s)",
                    link.bytes_per_second / 1e6, o.latency_us, wire / 1e6, ops, o.ratio, linear));
  }
  std::array<std::vector<double>, kVariants> seconds;
  std::vector<double> hidden, comm_seq, linear_seq, bytes_seq, bytes_whole;
  std::array<std::vector<double>, kVariants> reduce;
  nlohmann::json steps = nlohmann::json::array();
  for (int s = 0; s < o.steps; ++s) {
    std::array<train::StepRecord, kVariants> r{};
    DISTCA_RETURN_IF_ERROR(step_all(r));
    // The same nano-batches and plans: the same loss, bit for bit.
    for (int v : {kPingPong, kZeroCost}) {
      if (trainers[v] && r[v].loss != r[kSequential].loss) {
        return internal_error(fmt::format("step {}: {} loss {} differs from sequential's {}", r[v].step, kNames[v],
                                          r[v].loss, r[kSequential].loss));
      }
    }
    nlohmann::json j = {{"step", r[kSequential].step}, {"nano_batches", r[kPingPong].split_micro_batches > 0 ? 2 : 1}};
    for (int v = 0; v < kVariants; ++v) {
      if (!trainers[v]) continue;
      seconds[v].push_back(r[v].step_seconds);
      reduce[v].push_back(r[v].straggler().grad_reduce);
      j[std::string(kNames[v]) + "_seconds"] = r[v].step_seconds;
    }
    comm_seq.push_back(r[kSequential].straggler().comm);
    linear_seq.push_back(r[kSequential].straggler().linear);
    bytes_seq.push_back(static_cast<double>(r[kSequential].attention_bytes));
    bytes_whole.push_back(static_cast<double>(r[kWhole].attention_bytes));
    j["sequential_comm_seconds"] = r[kSequential].straggler().comm;
    j["sequential_linear_seconds"] = r[kSequential].straggler().linear;
    std::string line = fmt::format("step {}/{}: sequential {:.3f} s, ping-pong {:.3f} s", s + 1, o.steps,
                                   r[kSequential].step_seconds, r[kPingPong].step_seconds);
    if (emulated) {
      const std::optional<double> h =
          hidden_fraction(r[kSequential].step_seconds, r[kPingPong].step_seconds, r[kZeroCost].step_seconds);
      if (h) hidden.push_back(*h);
      j["hidden_fraction"] = h ? nlohmann::json(*h) : nlohmann::json(nullptr);
      line += h ? fmt::format(", zero-cost {:.3f} s: {:.0f}% hidden", r[kZeroCost].step_seconds, 100 * *h)
                : fmt::format(", zero-cost {:.3f} s: hidden share not measurable (no faster than sequential)",
                              r[kZeroCost].step_seconds);
    }
    line += fmt::format("; whole {:.3f} s", r[kWhole].step_seconds);
    say(line);
    steps.push_back(j);
  }
  nlohmann::json report = {{"benchmark", "step"},
                           {"ranks", comm.size()},
                           {"communicator", comm.name()},
                           {"preset", o.preset},
                           {"model", model::to_json(train_options(o, preset).model)},
                           {"context", train_options(o, preset).context},
                           {"threads", o.threads},
                           {"backward_mode", o.backward_mode},
                           {"progress", o.progress},
                           {"grad_sync", o.grad_sync},
                           {"progress_interval_us", o.progress_interval_us},
                           {"link", o.link},
                           {"calibration", calibration},
                           {"steps", steps}};
  for (int v = 0; v < kVariants; ++v) {
    if (!trainers[v]) continue;
    report[std::string(kNames[v]) + "_seconds"] = to_json(spread_of(seconds[v]));
    // Of each step: the data-parallel gradient all-reduce, which no attention schedule hides.
    report[std::string(kNames[v]) + "_grad_reduce_seconds"] = to_json(spread_of(reduce[v]));
  }
  report["sequential_comm_seconds"] = to_json(spread_of(comm_seq));
  report["sequential_linear_seconds"] = to_json(spread_of(linear_seq));
  // Bytes the attention exchanges sent per step, all ranks together (the same every step).
  report["sequential_attention_bytes"] = to_json(spread_of(bytes_seq));
  // The whole step's one plan: ping-pong splits it, so the two nano-batches move as much.
  report["whole_attention_bytes"] = to_json(spread_of(bytes_whole));
  double ratio_max = 0;
  for (size_t i = 0; i < bytes_seq.size(); ++i) ratio_max = std::max(ratio_max, bytes_whole[i] > 0 ? bytes_seq[i] / bytes_whole[i] : 0.0);
  report["pingpong_over_whole_bytes_max"] = ratio_max;
  const double seq = spread_of(seconds[kSequential]).median, pp = spread_of(seconds[kPingPong]).median;
  const double whole = spread_of(seconds[kWhole]).median;
  report["pingpong_over_whole"] = whole > 0 ? pp / whole : 0.0;
  report["pingpong_over_sequential"] = seq > 0 ? pp / seq : 0.0;
  if (emulated) {
    const double zero = spread_of(seconds[kZeroCost]).median;
    const std::optional<double> h = hidden_fraction(seq, pp, zero);  // of the medians
    report["hidden_fraction"] = h ? nlohmann::json(*h) : nlohmann::json(nullptr);
    // Above 1 (ping-pong faster than free communication) or below 0 is noise, never clamped; with
    // no exposed communication at all (zero-cost no faster than sequential) there is no share.
    report["hidden_fraction_is_measurement_error"] = !h || *h < 0 || *h > 1;
    report["hidden_fraction_per_step"] = hidden.empty() ? nlohmann::json(nullptr) : to_json(spread_of(hidden));
    report["hidden_fraction_measured_steps"] = hidden.size();
    report["zero_cost_over_sequential"] = seq > 0 ? zero / seq : 0.0;
  } else {
    report["hidden_fraction"] = nullptr;
    report["hidden_fraction_is_measurement_error"] = nullptr;
    report["hidden_fraction_per_step"] = nullptr;
  }
  return report;
}

std::optional<double> hidden_fraction(double sequential, double pingpong, double zero_cost) {
  const double exposed = sequential - zero_cost;
  if (!(exposed > 0)) return std::nullopt;
  return (sequential - pingpong) / exposed;
}

void print_step_report(const nlohmann::json& j) {
  fmt::print("distca bench step: {} ranks over {}, preset {} ({} tokens per rank), {} backward, progress {}, gradient sync {}, {} "
             "measured steps\n",
             j["ranks"].get<int>(), j["communicator"].get<std::string>(), j["preset"].get<std::string>(),
             j["context"].get<int64_t>(), j["backward_mode"].get<std::string>(), j["progress"].get<std::string>(),
             j["grad_sync"].get<std::string>(),
             j["steps"].size());
  if (!j["calibration"].is_null()) {
    const auto& c = j["calibration"];
    fmt::print("emulated link for the attention exchange: {:.1f} MB/s and {} us per operation, set so that a step's "
               "communication = {} x its linear compute ({:.3f} s on the calibration step)\n",
               c["bytes_per_second"].get<double>() / 1e6, c["latency_us"].get<double>(), c["ratio"].get<double>(),
               c["linear_seconds"].get<double>());
  } else {
    fmt::print("no emulated link: the attention exchange runs over the communicator itself\n");
  }
  auto cell = [&](const char* key) {
    if (!j.contains(key)) return std::string("-");
    const auto& s = j[key];
    return fmt::format("{:.3f} ({:.3f}..{:.3f})", s["median"].get<double>(), s["min"].get<double>(), s["max"].get<double>());
  };
  fmt::print("\n{:<34} {}\n", "step (s), median (min..max)", "");
  fmt::print("  {:<32} {}\n", "sequential nano-batches", cell("sequential_seconds"));
  fmt::print("  {:<32} {}\n", "ping-pong", cell("pingpong_seconds"));
  if (j.contains("zero_cost_seconds")) fmt::print("  {:<32} {}\n", "ping-pong, zero-cost link", cell("zero_cost_seconds"));
  fmt::print("  {:<32} {}\n", "whole step (ping-pong off)", cell("whole_seconds"));
  fmt::print("  {:<32} {}\n", "sequential: communication", cell("sequential_comm_seconds"));
  fmt::print("  {:<32} {}\n", "sequential: linear compute", cell("sequential_linear_seconds"));
  fmt::print("\n");
  if (j["calibration"].is_null()) {
    // No emulated link: no zero-cost variant, no hidden share.
  } else if (j["hidden_fraction"].is_null()) {
    fmt::print("communication hidden by ping-pong: not measurable: the zero-cost link's step ({:.3f} x sequential) was "
               "no faster than the sequential one, so there was no exposed communication to hide; run more --steps\n",
               j["zero_cost_over_sequential"].get<double>());
  } else {
    const auto& h = j["hidden_fraction_per_step"];
    const std::string per_step =
        h.is_null() ? std::string("no single step measurable")
                    : fmt::format("per step {:.0f}%..{:.0f}% ({} of {} steps measurable)", 100 * h["min"].get<double>(),
                                  100 * h["max"].get<double>(), j["hidden_fraction_measured_steps"].get<int64_t>(),
                                  j["steps"].size());
    fmt::print("communication hidden by ping-pong: {:.0f}% of the medians ((sequential - ping-pong) / (sequential - "
               "zero-cost)); {}\n",
               100 * j["hidden_fraction"].get<double>(), per_step);
    if (j["hidden_fraction_is_measurement_error"].get<bool>()) {
      fmt::print("  (outside 0..100%: the steps' own noise is larger than the difference; run more --steps)\n");
    }
  }
  fmt::print("ping-pong / whole step: {:.3f}; ping-pong / sequential: {:.3f} (same run, same batches)\n",
             j["pingpong_over_whole"].get<double>(), j["pingpong_over_sequential"].get<double>());
  fmt::print("attention bytes per step: nano-batches {:.4g} MB, whole step {:.4g} MB (at most {:.3f}x, one plan split)\n",
             j["sequential_attention_bytes"]["median"].get<double>() / 1e6,
             j["whole_attention_bytes"]["median"].get<double>() / 1e6, j["pingpong_over_whole_bytes_max"].get<double>());
}

}  // namespace distca::bench
