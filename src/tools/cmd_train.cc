#include "cmd_train.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "distca/core/file.h"
#include "distca/core/memory.h"
#include "distca/core/trace.h"
#include "distca/plan/planner.h"
#include "distca/plan/pipeline_schedule.h"
#include "distca/train/data.h"
#include "distca/train/trainer.h"
#include "world.h"

namespace distca::tools {

namespace {

// The --json file: its format name and version (scripts/gpu-check.sh reads it). Version 3: one
// record for both trainers (the pipeline's was distca-train-pipeline version 1).
constexpr const char* kTrainFormat = "distca-train";
constexpr int kTrainFormatVersion = 3;

struct TrainArgs {
  std::string preset = "demo";
  std::string attention = "cad";
  bool is_compare = false;
  std::optional<int64_t> steps, context, layers;
  std::optional<double> lr, min_lr;
  std::optional<int64_t> warmup;
  std::string lr_schedule = "constant";
  int64_t eval_every = 0, eval_docs = 64, eval_steps = 1;
  std::optional<std::string> workload;
  std::string data;
  uint64_t seed = 1;
  std::string policy = std::string(plan::kDefaultPlanner);
  std::string backward_mode = "stateful";
  std::string grad_return = "fp32";
  std::string pingpong = "auto";
  std::string memory_budget = "auto";
  std::string progress = "poll";
  std::string grad_sync = "overlap";
  int64_t progress_interval_us = 1000;
  int threads = 1;
  int64_t granularity = 0;
  double tolerance = 0.05;
  std::string json_path;
  std::string trace_path;
  int64_t trace_steps = 3;
  std::string checkpoint;
  int64_t save_every = 0;
  std::string resume;
  int ranks = 2;
  int tp = 1;
  int pp = 1;
  int micro_batches = 0;
  bool is_print_schedule = false;
  bool is_recompute = false;
  int64_t skip = 1;
  double timeout_seconds = kDefaultTimeoutSeconds;
  // Which flags the user gave (a flag that the run would ignore is refused).
  CLI::Option *attention_opt = nullptr, *policy_opt = nullptr, *workload_opt = nullptr, *seed_opt = nullptr,
              *ranks_opt = nullptr, *skip_opt = nullptr, *backward_opt = nullptr, *granularity_opt = nullptr,
              *tolerance_opt = nullptr, *eval_docs_opt = nullptr, *eval_steps_opt = nullptr, *pp_opt = nullptr,
              *micro_batches_opt = nullptr, *pingpong_opt = nullptr, *grad_return_opt = nullptr, *memory_budget_opt = nullptr;
  bool given(const CLI::Option* o) const { return o != nullptr && o->count() > 0; }
};

std::string gib(int64_t bytes) { return memory_text(bytes); }

Result<train::TrainOptions> resolve(const TrainArgs& a) {
  DISTCA_ASSIGN_OR_RETURN(model::Preset p, model::find_preset(a.preset));
  train::TrainOptions o;
  o.model = p.model;
  o.optim = p.optim;
  o.context = a.context.value_or(p.context);
  o.steps = a.steps.value_or(p.steps);
  if (a.layers) o.model.num_layers = *a.layers;
  if (a.lr) o.optim.lr = *a.lr;
  if (a.warmup) o.optim.warmup_steps = *a.warmup;
  o.optim.schedule = a.lr_schedule;
  o.optim.min_lr = a.min_lr;
  o.optim.total_steps = o.steps;
  if (a.min_lr && a.lr_schedule == "constant") {
    return invalid_argument("--min-lr is the floor of a decaying schedule: add --lr-schedule cosine or linear");
  }
  if (a.eval_every == 0 && (a.given(a.eval_docs_opt) || a.given(a.eval_steps_opt))) {
    return invalid_argument("--eval-docs and --eval-steps shape the validation: add --eval-every N");
  }
  if (a.data.empty() && a.given(a.eval_docs_opt)) {
    return invalid_argument("--eval-docs holds documents of a --data source out; the synthetic source validates on "
                            "another seed's stream: drop --eval-docs");
  }
  o.eval_every = a.eval_every;
  o.eval_docs = a.eval_docs;
  o.eval_steps = a.eval_steps;
  o.workload = a.workload.value_or(p.workload);
  o.data_path = a.data;
  o.data_seed = a.seed;
  // Flags that the run would silently ignore are refused.
  if (!a.data.empty() && a.given(a.workload_opt)) {
    return invalid_argument("--workload chooses the synthetic source's document lengths; with --data the documents "
                            "come from the file: drop one of them");
  }
  if (!a.data.empty() && a.given(a.seed_opt)) {
    return invalid_argument("--seed seeds the synthetic source; with --data it has no effect: drop it");
  }
  if (a.is_compare && a.given(a.attention_opt)) {
    return invalid_argument("--compare trains both colocated and cad; --attention picks one: drop one of them");
  }
  const bool has_cad = a.is_compare || a.attention == "cad";
  if (!has_cad) {
    for (const CLI::Option* opt : {a.policy_opt, a.backward_opt, a.granularity_opt, a.tolerance_opt, a.grad_return_opt}) {
      if (a.given(opt)) {
        return invalid_argument(fmt::format("{} configures CAD, but --attention colocated runs no planner and no exchange: "
                                            "use --attention cad or --compare, or drop {}",
                                            opt->get_name(), opt->get_name()));
      }
    }
  }
  if (a.policy == "all") {
    return invalid_argument("--policy must be one planner: none, distca, minmax, minbytes or minlink ('all' is for distca plan)");
  }
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
  DISTCA_ASSIGN_OR_RETURN(o.grad_return, plan::parse_grad_return(a.grad_return));
  o.threads = a.threads;
  o.tp = a.tp;
  o.pingpong = a.pingpong;
  o.progress = a.progress;
  o.grad_sync = a.grad_sync;
  o.progress_interval_us = a.progress_interval_us;
  if (a.given(a.pingpong_opt) && a.pingpong != "on" && a.pingpong != "off") {
    return invalid_argument("--pingpong must be on or off (leave it out for on with cad, off with colocated)");
  }
  o.granularity = a.granularity;
  o.tolerance = a.tolerance;
  o.checkpoint_path = a.checkpoint;
  o.save_every = a.save_every;
  o.resume_path = a.resume;
  o.pp = a.pp;
  o.micro_batches = a.micro_batches;
  o.recompute = a.is_recompute;
  DISTCA_RETURN_IF_ERROR(o.validate(world_size(a.ranks)));
  if (a.pp == 1 && (a.given(a.micro_batches_opt) || a.is_print_schedule || a.is_recompute)) {
    return invalid_argument("--micro-batches, --print-schedule and --recompute shape a pipeline: add --pp P (P >= 2)");
  }
  if (a.memory_budget == "auto") {
    o.memory_budget = train::TrainOptions::kAutoBudget;
  } else if (a.memory_budget == "unlimited") {
    o.memory_budget = 0;
  } else {
    double mib = 0;
    size_t used = 0;
    try {
      mib = std::stod(a.memory_budget, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != a.memory_budget.size() || !(mib > 0) || mib > 1e9) {
      return invalid_argument(fmt::format("--memory-budget must be MiB per rank (a positive number), auto or unlimited, "
                                          "got '{}'", a.memory_budget));
    }
    o.memory_budget = static_cast<int64_t>(mib * (1 << 20));
  }
  if (a.pp > 1 && a.given(a.memory_budget_opt)) {
    return invalid_argument("--memory-budget governs the data-parallel trainer; with --pp the pipeline's memory is its "
                            "schedule's (--recompute evens it across stages): drop --memory-budget or --pp");
  }
  if (a.pp > 1) o.memory_budget = 0;
  if (a.pp > 1 && has_cad && a.given(a.backward_opt) && o.backward_mode == plan::BackwardMode::kStateful) {
    return invalid_argument("--pp with CAD plans every tick anew (a micro-batch's forward and backward fall in "
                            "different ticks), so its backward is stateless: drop --backward-mode stateful");
  }
  const bool is_power_of_two = o.granularity > 0 && (o.granularity & (o.granularity - 1)) == 0;
  if (o.granularity != 0 && (!is_power_of_two || o.granularity < 16 || o.granularity > 4096)) {
    // As distca plan: every cut on a kernel tile boundary (see cmd_plan.cc).
    return invalid_argument(fmt::format("--granularity must be a power of two from 16 to 4096, or 0 for the largest "
                                        "power of two <= context / 32 clamped to 16..128; got {}", o.granularity));
  }
  if (o.data_path.empty()) {
    bool known = false;
    for (const std::string& w : train::synthetic_workloads()) known = known || w == o.workload;
    if (!known) return invalid_argument(fmt::format("--workload must be pretrain, prolong or skewed, got '{}'", o.workload));
  }
  if (a.skip < 0) return invalid_argument(fmt::format("--skip must be >= 0, got {}", a.skip));
  if (a.given(a.skip_opt) && a.skip >= o.steps) {
    return invalid_argument(fmt::format("--skip {} leaves no step of --steps {} to time; --skip must be below --steps",
                                        a.skip, o.steps));
  }
  DISTCA_RETURN_IF_ERROR(timeout_from_seconds(a.timeout_seconds).status());
  // --resume and --checkpoint on one file is the usual way to continue (the checkpoint is read
  // whole before training starts and replaced atomically at the next save): only --json is kept
  // off the checkpoint being resumed.
  DISTCA_RETURN_IF_ERROR(check_output_paths({{"--json", a.json_path}, {"--checkpoint", a.checkpoint}, {"--trace", a.trace_path}},
                                            {{"--data", o.data_path}}));
  DISTCA_RETURN_IF_ERROR(check_output_paths({{"--json", a.json_path}, {"--trace", a.trace_path}}, {{"--resume", a.resume}}));
  if (a.trace_steps < 1 || a.trace_steps > 10000) {
    return invalid_argument(fmt::format("--trace-steps must be 1..10000, got {}", a.trace_steps));
  }
  if (!a.trace_path.empty() && a.pp > 1) {
    return invalid_argument("--trace records the data-parallel trainer's steps; the pipeline trainer (--pp) writes no "
                            "trace yet: drop --trace or --pp");
  }
  // Memory: refuse before allocating what this machine cannot hold.
  const int world = world_size(a.ranks);
  const train::MemoryEstimate m = train::estimate_memory(o, world);
  const int64_t here = m.total() * ranks_on_this_machine(a.ranks);
  const int64_t available = available_memory_bytes();
  if (here > available) {
    return invalid_argument(fmt::format(
        "this run needs about {} of memory on this machine ({} rank(s) x {}: model states {}, activations {}, "
        "attention buffers {}, step data {}), and {} is available; lower --context or --layers, or use fewer ranks "
        "per machine",
        gib(here), ranks_on_this_machine(a.ranks), gib(m.total()), gib(m.states_bytes), gib(m.activations_bytes),
        gib(m.attention_bytes), gib(m.data_bytes), gib(available)));
  }
  return o;
}


// How the model splits over the TP ranks ("" without TP).
std::string tp_note(const train::TrainOptions& o) {
  if (o.tp <= 1) return "";
  const model::ModelConfig s = model::tensor_parallel_shard(o.model, o.tp).value();
  const int shared = model::kv_head_replicas(o.model, o.tp);
  return fmt::format("; tensor parallel over {} ranks: {}/{} heads and ffn {} each{} (Megatron, all-reduce after Wo and "
                     "Wdown)", o.tp, s.num_q_heads, s.num_kv_heads, s.ffn_dim,
                     shared > 1 ? fmt::format(", each key/value head shared by {} ranks", shared) : "");
}

// Which backends split their steps into two ping-pong nano-batches.
// With --pp, each micro-batch splits in its ticks (a cad tick: one pooled plan per nano-batch).
std::string pingpong_note(const train::TrainOptions& o) {
  const bool pipeline = o.pp > 1;
  std::vector<std::string> on, off;
  for (const std::string& b : o.backends) (o.pingpong == "on" || (o.pingpong == "auto" && b == "cad") ? on : off).push_back(b);
  std::string s;
  if (!on.empty()) {
    s = fmt::format("on for {}: each {} splits into two nano-batches (whole documents, halved by causal pairs), each "
                    "planned{}; one's dispatch and return in flight while the other computes{}", fmt::join(on, ", "),
                    pipeline ? "micro-batch" : "step", pipeline ? " (cad: pooled over the tick's stages)" : "",
                    pipeline ? "; a micro-batch of one document runs whole" : "");
  }
  if (!off.empty()) s += fmt::format("{}off for {}: each layer dispatch, compute, return in turn", s.empty() ? "" : "; ", fmt::join(off, ", "));
  return s;
}

// The rank map: each rank's (tp, pp, dp) and the groups it joins (the first 16 ranks).
void print_rank_map(const train::RankMap& map) {
  fmt::print("  ranks      tp {} x pp {} x dp {} (rank = (pp x {} + dp) x {} + tp):\n", map.tp, map.pp, map.dp, map.dp, map.tp);
  const std::vector<std::string> lines = map.describe();
  for (size_t i = 0; i < lines.size() && i < 16; ++i) fmt::print("             {}\n", lines[i]);
  if (lines.size() > 16) fmt::print("             ... ({} ranks; --json has all)\n", lines.size());
}

std::string si(double v) {
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

bool has_cad(const train::TrainOptions& o) {
  return std::find(o.backends.begin(), o.backends.end(), "cad") != o.backends.end();
}

void print_header(const train::Trainer& t, const comm::Communicator& c) {
  const train::TrainOptions& o = t.options();
  const model::ModelConfig& m = o.model;
  const bool pipeline = o.pp > 1;
  const std::string over = c.name() == "mpi" ? "MPI" : "threads (LocalComm)";
  const std::string compared = o.backends.size() > 1 ? " (compared, interleaved step by step)" : "";
  if (pipeline) {
    fmt::print("distca train: {} rank(s) over {}: {} pipeline stages x {} data-parallel replicas{}, {} micro-batches per "
               "step, schedule {}{}\n",
               c.size(), over, o.pp, t.rank_map().dp, o.tp > 1 ? fmt::format(" x {} tensor-parallel ranks", o.tp) : "",
               o.micro_batches, fmt::join(o.backends, " vs "), compared);
  } else {
    fmt::print("distca train: {} rank(s) over {}, attention {}{}\n", c.size(), over, fmt::join(o.backends, " vs "), compared);
  }
  fmt::print("  model      {} layers{}, d {}, heads {}/{} x {}, ffn {}, vocab {}: {} parameters{}\n", m.num_layers,
             pipeline ? fmt::format(" ({} per stage)", m.num_layers / o.pp) : "", m.d_model, m.num_q_heads,
             m.num_kv_heads, m.head_dim, m.ffn_dim, m.vocab_size, si(static_cast<double>(m.num_parameters())), tp_note(o));
  fmt::print("  data       {}; {} tokens per {} per {}, {} steps{}\n", t.data_description(), o.context,
             o.tp > 1 ? "replica (its TP ranks share them)" : "rank", pipeline ? "micro-batch" : "step", o.steps,
             t.steps_done() > 0 ? fmt::format(" (resumed after step {})", t.steps_done()) : "");
  print_rank_map(t.rank_map());
  if (pipeline && has_cad(o)) {
    fmt::print("  cad        lockstep ticks, one plan per tick over all {} ranks{} (planner {}, granularity {}, tolerance "
               "{}, stateless backward); idle stages serve attention; {} thread(s) per rank\n",
               c.size() / o.tp, o.tp > 1 ? " of each TP index" : "", o.policy, o.granularity, o.tolerance, o.threads);
  } else if (has_cad(o)) {
    fmt::print("  cad        planner {}, granularity {}, tolerance {}, {} backward, dK/dV returned in {}; {} thread(s) per rank\n",
               o.policy, o.granularity, o.tolerance, plan::backward_mode_name(o.backward_mode),
               plan::grad_return_name(o.grad_return), o.threads);
  } else {
    fmt::print("  colocated  each rank attends its own documents{}; {} thread(s) per rank\n",
               pipeline ? " (1F1B over the stages)" : "", o.threads);
  }
  fmt::print("  ping-pong  {}\n", pingpong_note(o));
  if (!pipeline) {
    const std::string budget = o.memory_budget == train::TrainOptions::kAutoBudget
                                   ? fmt::format("budget auto: each step {} x what colocated attention needs on its batch as "
                                                 "configured", train::TrainOptions::kAutoBudgetRatio)
                                   : fmt::format("budget {:.1f} MiB", static_cast<double>(o.memory_budget) / (1 << 20));
    fmt::print("  memory     {}\n",
               o.memory_budget != 0
                   ? fmt::format("{} per rank (model states, activations, attention buffers): each step runs the first "
                                 "of as configured, without ping-pong, stateless, stateless without ping-pong, attention "
                                 "colocated, whose buffers fit, predicted from its plan",
                                 budget)
                   : std::string("no budget: every step as configured"));
  }
  fmt::print("  optimizer  AdamW lr {} (warm-up {} steps, then {}), betas {}/{}, weight decay {}, clip {}\n", o.optim.lr,
             o.optim.warmup_steps,
             o.optim.schedule == "constant" ? std::string("constant")
                                            : fmt::format("{} decay to {} at step {}", o.optim.schedule, o.optim.floor_lr(), o.steps),
             o.optim.beta1, o.optim.beta2, o.optim.weight_decay, o.optim.clip_norm);
  if (o.eval_every > 0) {
    fmt::print("  validation every {} steps: {} held-out step(s) of {} x {} tokens ({})\n", o.eval_every, o.eval_steps,
               t.rank_map().dp, o.context, o.data_path.empty() ? "another seed's stream" : fmt::format("the last {} documents, never trained on", o.eval_docs));
  }
  if (pipeline) {
    fmt::print("  step time  the straggler's own parts (the rank the others waited for; they add up): linear + attn + comm "
               "+ pipe (waiting for the neighbour stage) + idle (ticks without work) + wait (for the straggler at the "
               "step's end) + optim + other\n");
  } else {
    fmt::print("  step time  the straggler's own parts (the rank the others waited for; they add up); attention min-max "
               "across ranks beside it\n");
  }
  std::fflush(stdout);
}

void print_step(const train::StepRecord& r, const train::TrainOptions& o) {
  const train::StepRecord::Rank& x = r.straggler();
  const std::string pipe = o.pp > 1 ? fmt::format("pipe {:.3f} + idle {:.3f} + ", x.pipeline_wait, x.idle) : "";
  std::string tail;
  if (o.pp > 1) {
    double served = 0;
    for (const auto& y : r.ranks) served += y.served_in_idle;
    tail = fmt::format("attn imbalance {:.2f}, served in idle ticks {:.3f}s, ping-pong {}/{}", r.attention_imbalance, served,
                       r.split_micro_batches, r.micro_batches);
  } else {
    tail = fmt::format("attn across ranks {:.3f}-{:.3f}, {} {}{}", r.attention_min_seconds, r.attention_max_seconds,
                       r.split_micro_batches > 0 ? "ping-pong" : "whole", r.backward_mode,
                       r.colocated_plan ? ", attention colocated (no plan fitted the memory budget)" : "");
  }
  fmt::print("step {:>4}/{} {:<9} loss {:.4f}  {:>7} tok/s  {:.3f}s = linear {:.3f} + attn {:.3f} + comm {:.3f} + {}"
             "wait {:.3f} + optim {:.3f} + other {:.3f} (rank {})  {}\n",
             r.step, o.steps, r.backend, r.loss, si(r.tokens_per_second), r.step_seconds, x.linear, x.attention, x.comm, pipe,
             x.wait, x.optimizer, x.other, r.slowest_rank, tail);
  std::fflush(stdout);
}

void print_summary(const nlohmann::json& s, const train::TrainOptions& o) {
  const nlohmann::json& any = s["backends"].begin().value();
  const int64_t k = any["loss_steps"].get<int64_t>();
  const std::string loss_head = k == 1 ? "loss first -> last step" : fmt::format("loss, mean of first {} -> last {}", k, k);
  const bool pipeline = o.pp > 1;
  if (pipeline) {
    fmt::print("\n{:<10} {:>9} {:>14} {:>10} {:>16}  {}\n", "schedule", "step (s)", "wait+bubble", "imbalance",
               "served in idle", loss_head);
  } else {
    fmt::print("\n{:<10} {:>9} {:>10} {:>10} {:>10} {:>9} {:>10}  {}\n", "backend", "step (s)", "tokens/s", "wait (s)",
               "attn (s)", "imbalance", "bound (s)", loss_head);
  }
  std::vector<std::string> memory;
  for (const std::string& name : o.backends) {
    const nlohmann::json& b = s["backends"][name];
    if (pipeline) {
      fmt::print("{:<10} {:>9.3f} {:>8.3f} ({:>3.0f}%) {:>10.2f} {:>9.3f}s ({:>2.0f}%)  {:.4f} -> {:.4f}\n", name,
                 b["step_seconds"].get<double>(), b["wait_and_bubble_seconds"].get<double>(),
                 100 * b["wait_and_bubble_share"].get<double>(), b["attention_imbalance"].get<double>(),
                 b["served_in_idle_seconds"].get<double>(), 100 * b["served_in_idle_share_of_attention"].get<double>(),
                 b["loss_first"].get<double>(), b["loss_last"].get<double>());
      memory.push_back(fmt::format("{} {:.1f} MiB (max/mean over ranks {:.3f}, within a stage {:.3f}{})", name,
                                   b["memory_max_bytes"].get<double>() / (1 << 20), b["memory_max_over_mean"].get<double>(),
                                   b["memory_max_over_mean_within_stage"].get<double>(),
                                   o.recompute ? fmt::format("; recomputing {:.3f} s per step on the rank that recomputed most",
                                                             b["recompute_seconds"].get<double>())
                                               : ""));
    } else {
      fmt::print("{:<10} {:>9.3f} {:>10} {:>10.3f} {:>10.3f} {:>9.2f} {:>10.3f}  {:.4f} -> {:.4f}\n", name,
                 b["step_seconds"].get<double>(), si(b["tokens_per_second"].get<double>()), b["wait_max_seconds"].get<double>(),
                 b["attention_seconds"].get<double>(), b["attention_imbalance"].get<double>(),
                 b["bound_seconds"].get<double>(), b["loss_first"].get<double>(), b["loss_last"].get<double>());
      memory.push_back(fmt::format("{} {:.1f} MiB (max/mean over ranks {:.3f})", name,
                                   b["memory_max_bytes"].get<double>() / (1 << 20), b["memory_max_over_mean"].get<double>()));
    }
  }
  const int64_t first = any["first_timed_step"].get<int64_t>(), last = first + any["timed_steps"].get<int64_t>() - 1;
  if (pipeline) {
    fmt::print("times: means over steps {}..{} (--skip leaves out warm-up); step: the straggler's; wait+bubble: its "
               "pipe + idle + wait time, and its share of the step; served in idle: attention seconds (and share of all "
               "attention) computed by ranks in ticks without a micro-batch of their own, all ranks\n", first, last);
    fmt::print("memory per rank, the fullest rank's peak (parameters, gradients, AdamW moments and the gradient "
               "accumulator, micro-batch workspaces, attention buffers, stage messages in flight): {}; {}\n",
               fmt::join(memory, "; "),
               o.recompute ? std::string("--recompute: every stage holds as many workspaces as the last stage and "
                                         "recomputes the other micro-batches' linear activations (inside linear)")
                           : std::string("across stages the schedule decides (a stage holds as many workspaces as it has "
                                         "micro-batches in flight; --recompute evens it out)"));
  } else {
    fmt::print("times: means over steps {}..{} (--skip leaves out warm-up); step and attn are the straggler's, wait the "
               "longest any rank waited for it; bound: the step with compute perfectly balanced and communication free, "
               "a lower bound\n", first, last);
    fmt::print("memory per rank, the fullest rank's peak (parameters, gradients, AdamW moments, activations, attention "
               "buffers): {}\n", fmt::join(memory, "; "));
  }
  if (!s["speedup"].is_null()) {
    fmt::print("speedup of CAD over colocated{} (same run, same data): {:.2f}x; CAD step / CAD bound: {:.3f}; largest "
               "relative loss difference: {:.2e}\n", pipeline ? " 1F1B" : "",
               s["speedup"].get<double>(), s["cad_over_bound"].get<double>(), s["loss_max_rel_diff"].get<double>());
  }
}

// --print-schedule: the tick table of each backend's pipeline schedule; no training.
int print_schedules(const train::TrainOptions& o) {
  for (const std::string& name : o.backends) {
    auto s = plan::pipeline_schedule(name, o.pp, o.micro_batches == 0 ? 2 * o.pp : o.micro_batches);
    if (!s.is_ok()) {
      print_usage_error("train", s.status().message());
      return exit_code(s.status());
    }
    if (is_primary_process()) {
      fmt::print("{} schedule, {} stages x {} micro-batches ({} ticks; F3: forward of micro-batch 3, B: backward, .: "
                 "idle{}):\n{}",
                 name, o.pp, s.value().micro_batches, s.value().ticks.size(),
                 name == "cad" ? "; every stage in the same phase each tick, CA pooled over all ranks" : "; 1F1B",
                 s.value().to_text());
    }
  }
  return 0;
}

// Every rank's `mine` at rank 0 (others get an empty list): sizes, then the text, rank by rank.
Result<std::vector<nlohmann::json>> gather_json(comm::Communicator& c, const nlohmann::json& mine) {
  constexpr int kTag = 7301;
  const std::string text = mine.dump();
  std::vector<nlohmann::json> out;
  if (c.rank() != 0) {
    const int64_t size = static_cast<int64_t>(text.size());
    DISTCA_ASSIGN_OR_RETURN(auto w, c.send_async(&size, sizeof(size), 0, kTag));
    DISTCA_RETURN_IF_ERROR(w->wait());
    DISTCA_ASSIGN_OR_RETURN(auto v, c.send_async(text.data(), size, 0, kTag));
    DISTCA_RETURN_IF_ERROR(v->wait());
    return out;
  }
  out.push_back(mine);
  for (int r = 1; r < c.size(); ++r) {
    int64_t size = 0;
    DISTCA_ASSIGN_OR_RETURN(auto w, c.recv_async(&size, sizeof(size), r, kTag));
    DISTCA_RETURN_IF_ERROR(w->wait());
    if (size < 0 || size > (int64_t{1} << 34)) return internal_error(fmt::format("trace: rank {} sent a size of {}", r, size));
    std::string theirs(static_cast<size_t>(size), '\0');
    DISTCA_ASSIGN_OR_RETURN(auto v, c.recv_async(theirs.data(), size, r, kTag));
    DISTCA_RETURN_IF_ERROR(v->wait());
    out.push_back(nlohmann::json::parse(theirs));
  }
  return out;
}

int run_train(const TrainArgs& a) {
  Result<train::TrainOptions> options = resolve(a);
  if (!options.is_ok()) {
    print_usage_error("train", options.status().message());
    return exit_code(options.status());
  }
  if (a.is_print_schedule) return print_schedules(options.value());
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int busy = ranks_on_this_machine(a.ranks) * options.value().threads;
  if (cores > 0 && busy > cores && is_primary_process()) {
    fmt::print(stderr, "distca train: warning: {} rank(s) x {} thread(s) = {} busy threads on {} cores: ranks will "
                       "take turns on the cores, and the times measure that\n", ranks_on_this_machine(a.ranks),
               options.value().threads, busy, cores);
  }
  WorldOptions world;
  world.is_ranks_given = a.given(a.ranks_opt);
  world.timeout = timeout_from_seconds(a.timeout_seconds).value();
  return run_world("train", a.ranks, [&](comm::Communicator& c) -> Status {
    // This rank's spans (the last --trace-steps steps of every backend), from the first step.
    std::optional<trace::Recorder> recorder;
    // (A validation's spans are a step of their own: room for as many of them.)
    if (!a.trace_path.empty()) {
      recorder.emplace(a.trace_steps * static_cast<int64_t>(options.value().backends.size()) *
                       (options.value().eval_every > 0 ? 2 : 1));
    }
    trace::set_active(recorder ? &*recorder : nullptr);
    struct Off {
      ~Off() { trace::set_active(nullptr); }
    } off;
    DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<train::Trainer> trainer, train::make_trainer(c, options.value()));
    const train::TrainOptions& o = trainer->options();
    const bool is_root = c.rank() == 0;
    if (is_root) print_header(*trainer, c);
    if (a.given(a.skip_opt) && a.skip >= o.steps - trainer->steps_done()) {
      return invalid_argument(fmt::format("--skip {} leaves none of the {} steps after the checkpoint's step {} to time",
                                          a.skip, o.steps - trainer->steps_done(), trainer->steps_done()));
    }
    std::vector<train::StepRecord> records;
    std::vector<train::EvalRecord> evals;
    int64_t epoch = trainer->epoch();
    while (trainer->steps_done() < o.steps) {
      DISTCA_ASSIGN_OR_RETURN(std::vector<train::StepRecord> step, trainer->step());
      if (is_root && trainer->epoch() != epoch) {
        fmt::print("data: epoch {} begins in step {} (the source started again from its first document)\n",
                   trainer->epoch() + 1, trainer->steps_done());
      }
      epoch = trainer->epoch();
      for (train::StepRecord& r : step) {
        if (is_root) print_step(r, o);
        records.push_back(std::move(r));
      }
      if (o.eval_every > 0 && (trainer->steps_done() % o.eval_every == 0 || trainer->steps_done() == o.steps)) {
        DISTCA_ASSIGN_OR_RETURN(std::vector<train::EvalRecord> e, trainer->evaluate());
        for (const train::EvalRecord& r : e) {
          if (is_root) fmt::print("eval {:>4}/{} {:<9} validation loss {:.4f} over {} held-out targets\n", r.step, o.steps, r.backend, r.loss, r.targets);
          evals.push_back(r);
        }
        std::fflush(stdout);
      }
    }
    if (recorder) {
      trace::set_active(nullptr);
      DISTCA_ASSIGN_OR_RETURN(std::vector<nlohmann::json> ranks, gather_json(c, trace::to_json(*recorder)));
      if (is_root) {
        const nlohmann::json doc = trace::chrome_trace(ranks, {{"source", "distca train"}, {"ranks", c.size()}, {"config", o.to_json()}});
        DISTCA_RETURN_IF_ERROR(write_file_atomic(a.trace_path, doc.dump() + "\n"));
      }
    }
    if (!is_root) return Status::ok();
    const nlohmann::json summary = train::summarize(records, a.skip, o.pp);
    print_summary(summary, o);
    if (!o.checkpoint_path.empty()) fmt::print("checkpoint: {}\n", o.checkpoint_path);
    if (!a.json_path.empty()) {
      nlohmann::json steps = nlohmann::json::array();
      for (const train::StepRecord& r : records) steps.push_back(r.to_json());
      nlohmann::json validation = nlohmann::json::array();
      for (const train::EvalRecord& r : evals) validation.push_back(r.to_json());
      const nlohmann::json out = {{"format", kTrainFormat},  {"version", kTrainFormatVersion},
                                  {"ranks", c.size()},       {"comm", c.name()},
                                  {"preset", a.preset},      {"config", o.to_json()},
                                  {"data", trainer->data_description()},
                                  {"rank_map", trainer->rank_map().to_json()},
                                  {"steps", steps},          {"validation", validation},
                                  {"summary", summary}};
      DISTCA_RETURN_IF_ERROR(write_file_atomic(a.json_path, out.dump(2) + "\n"));
      fmt::print("wrote {}\n", a.json_path);
    }
    if (!a.trace_path.empty()) {
      fmt::print("wrote {} (the last {} step(s) of each backend on every rank: Chrome trace-event JSON for Perfetto or "
                 "chrome://tracing; python -m distca.torch.trace_report sums it)\n", a.trace_path, a.trace_steps);
    }
    return Status::ok();
  }, world);
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
  a.attention_opt = cmd->add_option("--attention", a.attention, "core attention backend: colocated | cad")
                        ->capture_default_str();
  cmd->add_flag("--compare", a.is_compare, "train colocated and CAD from the same weights on the same data, interleaved");
  cmd->add_option("--steps", a.steps, "optimizer steps (default: the preset's)");
  cmd->add_option("--context", a.context, "tokens per rank per step; with --tp, per data-parallel replica (its TP ranks share them) (default: the preset's)");
  cmd->add_option("--layers", a.layers, "transformer layers (default: the preset's)");
  cmd->add_option("--lr", a.lr, "peak learning rate (default: the preset's)");
  cmd->add_option("--warmup", a.warmup, "linear warm-up steps to the peak (default: the preset's)");
  cmd->add_option("--lr-schedule", a.lr_schedule, "after warm-up: constant | cosine | linear (decay to --min-lr at the last step)")
      ->capture_default_str();
  cmd->add_option("--min-lr", a.min_lr, "floor of the cosine and linear schedules (default: 0.1 x --lr)");
  cmd->add_option("--eval-every", a.eval_every, "validation loss every N steps and at the end (0: never)")->capture_default_str();
  a.eval_docs_opt = cmd->add_option("--eval-docs", a.eval_docs, "documents held out of a --data source for validation (the last ones)")
      ->capture_default_str();
  a.eval_steps_opt = cmd->add_option("--eval-steps", a.eval_steps, "held-out steps of R x context tokens per validation")->capture_default_str();
  cmd->add_option("--data", a.data, "a .jsonl file (a \"text\" field per line) or a directory of text files; "
                                    "default: the embedded synthetic source");
  a.workload_opt = cmd->add_option("--workload", a.workload,
                                   "document lengths of the synthetic source: pretrain | prolong | skewed (not with --data)");
  a.seed_opt = cmd->add_option("--seed", a.seed, "seed of the synthetic source (not with --data)")->capture_default_str();
  a.policy_opt = cmd->add_option("--policy", a.policy, "CAD planner: minlink (the least busy links) | minbytes (key-range splits) | minmax | distca | none")->capture_default_str();
  a.backward_opt = cmd->add_option("--backward-mode", a.backward_mode,
                                   "stateful (servers keep forward state) | stateless (the paper's)")
                       ->capture_default_str();
  a.grad_return_opt = cmd->add_option("--grad-return", a.grad_return,
                                      "bf16 | fp32: the dtype CAD's dK/dV partial sums cross ranks in on the backward "
                                      "return, summed in fp32 at the owner (bf16: half those bytes, one rounding per "
                                      "partial, as the paper)")
                          ->capture_default_str();
  a.pingpong_opt = cmd->add_option("--pingpong", a.pingpong,
                                   "on | off: split each step into two nano-batches whose attention dispatch and return "
                                   "overlap the other's compute (default: on for cad, off for colocated; with --pp each micro-batch splits in "
                                   "its ticks)");
  a.memory_budget_opt = cmd->add_option("--memory-budget", a.memory_budget,
                                        "MiB per rank a backend may hold (model states, activations, attention buffers), "
                                        "auto (1.05 x colocated's as configured) or unlimited: each step runs the first of "
                                        "as configured, without ping-pong, stateless (with, without ping-pong), attention "
                                        "colocated whose buffers fit; a budget too small for colocated stateless is refused")
                            ->capture_default_str();
  cmd->add_option("--progress", a.progress,
                  "with ping-pong, how the attention's transfers advance while a rank computes (MPI moves data only "
                  "inside MPI calls): poll (between the model's GEMMs) | thread (a progress thread) | none")
      ->capture_default_str();
  cmd->add_option("--progress-interval-us", a.progress_interval_us,
                  "with --progress thread, microseconds between its polls (10..100000)")
      ->capture_default_str();
  cmd->add_option("--grad-sync", a.grad_sync,
                  "the data-parallel gradient all-reduce: overlap (each layer's once the backward has finished it, "
                  "moving during the layers below; with ping-pong in slices queued behind the attention exchanges) | "
                  "eager (each layer's at once) | after (one all-reduce after the backward)")
      ->capture_default_str();
  cmd->add_option("--threads", a.threads, "BLAS and attention threads per rank")->capture_default_str();
  a.granularity_opt = cmd->add_option("--granularity", a.granularity,
                                      "planner shard granularity: a power of two 16..4096 (0: context / 32 rounded down to a power of two, 16..128)")
                          ->capture_default_str();
  a.tolerance_opt = cmd->add_option("--tolerance", a.tolerance, "planner load tolerance, 0..10")->capture_default_str();
  cmd->add_option("--json", a.json_path, "write per-step records and the summary to this file");
  cmd->add_option("--trace", a.trace_path,
                  "write every rank's timeline of the last --trace-steps steps to this file (Chrome trace-event JSON: "
                  "Perfetto, chrome://tracing): linear phases, server kernels, exchange calls and each exchange in "
                  "flight, waits, gradient sync, optimizer");
  cmd->add_option("--trace-steps", a.trace_steps, "steps of each backend --trace keeps (the last ones)")->capture_default_str();
  cmd->add_option("--checkpoint", a.checkpoint, "save the model and optimizer state here (at the end, and --save-every)");
  cmd->add_option("--save-every", a.save_every, "steps between checkpoints (0: only at the end)")->capture_default_str();
  cmd->add_option("--resume", a.resume, "continue from this checkpoint (same data, ranks and context)");
  a.ranks_opt = cmd->add_option("--ranks", a.ranks, "ranks to run as threads, 1..256 (not under mpirun: there -np sets them)")
                    ->capture_default_str();
  cmd->add_option("--tp", a.tp,
                  "tensor-parallel ranks per model replica (Megatron: heads and FFN split, all-reduce after Wo and "
                  "Wdown; divides the query heads, the FFN and the ranks); CAD dispatches each TP rank's heads to the "
                  "ranks of its TP index. Rank map: rank = (pp x dp_size + dp) x tp_size + tp, printed at the start")
      ->capture_default_str();
  a.pp_opt = cmd->add_option("--pp", a.pp,
                             "pipeline stages (divides the layers and the ranks): colocated runs 1F1B, cad lockstep ticks "
                             "with one plan per tick over all ranks")
                 ->capture_default_str();
  a.micro_batches_opt = cmd->add_option("--micro-batches", a.micro_batches,
                                        "with --pp: micro-batches per step, each --context tokens per rank (0: 2 x --pp)")
                            ->capture_default_str();
  cmd->add_flag("--recompute", a.is_recompute,
                "with --pp: every stage holds as many activation workspaces as the last one (the fewest micro-batches "
                "in flight) and recomputes the others' linear activations before their backward, from their stage "
                "input and saved attention outputs (bit-identical): memory even across stages for some linear compute");
  cmd->add_flag("--print-schedule", a.is_print_schedule,
                "with --pp: print the tick table of each schedule (which micro-batch each stage runs per tick) and exit");
  a.skip_opt = cmd->add_option("--skip", a.skip, "warm-up steps left out of the summary's time means (below --steps)")
                   ->capture_default_str();
  cmd->add_option("--timeout", a.timeout_seconds, kTimeoutHelp)->capture_default_str();
  return [args] { return run_train(*args); };
}

}  // namespace distca::tools
