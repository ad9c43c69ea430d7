#include "distca/model/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>

#include <fmt/format.h>

#include "distca/core/json.h"
#include "distca/core/stopwatch.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/model/checkpoint.h"
#include "distca/model/nano_chain.h"
#include "distca/model/optimizer.h"
#include "distca/runtime/pingpong.h"
#include "distca/plan/planner.h"

namespace distca::model {

namespace {
using Clock = SteadyClock;
}  // namespace

Status TrainOptions::validate() const {
  DISTCA_RETURN_IF_ERROR(model.validate());
  DISTCA_RETURN_IF_ERROR(optim.validate());
  if (context < 16 || context > plan::kMaxTokens) {
    return invalid_argument(fmt::format("--context must be 16..{} tokens per rank, got {}", plan::kMaxTokens, context));
  }
  if (steps < 1 || steps > 100000000) return invalid_argument(fmt::format("--steps must be >= 1, got {}", steps));
  if (backends.empty()) return invalid_argument("no attention backend to train with");
  for (const std::string& b : backends) {
    if (b != "colocated" && b != "cad") {
      return invalid_argument(fmt::format("--attention must be colocated or cad, got '{}'", b));
    }
  }
  DISTCA_RETURN_IF_ERROR(plan::find_planner(policy).status());
  if (grad_return != plan::GradReturn::kFp32 && grad_return != plan::GradReturn::kBf16) {
    return invalid_argument(fmt::format("--grad-return must be bf16 or fp32, got value {}", static_cast<int>(grad_return)));
  }
  if (tp < 1 || tp > 1024) return invalid_argument(fmt::format("--tp must be 1..1024, got {}", tp));
  if (tp > 1) {
    DISTCA_RETURN_IF_ERROR(tensor_parallel_shard(model, tp).status());
    if (!checkpoint_path.empty() || !resume_path.empty()) {
      return invalid_argument("--tp does not support --checkpoint or --resume yet (each rank holds a slice of the model): drop them");
    }
  }
  if (attention_link) DISTCA_RETURN_IF_ERROR(attention_link->validate());
  if (pingpong != "auto" && pingpong != "on" && pingpong != "off" && pingpong != "sequential") {
    return invalid_argument(fmt::format("--pingpong must be on or off (auto: on for cad, off for colocated), got '{}'", pingpong));
  }
  if (progress != "none" && progress != "poll" && progress != "thread") {
    return invalid_argument(fmt::format("--progress must be none, poll or thread, got '{}'", progress));
  }
  if (progress_interval_us < 10 || progress_interval_us > 100000) {
    return invalid_argument(fmt::format("--progress-interval-us must be 10..100000, got {}", progress_interval_us));
  }
  if (grad_sync != "overlap" && grad_sync != "eager" && grad_sync != "after") {
    return invalid_argument(fmt::format("--grad-sync must be overlap, eager or after, got '{}'", grad_sync));
  }
  if (threads < 1 || threads > 1024) return invalid_argument(fmt::format("--threads must be 1..1024, got {}", threads));
  if (granularity < 0) return invalid_argument(fmt::format("--granularity must be >= 0 (0: auto), got {}", granularity));
  if (!(tolerance >= 0) || tolerance > 10) return invalid_argument(fmt::format("--tolerance must be 0..10, got {}", tolerance));
  if (save_every < 0) return invalid_argument("--save-every must be >= 0");
  if (save_every > 0 && checkpoint_path.empty()) return invalid_argument("--save-every needs --checkpoint FILE");
  if (eval_every < 0 || eval_every > steps) {
    return invalid_argument(fmt::format("--eval-every must be 0 (never) to --steps ({}), got {}", steps, eval_every));
  }
  if (eval_docs < 1 || eval_docs > 10000000) return invalid_argument(fmt::format("--eval-docs must be >= 1, got {}", eval_docs));
  if (eval_steps < 1 || eval_steps > 10000) return invalid_argument(fmt::format("--eval-steps must be 1..10000, got {}", eval_steps));
  return Status::ok();
}

nlohmann::json TrainOptions::to_json() const {
  return {{"model", model::to_json(model)},
          {"optimizer", model::to_json(optim)},
          {"context", context},
          {"steps", steps},
          {"data", data_path.empty() ? "synthetic" : data_path},
          {"workload", workload},
          {"data_seed", data_seed},
          {"backends", backends},
          {"policy", policy},
          {"backward_mode", plan::backward_mode_name(backward_mode)},
          {"grad_return", plan::grad_return_name(grad_return)},
          {"tp", tp},
          {"pingpong", pingpong},
          {"progress", progress},
          {"progress_interval_us", progress_interval_us},
          {"grad_sync", grad_sync},
          {"threads", threads},
          {"granularity", granularity},
          {"tolerance", tolerance},
          {"eval_every", eval_every},
          {"eval_docs", eval_docs},
          {"eval_steps", eval_steps}};
}

nlohmann::json EvalRecord::to_json() const {
  return {{"step", step}, {"backend", backend}, {"loss", loss}, {"targets", targets}};
}

nlohmann::json StepRecord::to_json() const {
  return {{"step", step},
          {"backend", backend},
          {"loss", loss},
          {"grad_norm", grad_norm},
          {"lr", lr},
          {"step_seconds", step_seconds},
          {"tokens_per_second", tokens_per_second},
          {"slowest_rank", slowest_rank},
          {"linear_seconds", linear_seconds},
          {"attention_seconds", attention_seconds},
          {"comm_seconds", comm_seconds},
          {"grad_reduce_seconds", grad_reduce_seconds},
          {"wait_seconds", wait_seconds},
          {"optimizer_seconds", optimizer_seconds},
          {"other_seconds", other_seconds},
          {"attention_min_seconds", attention_min_seconds},
          {"attention_max_seconds", attention_max_seconds},
          {"wait_max_seconds", wait_max_seconds},
          {"attention_imbalance", attention_imbalance},
          {"bound_seconds", bound_seconds},
          {"attention_bytes", attention_bytes},
          {"attention_tasks", attention_tasks},
          {"split_tasks", split_tasks},
          {"nano_batches", nano_batches},
          {"memory_states_bytes", memory_states_bytes},
          {"memory_activations_bytes", memory_activations_bytes},
          {"memory_attention_max_bytes", memory_attention_max_bytes},
          {"memory_attention_mean_bytes", memory_attention_mean_bytes},
          {"memory_max_bytes", memory_max_bytes},
          {"memory_mean_bytes", memory_mean_bytes}};
}

MemoryEstimate estimate_memory(const TrainOptions& o, int ranks) {
  MemoryEstimate e;
  auto shard = tensor_parallel_shard(o.model, std::max(o.tp, 1));
  const ModelConfig m = shard.is_ok() ? shard.value() : o.model;
  ranks = std::max(ranks / std::max(o.tp, 1), 1);
  const int64_t f = static_cast<int64_t>(sizeof(float));
  // Parameters, gradients and two AdamW moments per backend.
  e.states_bytes = static_cast<int64_t>(o.backends.size()) * 4 * m.num_parameters() * f;
  e.activations_bytes = Model<float>::workspace_bytes(m, o.context);
  // The attention exchange: Q, K, V, O, their gradients and LSE for up to twice this rank's
  // rows (a server may take more than its own share), send and receive buffers; the stateful
  // backward keeps the forward's per layer.
  const int64_t row = 2 * (m.q_width() + m.kv_width()) + m.num_q_heads;
  const int64_t layers_kept = o.backward_mode == plan::BackwardMode::kStateful ? m.num_layers + 1 : 2;
  e.attention_bytes = 2 * (2 * o.context) * row * f * layers_kept;
  // Every rank packs the whole step (tokens, targets, positions of all ranks).
  e.data_bytes = 3 * static_cast<int64_t>(ranks) * o.context * static_cast<int64_t>(sizeof(int32_t));
  return e;
}

struct Trainer::Run {
  std::string name;
  std::unique_ptr<DispatchAttention> attention;
  bool pingpong = false;
  std::array<std::unique_ptr<DispatchAttention>, 2> nano;  // ping-pong: one backend per nano-batch
  ModelState<float> state;
};

// One step's forward and backward on this rank.
struct Trainer::Pass {
  double loss_sum = 0;    // over this rank's targets
  PassTimes times;        // the passes (ping-pong: the whole schedule)
  double setup = 0;       // planning's collectives: the plan-hash checks (communication)
  int64_t bytes = 0;      // sent by the attention backends
  int64_t attention_memory = 0;  // the backends' buffers at their peak (ping-pong: both, they coexist)
  int64_t tasks = 0, split_tasks = 0;
  int nano_batches = 1;
};

Trainer::Trainer(comm::Communicator& comm, TrainOptions options) : comm_(comm), options_(std::move(options)) {}
int64_t default_granularity(int64_t context) {
  int64_t g = 16;
  while (g * 2 <= std::min<int64_t>(context / 32, 128)) g *= 2;
  return g;
}

Trainer::~Trainer() = default;

ModelState<float>& Trainer::state(size_t i) { return runs_.at(i)->state; }
const plan::Plan& Trainer::last_plan(size_t i) const { return runs_.at(i)->attention->plan(); }

std::string Trainer::data_description() const { return packer_->source().describe(); }

Result<std::unique_ptr<Trainer>> Trainer::create(comm::Communicator& comm, TrainOptions options) {
  options.optim.total_steps = options.steps;  // a decaying schedule ends at the last step
  DISTCA_RETURN_IF_ERROR(options.validate());
  if (options.granularity == 0) options.granularity = default_granularity(options.context);
  // BLAS threads per rank, for every caller of the library (process-wide: ranks that are threads
  // of one process all set the same value). OpenBLAS's default, a thread per core for each call,
  // made the rank threads' BLAS workers spin against each other: 65 % of a LocalWorld test's CPU
  // time in exec_blas_async and sched_yield (perf).
  kernels::blas_set_num_threads(options.threads);
  auto t = std::unique_ptr<Trainer>(new Trainer(comm, std::move(options)));
  const TrainOptions& o = t->options_;
  DISTCA_ASSIGN_OR_RETURN(t->groups_, RankGroups::split(comm, o.tp, 1, o.model));
  comm::Communicator& dp = *t->groups_.dp;
  if (o.attention_link) t->link_ = std::make_unique<comm::EmulatedLink>(dp, *o.attention_link);
  comm::Communicator& attention_comm = t->link_ ? static_cast<comm::Communicator&>(*t->link_) : dp;
  const ModelConfig shard = tensor_parallel_shard(o.model, o.tp).value();
  std::unique_ptr<DocumentSource> source;
  if (o.data_path.empty()) {
    DISTCA_ASSIGN_OR_RETURN(source, make_synthetic_source(o.workload, o.context, o.data_seed));
  } else {
    DISTCA_ASSIGN_OR_RETURN(source, open_data_source(o.data_path));
  }
  if (o.eval_every > 0) {
    DISTCA_ASSIGN_OR_RETURN(auto held_out, source->hold_out(o.eval_docs));
    DISTCA_ASSIGN_OR_RETURN(t->validation_,
                            make_validation_steps(std::move(held_out), dp.size(), o.context, o.eval_steps));
  }
  t->packer_ = std::make_unique<Packer>(std::move(source), dp.size(), o.context);
  t->model_ = std::make_unique<Model<float>>(shard, o.context, LayerRange{}, tensor_parallel(t->groups_));
  for (const std::string& name : o.backends) {
    auto run = std::make_unique<Run>();
    run->name = name;
    DispatchAttentionOptions d;
    d.policy = name == "colocated" ? "none" : o.policy;
    d.backward_mode = o.backward_mode;
    d.grad_return = o.grad_return;
    d.threads = o.threads;
    d.tolerance = o.tolerance;
    d.granularity = o.granularity;
    DISTCA_ASSIGN_OR_RETURN(run->attention, DispatchAttention::create(attention_comm, shard, d));
    run->pingpong = o.pingpong == "on" || o.pingpong == "sequential" || (o.pingpong == "auto" && name == "cad");
    if (run->pingpong) {
      for (auto& nano : run->nano) {
        DISTCA_ASSIGN_OR_RETURN(nano, DispatchAttention::create(attention_comm, shard, d));
        // The server kernel polls the exchange in flight while it computes (--progress poll):
        // MPI moves a message only inside MPI calls, and a rank's attention may run for a good
        // part of a second while a peer waits on what it sent.
        if (o.progress == "poll") nano->set_poll([c = &attention_comm] { (void)c->progress(); });
      }
    }
    run->state = ModelState<float>::create(o.model, o.tp, t->groups_.me.tp);
    t->runs_.push_back(std::move(run));
  }
  if (o.grad_sync != "after" && dp.size() > 1 && o.tp == 1 && !t->runs_.empty()) {  // every backend's state has this layout
    DISTCA_ASSIGN_OR_RETURN(t->grad_sync_, GradientSync::create(dp, t->runs_.front()->state.grads));
    t->model_->set_grads_done([sync = t->grad_sync_.get()](GradsDone part) { sync->done(part); });
  }
  if (!o.resume_path.empty()) {
    std::vector<NamedState> states;
    for (auto& r : t->runs_) states.push_back({r->name, &r->state});
    DISTCA_ASSIGN_OR_RETURN(nlohmann::json header, load_checkpoint(o.resume_path, states));
    const nlohmann::json want = {{"data", t->packer_->source().identity()}, {"ranks", comm.size()}, {"context", o.context}};
    const nlohmann::json& got = header["run"];
    for (const auto& [key, value] : want.items()) {
      if (!got.contains(key) || got[key] != value) {
        return invalid_argument(fmt::format("{}: saved with {} = {}, this run has {}; resume with the same data, "
                                            "ranks and context to continue the same curve",
                                            o.resume_path, key, got.contains(key) ? json_excerpt(got[key]) : std::string("nothing"),
                                            json_excerpt(value)));
      }
    }
    t->step_ = header["step"].get<int64_t>();
    if (t->step_ >= o.steps) {
      return invalid_argument(fmt::format("{}: the checkpoint is at step {} and --steps is {}: nothing left to train; "
                                          "give --steps above {} to continue",
                                          o.resume_path, t->step_, o.steps, t->step_));
    }
    DISTCA_RETURN_IF_ERROR(t->packer_->skip(t->step_));
  }
  return t;
}

Status Trainer::save() const {
  if (options_.checkpoint_path.empty()) return invalid_argument("no checkpoint path");
  Status status = Status::ok();
  if (comm_.rank() == 0) {
    std::vector<NamedState> states;
    for (const auto& r : runs_) states.push_back({r->name, &r->state});
    const nlohmann::json run = {{"data", packer_->source().identity()}, {"ranks", comm_.size()}, {"context", options_.context}};
    status = save_checkpoint(options_.checkpoint_path, states, run);
  }
  // Every rank learns rank 0's error itself, so that whichever rank reports it, the user reads
  // the path and the reason.
  std::array<char, 1024> message{};
  if (!status.is_ok()) status.message().copy(message.data(), message.size() - 1);
  const Status sent = comm_.broadcast(message.data(), static_cast<int64_t>(message.size()), 0);
  if (!status.is_ok()) return status;
  DISTCA_RETURN_IF_ERROR(sent);
  if (message[0] != 0) return internal_error(message.data());
  return Status::ok();
}

Result<std::vector<StepRecord>> Trainer::step() {
  DISTCA_ASSIGN_OR_RETURN(StepData data, packer_->next());
  last_batch_ = data.batch;
  std::vector<StepRecord> records;
  for (auto& run : runs_) {
    DISTCA_ASSIGN_OR_RETURN(StepRecord r, step_one(*run, data));
    records.push_back(std::move(r));
  }
  ++step_;
  if (!options_.checkpoint_path.empty() && (step_ == options_.steps ||
                                            (options_.save_every > 0 && step_ % options_.save_every == 0))) {
    DISTCA_RETURN_IF_ERROR(save());
  }
  return records;
}

Result<std::vector<EvalRecord>> Trainer::evaluate() {
  DISTCA_CHECK(!validation_.empty()) << "evaluate() without held-out steps (eval_every is 0)";
  const int rank = groups_.me.dp;  // the replica's tokens (its TP ranks share them)
  std::vector<EvalRecord> out;
  for (auto& run : runs_) {
    // Sums over ranks and held-out steps of the loss and the targets; the forward alone (the
    // next training step's begin_step and forward overwrite what it leaves).
    std::array<float, 1> loss_sum{0};
    int64_t targets = 0;
    for (const StepData& data : validation_) {
      DISTCA_RETURN_IF_ERROR(run->attention->begin_step(data.batch));
      const StepTokens in{data.slice(data.tokens, rank), data.slice(data.targets, rank), data.slice(data.positions, rank)};
      DISTCA_ASSIGN_OR_RETURN(double loss, model_->forward(run->state, in, *run->attention, 1.0, nullptr));
      if (groups_.me.tp == 0) loss_sum[0] += static_cast<float>(loss);  // once per replica
      targets += data.num_targets;
    }
    DISTCA_RETURN_IF_ERROR(comm_.all_reduce_sum(loss_sum.data(), 1));
    EvalRecord r;
    r.step = step_;
    r.backend = run->name;
    r.targets = targets;
    r.loss = targets > 0 ? static_cast<double>(loss_sum[0]) / static_cast<double>(targets) : 0.0;
    if (!std::isfinite(r.loss)) return internal_error(fmt::format("validation at step {}: the loss is {} ({})", step_, r.loss, run->name));
    out.push_back(r);
  }
  return out;
}

namespace {

void count_plan(const plan::Plan& p, int64_t& tasks, int64_t& split) {
  for (const plan::Task& task : p.tasks) {
    ++tasks;
    split += task.k0 > 0 || !task.is_causal() ? 1 : 0;
  }
}

int64_t bytes_sent(const runtime::Dispatcher& d) {
  int64_t bytes = 0;
  for (int p = 0; p < plan::kNumPhases; ++p) bytes += d.stats(static_cast<plan::Phase>(p)).bytes_sent;
  return bytes;
}

}  // namespace

Result<Trainer::Pass> Trainer::whole_pass(Run& run, const StepData& data) {
  const int rank = groups_.me.dp;  // this replica's tokens
  DispatchAttention& attention = *run.attention;
  attention.times = {};
  Pass out;
  DISTCA_RETURN_IF_ERROR(attention.begin_step(data.batch));
  if (groups_.map.tp > 1) {
    const auto t0 = Clock::now();
    DISTCA_RETURN_IF_ERROR(check_same_plan(*groups_.tp, attention.plan().hash, fmt::format("step {} ({})", step_ + 1, run.name)));
    attention.times.comm += seconds_since(t0);
  }
  out.setup = attention.times.comm;
  const StepTokens in{data.slice(data.tokens, rank), data.slice(data.targets, rank), data.slice(data.positions, rank)};
  const double scale = data.num_targets > 0 ? 1.0 / static_cast<double>(data.num_targets) : 0.0;
  DISTCA_ASSIGN_OR_RETURN(out.loss_sum, model_->forward(run.state, in, attention, scale, &out.times));
  if (grad_sync_) {
    // The gradient all-reduces posted during the backward move while it computes: polled between
    // its GEMMs, or by a progress thread (--progress).
    DISTCA_RETURN_IF_ERROR(grad_sync_->begin(run.state.grads.data(), 1));
    std::optional<runtime::ProgressThread> progress;
    if (options_.progress == "poll") model_->set_poll([this] { (void)groups_.dp->progress(); });
    if (options_.progress == "thread") {
      progress.emplace([this] { return groups_.dp->progress(); }, std::chrono::microseconds(options_.progress_interval_us));
    }
    const Status st = model_->backward(run.state, attention, &out.times);
    model_->set_poll({});
    if (progress) DISTCA_RETURN_IF_ERROR(progress->stop());
    DISTCA_RETURN_IF_ERROR(st);
  } else {
    DISTCA_RETURN_IF_ERROR(model_->backward(run.state, attention, &out.times));
  }
  out.bytes = bytes_sent(*attention.dispatcher());
  out.attention_memory = attention.buffer_bytes();
  count_plan(attention.plan(), out.tasks, out.split_tasks);
  return out;
}

Result<Trainer::Pass> Trainer::pingpong_pass(Run& run, const StepData& data) {
  // One plan for the micro-batch, its tasks split between the nano-batches (runtime::split_plan):
  // together they move the whole step's bytes.
  DispatchAttention& planner = *run.nano[0];
  DISTCA_ASSIGN_OR_RETURN(plan::Plan whole, planner.plan_step(data.batch));
  // Stateful: B's servers keep the K/V rows A's forward brought them (held K/V), so the split may
  // cut inside a server's share of a document without moving its prefix twice.
  const bool hold_kv = options_.backward_mode == plan::BackwardMode::kStateful;
  DISTCA_ASSIGN_OR_RETURN(runtime::NanoSplit split, runtime::split_plan(data.batch, whole, planner.cost(), {.hold_kv = hold_kv}));
  const runtime::NanoBatches& nb = split.nano;
  // A step no split leaves work on both sides of (one short document) runs whole.
  if (nb.batches[0].num_docs() == 0 || nb.batches[1].num_docs() == 0) return whole_pass(run, data);
  const int rank = groups_.me.dp;
  Pass out;
  out.nano_batches = 2;
  for (int n = 0; n < 2; ++n) {
    DispatchAttention& att = *run.nano[n];
    att.times = {};
    DISTCA_RETURN_IF_ERROR(att.begin_step(nb.batches[n], std::move(split.plans[n]), /*is_part=*/n == 1,
                                          n == 1 ? std::move(split.held_kv) : std::vector<runtime::KvInterval>{},
                                          run.nano[0].get()));
    if (groups_.map.tp > 1) {
      const auto t0 = Clock::now();
      DISTCA_RETURN_IF_ERROR(check_same_plan(*groups_.tp, att.plan().hash,
                                             fmt::format("step {} ({}, nano-batch {})", step_ + 1, run.name, n)));
      att.times.comm += seconds_since(t0);
    }
    out.setup += att.times.comm;
  }
  // Each nano-batch's rows of this rank, gathered into a row slice of the one workspace.
  const std::span<const int32_t> tokens = data.slice(data.tokens, rank), targets = data.slice(data.targets, rank),
                                 positions = data.slice(data.positions, rank);
  std::array<NanoPass, 2> passes;
  std::array<std::unique_ptr<Model<float>>, 2> slices;
  int64_t first_row = 0;
  const double scale = data.num_targets > 0 ? 1.0 / static_cast<double>(data.num_targets) : 0.0;
  for (int n = 0; n < 2; ++n) {
    const std::vector<int64_t>& rows = nb.rows[n][rank];
    std::array<std::vector<int32_t>, 3>& ids = nano_ids_[n];
    for (auto& v : ids) v.clear();
    for (int64_t r : rows) {
      ids[0].push_back(tokens[r]);
      ids[1].push_back(targets[r]);
      ids[2].push_back(positions[r]);
    }
    const auto count = static_cast<int64_t>(rows.size());
    slices[n] = model_->slice(first_row, count);
    if (options_.progress == "poll") slices[n]->set_poll([this] { (void)attention_comm().progress(); });
    first_row += count;
    passes[n] = NanoPass{slices[n].get(), &run.state, run.nano[n].get(), StepTokens{ids[0], ids[1], ids[2]},
                         nullptr, nullptr, scale, 0};
  }
  // B's layout begins with A's last rows (the prefixes of the documents the split shares): B
  // reads their K/V, and its backward runs first so that A adds their dK/dV before its own
  // linear backward. Every rank knows whether any rank has such rows: the same schedule on all.
  const bool shares_rows = std::any_of(nb.context_rows.begin(), nb.context_rows.end(), [](int64_t r) { return r > 0; });
  if (shares_rows) {
    const ModelConfig& c = slices[1]->config();
    context_ = ContextRows{nb.context_rows[rank], c.q_width(), c.kv_width(), c.num_q_heads, {}, {}, {}, {}};
    const auto floats = static_cast<size_t>((context_.rows + slices[1]->max_tokens()) * context_.kv_row);
    context_.dk.resize(floats);
    context_.dv.resize(floats);
    context_.layer_dk.assign(static_cast<size_t>(slices[1]->num_stage_layers()), {});
    context_.layer_dv.assign(static_cast<size_t>(slices[1]->num_stage_layers()), {});
    for (int n = 0; n < 2; ++n) {
      passes[n].context = &context_;
      passes[n].context_reader = n == 1;
    }
  }
  std::array<std::vector<runtime::Stage>, 2> chains;
  const int forward_count = static_cast<int>(forward_stages(passes[0]).size());
  for (int n = 0; n < 2; ++n) chains[n] = joined(forward_stages(passes[n]), backward_stages(passes[n]));
  // The joined chain's stage forward_count is the first backward attention: B leads from there.
  const int b_leads_from = shares_rows ? forward_count : -1;
  run.state.grads.fill(0.0f);  // both nano-batches add theirs
  if (grad_sync_) {
    // Paced: a slice of the ready gradients' sums posted right after each backward attention
    // exchange (stage forward_count - 1 joins the forward's end to the backward's first), so
    // that on the link they queue behind it rather than ahead of the next.
    int64_t paced = 0;
    if (options_.grad_sync == "overlap") {
      for (auto& chain : chains) {
        for (size_t i = static_cast<size_t>(std::max(forward_count - 1, 0)); i < chain.size(); ++i) {
          if (!chain[i].start_comm) continue;
          chain[i].start_comm = [start = std::move(chain[i].start_comm), this]() -> Status {
            DISTCA_RETURN_IF_ERROR(start());
            grad_sync_->pace();
            return Status::ok();
          };
          ++paced;
        }
      }
    }
    DISTCA_RETURN_IF_ERROR(grad_sync_->begin(run.state.grads.data(), 2, paced));
  }
  const auto t0 = Clock::now();
  std::optional<runtime::ProgressThread> progress;
  if (options_.progress == "thread") {
    progress.emplace([this] { return attention_comm().progress(); }, std::chrono::microseconds(options_.progress_interval_us));
  }
  DISTCA_RETURN_IF_ERROR((options_.pingpong == "sequential" ? runtime::run_sequential(chains[0], chains[1], b_leads_from)
                                                              : runtime::run_pingpong(chains[0], chains[1], b_leads_from))
                             .status());
  if (progress) DISTCA_RETURN_IF_ERROR(progress->stop());
  DISTCA_RETURN_IF_ERROR(slices[0]->reduce_shared_grads(run.state));
  out.times.total = seconds_since(t0);
  for (int n = 0; n < 2; ++n) {
    const DispatchAttention& att = *run.nano[n];
    out.loss_sum += passes[n].loss;
    out.times.attention += att.times.compute;
    out.times.comm += att.times.comm + slices[n]->tp_seconds();
    out.bytes += bytes_sent(*att.dispatcher());
    out.attention_memory += att.buffer_bytes();
    count_plan(att.plan(), out.tasks, out.split_tasks);
  }
  if (shares_rows) out.attention_memory += static_cast<int64_t>((context_.dk.size() + context_.dv.size()) * sizeof(float));
  out.times.comm -= out.setup;  // the plan checks ran before the passes
  return out;
}

Result<StepRecord> Trainer::step_one(Run& run, const StepData& data) {
  const int R = comm_.size();
  const auto begin = Clock::now();
  DISTCA_ASSIGN_OR_RETURN(Pass p, run.pingpong ? pingpong_pass(run, data) : whole_pass(run, data));
  const PassTimes& pass = p.times;
  const double setup = p.setup;
  const double loss_sum = p.loss_sum;
  auto t = Clock::now();
  DISTCA_RETURN_IF_ERROR(comm_.barrier());
  const double wait = seconds_since(t);
  t = Clock::now();
  if (grad_sync_) {
    DISTCA_RETURN_IF_ERROR(grad_sync_->finish());  // what the backward left in flight
  } else if (groups_.dp->size() > 1) {
    DISTCA_RETURN_IF_ERROR(groups_.dp->all_reduce_sum(run.state.grads.data(), run.state.grads.size()));
  }
  // The global norm: with TP, every rank's slice of the sharded blocks, the replicated ones once.
  DISTCA_ASSIGN_OR_RETURN(const double squares, gradient_square_sum(run.state, 0, run.state.grads.size(), groups_));
  const double reduce = seconds_since(t);
  t = Clock::now();
  const double lr = options_.optim.lr_at(run.state.step);
  const double norm = std::sqrt(squares);
  adamw_step_range(run.state, options_.optim, 0, run.state.params.size(), norm);
  const double optimizer = seconds_since(t);
  const double step_seconds = seconds_since(begin);
  // Every rank's numbers, one slot each.
  const int64_t bytes = p.bytes;
  // Attention buffer bytes travel as two floats of 24 bits each, so they arrive exact.
  enum Slot { kStep, kLinear, kAttention, kComm, kWait, kOptimizer, kLoss, kBytes, kAttnMemHigh, kAttnMemLow, kReduce, kSlots };
  const int64_t attn_memory = p.attention_memory;
  std::vector<float> all(static_cast<size_t>(kSlots * R), 0.0f);
  const double mine[kSlots] = {step_seconds, pass.linear(), pass.attention, pass.comm + setup + reduce, wait, optimizer,
                               groups_.me.tp == 0 ? loss_sum : 0.0,  // a replica's loss once
                               static_cast<double>(bytes), static_cast<double>(attn_memory >> 24),
                               static_cast<double>(attn_memory & ((int64_t{1} << 24) - 1)), reduce};
  for (int i = 0; i < kSlots; ++i) all[comm_.rank() * kSlots + i] = static_cast<float>(mine[i]);
  DISTCA_RETURN_IF_ERROR(comm_.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  auto at = [&](int r, int i) { return static_cast<double>(all[r * kSlots + i]); };
  StepRecord rec;
  rec.step = step_ + 1;
  rec.attention_tasks = p.tasks;  // the same plans on every rank (hash-checked)
  rec.split_tasks = p.split_tasks;
  rec.nano_batches = p.nano_batches;
  rec.backend = run.name;
  rec.grad_norm = norm;
  rec.lr = lr;
  double loss = 0, attn_sum = 0, compute_sum = 0, serial_max = 0;
  rec.attention_min_seconds = at(0, kAttention);
  for (int r = 0; r < R; ++r) {
    loss += at(r, kLoss);
    rec.attention_bytes += static_cast<int64_t>(at(r, kBytes));
    const int64_t rank_attn_memory = (static_cast<int64_t>(at(r, kAttnMemHigh)) << 24) + static_cast<int64_t>(at(r, kAttnMemLow));
    rec.memory_attention_max_bytes = std::max(rec.memory_attention_max_bytes, rank_attn_memory);
    rec.memory_attention_mean_bytes += static_cast<double>(rank_attn_memory) / R;
    // The straggler: the rank that worked longest (step less waiting), whom the others waited
    // for. Every rank's step ends at the same all-reduce, so step time alone would pick a rank
    // by noise (often one that spent most of its step waiting).
    const int w = rec.slowest_rank;
    if (at(r, kStep) - at(r, kWait) > at(w, kStep) - at(w, kWait)) rec.slowest_rank = r;
    attn_sum += at(r, kAttention);
    rec.attention_min_seconds = std::min(rec.attention_min_seconds, at(r, kAttention));
    rec.attention_max_seconds = std::max(rec.attention_max_seconds, at(r, kAttention));
    rec.wait_max_seconds = std::max(rec.wait_max_seconds, at(r, kWait));
    compute_sum += at(r, kLinear) + at(r, kOptimizer) + at(r, kAttention);
    serial_max = std::max(serial_max, at(r, kLinear) + at(r, kOptimizer));
  }
  // The straggler's own parts (the all-reduce rounds each to float: "other" closes the sum).
  const int s = rec.slowest_rank;
  rec.step_seconds = at(s, kStep);
  rec.linear_seconds = at(s, kLinear);
  rec.attention_seconds = at(s, kAttention);
  rec.comm_seconds = at(s, kComm);
  rec.grad_reduce_seconds = at(s, kReduce);
  rec.wait_seconds = at(s, kWait);
  rec.optimizer_seconds = at(s, kOptimizer);
  rec.other_seconds = rec.step_seconds - rec.linear_seconds - rec.attention_seconds - rec.comm_seconds -
                      rec.wait_seconds - rec.optimizer_seconds;
  rec.loss = data.num_targets > 0 ? loss / static_cast<double>(data.num_targets) : 0.0;
  const double attn_mean = attn_sum / R;
  rec.attention_imbalance = attn_mean > 0 ? rec.attention_max_seconds / attn_mean : 1.0;
  rec.bound_seconds = std::max(serial_max, compute_sum / R);
  rec.memory_states_bytes = 4 * run.state.params.size() * static_cast<int64_t>(sizeof(float));
  rec.memory_activations_bytes = model_->allocated_bytes();
  rec.memory_max_bytes = rec.memory_states_bytes + rec.memory_activations_bytes + rec.memory_attention_max_bytes;
  rec.memory_mean_bytes = static_cast<double>(rec.memory_states_bytes + rec.memory_activations_bytes) + rec.memory_attention_mean_bytes;
  rec.tokens_per_second = static_cast<double>(groups_.map.dp * options_.context) / rec.step_seconds;
  if (!std::isfinite(rec.loss)) return internal_error(fmt::format("step {}: the loss is {} ({})", rec.step, rec.loss, run.name));
  return rec;
}

nlohmann::json summarize(const std::vector<StepRecord>& records, int64_t skip) {
  DISTCA_CHECK(!records.empty()) << "summarize needs at least one step record";
  std::map<std::string, std::vector<const StepRecord*>> by;
  std::vector<std::string> order;
  for (const StepRecord& r : records) {
    if (!by.contains(r.backend)) order.push_back(r.backend);
    by[r.backend].push_back(&r);
  }
  nlohmann::json out;
  nlohmann::json backends = nlohmann::json::object();
  for (const std::string& name : order) {
    const auto& rs = by[name];
    const size_t n = rs.size();
    const size_t first = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(skip, 0)), n - 1);
    auto mean = [&](double StepRecord::*field, size_t from, size_t to) {
      double s = 0;
      for (size_t i = from; i < to; ++i) s += rs[i]->*field;
      return to > from ? s / static_cast<double>(to - from) : 0.0;
    };
    const size_t k = n == 1 ? 1 : std::min<size_t>(10, n / 2);
    // The peak over the run of the fullest rank's memory, and the largest max / mean over ranks.
    int64_t peak_memory = 0;
    double memory_ratio = 1;
    for (const StepRecord* r : rs) {
      peak_memory = std::max(peak_memory, r->memory_max_bytes);
      if (r->memory_mean_bytes > 0) memory_ratio = std::max(memory_ratio, static_cast<double>(r->memory_max_bytes) / r->memory_mean_bytes);
    }
    backends[name] = {{"steps", n},
                      {"timed_steps", n - first},
                      {"first_timed_step", rs[first]->step},
                      {"step_seconds", mean(&StepRecord::step_seconds, first, n)},
                      {"tokens_per_second", mean(&StepRecord::tokens_per_second, first, n)},
                      {"linear_seconds", mean(&StepRecord::linear_seconds, first, n)},
                      {"attention_seconds", mean(&StepRecord::attention_seconds, first, n)},
                      {"comm_seconds", mean(&StepRecord::comm_seconds, first, n)},
                      {"wait_seconds", mean(&StepRecord::wait_seconds, first, n)},
                      {"optimizer_seconds", mean(&StepRecord::optimizer_seconds, first, n)},
                      {"other_seconds", mean(&StepRecord::other_seconds, first, n)},
                      {"wait_max_seconds", mean(&StepRecord::wait_max_seconds, first, n)},
                      {"attention_imbalance", mean(&StepRecord::attention_imbalance, first, n)},
                      {"bound_seconds", mean(&StepRecord::bound_seconds, first, n)},
                      {"memory_max_bytes", peak_memory},
                      {"memory_max_over_mean", memory_ratio},
                      {"loss_steps", k},
                      {"loss_first", mean(&StepRecord::loss, 0, k)},
                      {"loss_last", mean(&StepRecord::loss, n - k, n)}};
    out[name + "_step_seconds"] = backends[name]["step_seconds"];
  }
  out["backends"] = backends;
  const std::string base = by.contains("colocated") ? "colocated" : order.front();
  out["loss_first"] = backends[base]["loss_first"];
  out["loss_last"] = backends[base]["loss_last"];
  if (by.contains("colocated") && by.contains("cad")) {
    const double col = backends["colocated"]["step_seconds"], cad = backends["cad"]["step_seconds"];
    out["speedup"] = cad > 0 ? col / cad : 0.0;
    const double bound = backends["cad"]["bound_seconds"];
    out["cad_over_bound"] = bound > 0 ? cad / bound : 0.0;
    double worst = 0;
    const auto& a = by["colocated"];
    const auto& b = by["cad"];
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      worst = std::max(worst, std::abs(a[i]->loss - b[i]->loss) / std::max(std::abs(a[i]->loss), 1e-30));
    }
    out["loss_max_rel_diff"] = worst;
  } else {
    out["speedup"] = nullptr;
    out["cad_over_bound"] = nullptr;
    out["loss_max_rel_diff"] = nullptr;
  }
  return out;
}

}  // namespace distca::model
