#include "cmd_train.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <optional>
#include <string>

#include "distca/core/file.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/model/trainer.h"
#include "world.h"

namespace distca::tools {

namespace {

struct TrainArgs {
  std::string preset = "demo";
  std::string attention = "cad";
  bool is_compare = false;
  std::optional<int64_t> steps, context, layers;
  std::optional<double> lr;
  std::optional<std::string> workload;
  std::string data;
  uint64_t seed = 1;
  std::string policy = "minmax";
  std::string backward_mode = "stateful";
  int threads = 1;
  int64_t granularity = 0;
  double tolerance = 0.05;
  std::string json_path;
  std::string checkpoint;
  int64_t save_every = 0;
  std::string resume;
  int ranks = 2;
  int64_t skip = 1;
};

Result<model::TrainOptions> resolve(const TrainArgs& a) {
  DISTCA_ASSIGN_OR_RETURN(model::Preset p, model::find_preset(a.preset));
  model::TrainOptions o;
  o.model = p.model;
  o.optim = p.optim;
  o.context = a.context.value_or(p.context);
  o.steps = a.steps.value_or(p.steps);
  if (a.layers) o.model.num_layers = *a.layers;
  if (a.lr) o.optim.lr = *a.lr;
  o.workload = a.workload.value_or(p.workload);
  o.data_path = a.data;
  o.data_seed = a.seed;
  if (a.is_compare) {
    o.backends = {"colocated", "cad"};
  } else {
    o.backends = {a.attention};
  }
  o.policy = a.policy;
  if (a.backward_mode == "stateful") {
    o.backward_mode = plan::BackwardMode::kStateful;
  } else if (a.backward_mode == "stateless") {
    o.backward_mode = plan::BackwardMode::kStateless;
  } else {
    return invalid_argument(fmt::format("--backward-mode must be stateful or stateless, got '{}'", a.backward_mode));
  }
  o.threads = a.threads;
  o.granularity = a.granularity;
  o.tolerance = a.tolerance;
  o.checkpoint_path = a.checkpoint;
  o.save_every = a.save_every;
  o.resume_path = a.resume;
  if (a.skip < 0) return invalid_argument(fmt::format("--skip must be >= 0, got {}", a.skip));
  DISTCA_RETURN_IF_ERROR(o.validate());
  if (o.data_path.empty()) {
    bool known = false;
    for (const std::string& w : model::synthetic_workloads()) known = known || w == o.workload;
    if (!known) return invalid_argument(fmt::format("--workload must be pretrain, prolong or skewed, got '{}'", o.workload));
  }
  return o;
}

std::string si(double v) {
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

void print_header(const model::TrainOptions& o, const model::Trainer& t, const comm::Communicator& c) {
  const model::ModelConfig& m = o.model;
  fmt::print("distca train: {} rank(s) over {}, attention {}{}\n", c.size(), c.name() == "mpi" ? "MPI" : "threads (LocalComm)",
             fmt::join(o.backends, " vs "), o.backends.size() > 1 ? " (compared, interleaved step by step)" : "");
  fmt::print("  model      {} layers, d {}, heads {}/{} x {}, ffn {}, vocab {}: {} parameters\n", m.num_layers, m.d_model,
             m.num_q_heads, m.num_kv_heads, m.head_dim, m.ffn_dim, m.vocab_size, si(static_cast<double>(m.num_parameters())));
  fmt::print("  data       {}; {} tokens per rank per step, {} steps{}\n", t.data_description(), o.context, o.steps,
             t.steps_done() > 0 ? fmt::format(" (resumed at step {})", t.steps_done()) : "");
  fmt::print("  cad        planner {}, granularity {}, tolerance {}, {} backward; {} thread(s) per rank\n", o.policy,
             o.granularity, o.tolerance, plan::backward_mode_name(o.backward_mode), o.threads);
  fmt::print("  optimizer  AdamW lr {} (warm-up {} steps), betas {}/{}, weight decay {}, clip {}\n", o.optim.lr,
             o.optim.warmup_steps, o.optim.beta1, o.optim.beta2, o.optim.weight_decay, o.optim.clip_norm);
  std::fflush(stdout);
}

void print_step(const model::StepRecord& r, int64_t steps) {
  fmt::print("step {:>4}/{} {:<9} loss {:.4f}  {:>7} tok/s  step {:.3f}s = linear {:.3f} + attention {:.3f} + comm "
             "{:.3f} + wait {:.3f}  attn imbalance {:.2f}\n",
             r.step + 1, steps, r.backend, r.loss, si(r.tokens_per_second), r.step_seconds, r.linear_seconds,
             r.attention_seconds, r.comm_seconds, r.wait_seconds, r.attention_imbalance);
  std::fflush(stdout);
}

void print_summary(const nlohmann::json& s) {
  fmt::print("\n{:<10} {:>9} {:>10} {:>10} {:>10} {:>11}  {}\n", "backend", "step (s)", "tokens/s", "wait (s)",
             "attn (s)", "imbalance", "loss first 10 -> last 10");
  for (const std::string name : {"colocated", "cad"}) {
    if (!s["backends"].contains(name)) continue;
    const nlohmann::json& b = s["backends"][name];
    fmt::print("{:<10} {:>9.3f} {:>10} {:>10.3f} {:>10.3f} {:>11.2f}  {:.4f} -> {:.4f}\n", name,
               b["step_seconds"].get<double>(), si(b["tokens_per_second"].get<double>()), b["wait_seconds"].get<double>(),
               b["attention_seconds"].get<double>(), b["attention_imbalance"].get<double>(), b["loss_first"].get<double>(),
               b["loss_last"].get<double>());
  }
  fmt::print("{:<10} {:>9.3f}   (attention exactly at the mean on every rank)\n", "ideal", s["ideal_step_seconds"].get<double>());
  if (!s["speedup"].is_null()) {
    fmt::print("speedup of CAD over colocated: {:.2f}x; CAD step / ideal: {:.3f}; largest relative loss difference: {:.2e}\n",
               s["speedup"].get<double>(), s["cad_over_ideal"].get<double>(), s["loss_max_rel_diff"].get<double>());
  }
}

int run_train(const TrainArgs& a) {
  Result<model::TrainOptions> options = resolve(a);
  if (!options.is_ok()) {
    fmt::print(stderr, "distca train: error: {}\n", options.status().message());
    return 2;
  }
  kernels::blas_set_num_threads(options.value().threads);
  return run_world("train", a.ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto trainer, model::Trainer::create(c, options.value()));
    const model::TrainOptions& o = trainer->options();
    const bool is_root = c.rank() == 0;
    if (is_root) print_header(o, *trainer, c);
    std::vector<model::StepRecord> records;
    while (trainer->steps_done() < o.steps) {
      DISTCA_ASSIGN_OR_RETURN(std::vector<model::StepRecord> step, trainer->step());
      for (model::StepRecord& r : step) {
        if (is_root) print_step(r, o.steps);
        records.push_back(std::move(r));
      }
    }
    if (!is_root) return Status::ok();
    const nlohmann::json summary = model::summarize(records, a.skip);
    print_summary(summary);
    if (!o.checkpoint_path.empty()) fmt::print("checkpoint: {}\n", o.checkpoint_path);
    if (!a.json_path.empty()) {
      nlohmann::json steps = nlohmann::json::array();
      for (const model::StepRecord& r : records) steps.push_back(r.to_json());
      const nlohmann::json out = {{"format", "distca-train"}, {"version", 1},       {"ranks", c.size()},
                                  {"comm", c.name()},         {"preset", a.preset}, {"config", o.to_json()},
                                  {"data", trainer->data_description()},            {"steps", steps},
                                  {"summary", summary}};
      DISTCA_RETURN_IF_ERROR(write_file_atomic(a.json_path, out.dump(2) + "\n"));
      fmt::print("wrote {}\n", a.json_path);
    }
    return Status::ok();
  });
}

}  // namespace

std::function<int()> add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  TrainArgs& a = *args;
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a Llama-style model data-parallel, with colocated or CAD core attention (or both, --compare).\n"
      "Under mpirun each process is one rank; otherwise --ranks threads run in this process.");
  cmd->add_option("--preset", a.preset, "model, context, steps and data: tiny | demo")->capture_default_str();
  cmd->add_option("--attention", a.attention, "core attention backend: colocated | cad")->capture_default_str();
  cmd->add_flag("--compare", a.is_compare, "train colocated and CAD from the same weights on the same data, interleaved");
  cmd->add_option("--steps", a.steps, "optimizer steps (default: the preset's)");
  cmd->add_option("--context", a.context, "tokens per rank per step (default: the preset's)");
  cmd->add_option("--layers", a.layers, "transformer layers (default: the preset's)");
  cmd->add_option("--lr", a.lr, "peak learning rate (default: the preset's)");
  cmd->add_option("--data", a.data, "a .jsonl file (a \"text\" field per line) or a directory of text files; "
                                    "default: the embedded synthetic source");
  cmd->add_option("--workload", a.workload, "document lengths of the synthetic source: pretrain | prolong | skewed");
  cmd->add_option("--seed", a.seed, "seed of the synthetic source")->capture_default_str();
  cmd->add_option("--policy", a.policy, "CAD planner: minmax | distca | none")->capture_default_str();
  cmd->add_option("--backward-mode", a.backward_mode, "stateful (servers keep forward state) | stateless (the paper's)")
      ->capture_default_str();
  cmd->add_option("--threads", a.threads, "BLAS and attention threads per rank")->capture_default_str();
  cmd->add_option("--granularity", a.granularity, "planner shard granularity in tokens (0: context / 32, 16..128)")
      ->capture_default_str();
  cmd->add_option("--tolerance", a.tolerance, "planner load tolerance")->capture_default_str();
  cmd->add_option("--json", a.json_path, "write per-step records and the summary to this file");
  cmd->add_option("--checkpoint", a.checkpoint, "save the model and optimizer state here (at the end, and --save-every)");
  cmd->add_option("--save-every", a.save_every, "steps between checkpoints (0: only at the end)")->capture_default_str();
  cmd->add_option("--resume", a.resume, "continue from this checkpoint (same data, ranks and context)");
  cmd->add_option("--ranks", a.ranks, "ranks to run as threads when not under mpirun")->capture_default_str();
  cmd->add_option("--skip", a.skip, "warm-up steps left out of the summary's time means")->capture_default_str();
  return [args] { return run_train(*args); };
}

}  // namespace distca::tools
