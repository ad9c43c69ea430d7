#include "cmd_profile.h"

#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "distca/core/file.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/train/dispatch_attention.h"
#include "distca/train/trainer.h"
#include "distca/sim/simulate.h"
#include "profile_cpu.h"
#include "world.h"

namespace distca::tools {

namespace {

struct ProfileArgs {
  std::string preset = "demo";
  std::optional<int64_t> context;
  int threads = 1;
  int repeats = 3;
  int ranks = 2;
  std::string out;
  double timeout_seconds = kDefaultTimeoutSeconds;
};

Result<CpuProfileOptions> resolve(const std::string& preset_name, std::optional<int64_t> context, int threads, int repeats) {
  DISTCA_ASSIGN_OR_RETURN(model::Preset preset, model::find_preset(preset_name));
  CpuProfileOptions o;
  o.model = preset.model;
  o.max_tokens = context.value_or(preset.context);
  o.threads = threads;
  o.repeats = repeats;
  if (o.max_tokens < 256 || o.max_tokens > (int64_t{1} << 20)) {
    return invalid_argument(fmt::format("--context must be 256..1048576 tokens, got {}", o.max_tokens));
  }
  if (threads < 1 || threads > 1024) return invalid_argument(fmt::format("--threads must be 1..1024, got {}", threads));
  if (repeats < 1 || repeats > 100) return invalid_argument(fmt::format("--repeats must be 1..100, got {}", repeats));
  return o;
}

auto progress_to_stderr(const char* what) {
  return [what](const std::string& line) { fmt::print(stderr, "[{}] {}\n", what, line); };
}

int run_profile(const ProfileArgs& a, const CLI::App& cmd) {
  auto options = resolve(a.preset, a.context, a.threads, a.repeats);
  Result<std::chrono::milliseconds> timeout = timeout_from_seconds(a.timeout_seconds);
  Status s = options.status();
  if (s.is_ok()) s = timeout.status();
  if (s.is_ok()) s = check_output_paths({{"--out", a.out}});  // before any work: a bad path fails now, not after
  if (!s.is_ok()) {
    print_usage_error("profile", s.message());
    return kExitBadInput;
  }
  WorldOptions world;
  world.is_ranks_given = cmd.count("--ranks") > 0;
  world.timeout = timeout.value();
  return run_world("profile", a.ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(sim::Profile p, measure_cpu_profile(c, options.value(), progress_to_stderr("profile")));
    if (c.rank() != 0) return Status::ok();
    const std::string text = sim::to_json(p).dump(2) + "\n";
    if (a.out.empty()) {
      fmt::print("{}", text);
    } else {
      DISTCA_RETURN_IF_ERROR(write_file_atomic(a.out, text));
      fmt::print(stderr, "wrote {}\n", a.out);
    }
    return Status::ok();
  }, world);
}

struct CalibrationArgs {
  std::string preset = "demo";
  int pp = 1;
  int micro_batches = 0;
  int64_t steps = 6;
  int64_t skip = 1;
  int ranks = 2;
  bool is_json = false;
  std::string json_out;  // --json-out ("" when not given)
  double timeout_seconds = kDefaultTimeoutSeconds;
};

// The calibration report of both backends' (schedules') mean predicted and measured step times:
// one JSON object (`extra` fields added) or a table headed `head`; with --json-out the JSON also
// to that file.
Status print_calibration(const CalibrationArgs& a, const comm::Communicator& c, const sim::Profile& profile,
                       const double predicted[2], const double measured[2], const nlohmann::json& steps,
                       const nlohmann::json& extra, const std::string& head, const std::string& column) {
  const double n = static_cast<double>(a.steps - a.skip);
  nlohmann::json out = {{"format", "distca-bench-calibration"},
                        {"preset", a.preset},
                        {"ranks", c.size()},
                        {"comm", c.name()},
                        {"timed_steps", a.steps - a.skip},
                        {"predicted_colocated", predicted[0] / n},
                        {"measured_colocated", measured[0] / n},
                        {"predicted_cad", predicted[1] / n},
                        {"measured_cad", measured[1] / n},
                        {"error_colocated", predicted[0] / measured[0] - 1},
                        {"error_cad", predicted[1] / measured[1] - 1},
                        {"predicted_speedup", predicted[0] / predicted[1]},
                        {"measured_speedup", measured[0] / measured[1]},
                        {"steps", steps},
                        {"profile", sim::to_json(profile)}};
  out.update(extra);
  if (!a.json_out.empty()) DISTCA_RETURN_IF_ERROR(write_file_atomic(a.json_out, out.dump(2) + "\n"));
  if (a.is_json) {
    fmt::print("{}\n", out.dump(2));
    return Status::ok();
  }
  if (!head.empty()) fmt::print("{}\n", head);
  fmt::print("{:<10} {:>12} {:>12} {:>8}\n", column, "measured (s)", "predicted", "error");
  const char* names[2] = {"colocated", "cad"};
  for (int i = 0; i < 2; ++i) {
    fmt::print("{:<10} {:>12.3f} {:>12.3f} {:>+7.1f}%\n", names[i], measured[i] / n, predicted[i] / n,
               100 * (predicted[i] / measured[i] - 1));
  }
  fmt::print("speedup: measured {:.2f}x, predicted {:.2f}x\n", measured[0] / measured[1], predicted[0] / predicted[1]);
  return Status::ok();
}

int run_calibration(const CalibrationArgs& a, const CLI::App& cmd) {
  auto options = resolve(a.preset, std::nullopt, 1, 3);
  Result<std::chrono::milliseconds> timeout = timeout_from_seconds(a.timeout_seconds);
  Status s = options.status();
  if (s.is_ok() && (a.steps < 2 || a.skip < 0 || a.skip >= a.steps)) {
    s = invalid_argument(fmt::format("--steps must be >= 2 and --skip in 0..steps-1, got {} and {}", a.steps, a.skip));
  }
  if (s.is_ok() && (a.pp < 1 || a.micro_batches < 0 || (a.pp == 1 && a.micro_batches > 0))) {
    s = invalid_argument(fmt::format("--pp must be >= 1 and --micro-batches >= 0 (with --pp >= 2), got {} and {}", a.pp, a.micro_batches));
  }
  if (s.is_ok() && a.pp > 1 && model::find_preset(a.preset).value().model.num_layers % a.pp != 0) {
    s = invalid_argument(fmt::format("--pp {} must divide the {} preset's {} layers", a.pp, a.preset,
                                     model::find_preset(a.preset).value().model.num_layers));
  }
  if (s.is_ok()) s = timeout.status();
  if (s.is_ok() && cmd.count("--json-out") > 0) s = check_output_path("--json-out", a.json_out);  // refuses ""
  if (!s.is_ok()) {
    print_usage_error("bench calibration", s.message());
    return kExitBadInput;
  }
  WorldOptions world;
  world.is_ranks_given = cmd.count("--ranks") > 0;
  world.timeout = timeout.value();
  return run_world("bench calibration", a.ranks, [&](comm::Communicator& c) -> Status {
    auto say = [&c](const std::string& line) {
      if (c.rank() == 0) progress_to_stderr("bench calibration")(line);
    };
    DISTCA_ASSIGN_OR_RETURN(sim::Profile profile, measure_cpu_profile(c, options.value(), say));
    // Both backends trained as `distca train --compare` would (with --pp, both pipeline
    // schedules), each step predicted by the simulator from the step's own batches and plans.
    const model::Preset preset = model::find_preset(a.preset).value();
    train::TrainOptions t;
    t.model = preset.model;
    t.optim = preset.optim;
    t.context = preset.context;
    t.steps = a.steps;
    t.workload = preset.workload;
    t.backends = {"colocated", "cad"};
    t.pp = a.pp;
    t.micro_batches = a.micro_batches;
    // The simulator prices one plan per step (per tick with --pp), run layer by layer.
    t.pingpong = "off";
    if (a.pp > 1) t.backward_mode = plan::BackwardMode::kStateless;
    DISTCA_ASSIGN_OR_RETURN(auto trainer, train::make_trainer(c, t));
    const sim::LinearEntry* linear = profile.find_linear(linear_model_key(preset.model));
    if (linear == nullptr) return internal_error("the measured profile has no entry for the model");
    const plan::ModelShape shape = train::model_shape(preset.model);
    const int dp = trainer->rank_map().dp;
    // Without --pp, the gradient all-reduce, priced on the measured link: fp32 gradients of every
    // parameter (predict_pipeline_step prices the pipeline's own).
    const double allreduce = sim::collective_seconds(sim::Collective::kAllReduce, 4.0 * preset.model.num_parameters(),
                                                     c.size(), profile.inter_node);
    double predicted[2] = {0, 0}, measured[2] = {0, 0};
    nlohmann::json steps = nlohmann::json::array();
    for (int64_t s = 0; s < a.steps; ++s) {
      DISTCA_ASSIGN_OR_RETURN(std::vector<train::StepRecord> records, trainer->step());
      for (size_t i = 0; i < 2; ++i) {
        const train::StepRecord& r = records[i];
        const train::StepPlans plans = trainer->last_plans(i);
        sim::StepPrediction p;
        nlohmann::json step;
        if (a.pp > 1) {
          sim::PipelineStepInput in;
          in.stages = a.pp;
          in.dp = dp;
          in.micro_batches = plans.micro_batches;
          for (const train::TickPlan& tick : plans.plans) in.ticks.push_back({tick.is_backward, tick.micro_batch, tick.pool, tick.tasks});
          p = sim::predict_pipeline_step(profile, shape, in, linear->seconds_per_token_layer, linear->step_fixed_seconds);
          step = {{"step", s}, {"schedule", r.backend}, {"measured", r.step_seconds}, {"predicted", p.seconds}};
        } else {
          p = sim::predict_step(profile, shape, plans.micro_batches.front(), plans.plans.front().tasks, t.backward_mode,
                                linear->seconds_per_token_layer, linear->step_fixed_seconds + allreduce);
          step = {{"step", s}, {"backend", r.backend}, {"measured", r.step_seconds}, {"predicted", p.seconds},
                  {"predicted_attention", p.attention}, {"measured_attention", r.straggler().attention}};
        }
        steps.push_back(step);
        if (s >= a.skip) predicted[i] += p.seconds, measured[i] += r.step_seconds;
        say(fmt::format("step {} {}: measured {:.3f} s, predicted {:.3f} s", s + 1, r.backend, r.step_seconds, p.seconds));
      }
    }
    if (c.rank() != 0) return Status::ok();
    if (a.pp == 1) return print_calibration(a, c, profile, predicted, measured, steps, nlohmann::json::object(), "", "backend");
    const int micro_batches = trainer->options().micro_batches;
    return print_calibration(a, c, profile, predicted, measured, steps, {{"pp", a.pp}, {"micro_batches", micro_batches}},
                             fmt::format("pipeline: {} stages x {} replica{}, {} micro-batches per step", a.pp, dp,
                                         dp == 1 ? "" : "s", micro_batches),
                             "schedule");
  }, world);
}

}  // namespace

std::function<int()> add_profile_command(CLI::App& app) {
  auto args = std::make_shared<ProfileArgs>();
  ProfileArgs& a = *args;
  CLI::App* cmd = app.add_subcommand("profile", "Measure this machine (attention kernels, the model's linear work, the "
                                                "link between ranks) into a simulator profile (JSON)");
  cmd->add_option("--preset", a.preset, "the model whose head shape and linear layers are measured: tiny | demo")
      ->capture_default_str();
  cmd->add_option("--context", a.context, "the longest document timed and the tokens of the linear run");
  cmd->add_option("--threads", a.threads, "threads per rank")->capture_default_str();
  cmd->add_option("--repeats", a.repeats, "each time is the best of this many")->capture_default_str();
  cmd->add_option("--ranks", a.ranks, "ranks as threads when not started by mpirun")->capture_default_str();
  cmd->add_option("--out", a.out, "write the profile here (default: standard output)");
  cmd->add_option("--timeout", a.timeout_seconds, kTimeoutHelp)->capture_default_str();
  return [args, cmd] { return run_profile(*args, *cmd); };
}

std::function<int()> add_calibration_command(CLI::App& bench) {
  auto args = std::make_shared<CalibrationArgs>();
  CalibrationArgs& a = *args;
  CLI::App* cmd = bench.add_subcommand(
      "calibration", "measure a profile, train the demo with --compare, and predict its step times with the simulator "
                     "(run under mpirun -np 2)");
  cmd->add_option("--preset", a.preset, "tiny | demo")->capture_default_str();
  cmd->add_option("--steps", a.steps, "training steps per backend")->capture_default_str();
  cmd->add_option("--pp", a.pp, "pipeline stages: train with --pp and predict both pipeline schedules")->capture_default_str();
  cmd->add_option("--micro-batches", a.micro_batches, "with --pp: micro-batches per step (0: 2 x --pp)")->capture_default_str();
  cmd->add_option("--skip", a.skip, "warm-up steps left out of the means")->capture_default_str();
  cmd->add_option("--ranks", a.ranks, "ranks as threads when not started by mpirun")->capture_default_str();
  cmd->add_flag("--json", a.is_json, "print one JSON object instead of the table");
  cmd->add_option("--json-out", a.json_out,
                  "also write the JSON report to this file (written when the run ends; the table still prints)");
  cmd->add_option("--timeout", a.timeout_seconds, kTimeoutHelp)->capture_default_str();
  return [args, cmd] { return run_calibration(*args, *cmd); };
}

}  // namespace distca::tools
