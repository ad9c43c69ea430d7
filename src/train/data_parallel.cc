#include "distca/train/data_parallel.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "distca/core/json.h"
#include "distca/core/stopwatch.h"
#include "distca/core/trace.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/layout/step_split.h"
#include "distca/model/checkpoint.h"
#include "distca/model/optimizer.h"
#include "distca/plan/planner.h"
#include "distca/runtime/pingpong.h"

namespace distca::train {

namespace {
using Clock = SteadyClock;
}  // namespace

struct DataParallelTrainer::Run {
  std::string name;
  std::unique_ptr<DispatchAttention> attention;
  bool pingpong = false;
  std::array<std::unique_ptr<DispatchAttention>, 2> nano;  // ping-pong: one backend per nano-batch
  model::ModelState<float> state;
};

// One step's forward and backward on this rank.
struct DataParallelTrainer::Pass {
  double loss_sum = 0;    // over this rank's targets
  model::PassTimes times;        // the passes (ping-pong: the whole schedule)
  double setup = 0;       // planning's collectives: the plan-hash checks (communication)
  int64_t bytes = 0;      // sent by the attention backends
  int64_t attention_memory = 0;  // the backends' buffers at their peak (ping-pong: both, they coexist)
  int64_t tasks = 0, split_tasks = 0;
  int nano_batches = 1;
  plan::BackwardMode mode = plan::BackwardMode::kStateful;
  bool colocated_plan = false;  // a budget nothing else fitted: the step's attention colocated
  int64_t predicted = 0;        // the fullest rank's bytes, predicted (under a budget)
  int64_t budget = 0;           // the step's (0: none)
};

DataParallelTrainer::DataParallelTrainer(comm::Communicator& comm, TrainOptions options) : comm_(comm), options_(std::move(options)) {}
DataParallelTrainer::~DataParallelTrainer() = default;

model::ModelState<float>& DataParallelTrainer::state(size_t i) { return runs_.at(i)->state; }
const plan::Plan& DataParallelTrainer::last_plan(size_t i) const { return runs_.at(i)->attention->plan(); }

StepPlans DataParallelTrainer::last_plans(size_t backend) const {
  return {{last_batch_}, {TickPlan{false, -1, {0}, last_batch_, last_plan(backend).tasks}}};
}

std::string DataParallelTrainer::data_description() const { return packer_->source().describe(); }

Result<std::unique_ptr<DataParallelTrainer>> DataParallelTrainer::create(comm::Communicator& comm, TrainOptions options) {
  options.optim.total_steps = options.steps;  // a decaying schedule ends at the last step
  if (options.pp != 1) return invalid_argument(fmt::format("the data-parallel trainer runs one stage, got --pp {}", options.pp));
  DISTCA_RETURN_IF_ERROR(options.validate(comm.size()));
  if (options.granularity == 0) options.granularity = default_granularity(options.context);
  // BLAS threads per rank, for every caller of the library (process-wide: ranks that are threads
  // of one process all set the same value). OpenBLAS's default, a thread per core for each call,
  // made the rank threads' BLAS workers spin against each other: 65 % of a LocalWorld test's CPU
  // time in exec_blas_async and sched_yield (perf).
  kernels::blas_set_num_threads(options.threads);
  auto t = std::unique_ptr<DataParallelTrainer>(new DataParallelTrainer(comm, std::move(options)));
  const TrainOptions& o = t->options_;
  DISTCA_ASSIGN_OR_RETURN(t->groups_, RankGroups::split(comm, o.tp, 1, o.model));
  comm::Communicator& dp = *t->groups_.dp;
  if (o.attention_link) t->link_ = std::make_unique<comm::EmulatedLink>(dp, *o.attention_link);
  comm::Communicator& attention_comm = t->link_ ? static_cast<comm::Communicator&>(*t->link_) : dp;
  const model::ModelConfig shard = model::tensor_parallel_shard(o.model, o.tp).value();
  DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<DocumentSource> source,
                          open_training_source(o.data_path, o.workload, o.context, o.data_seed));
  if (o.eval_every > 0) {
    DISTCA_ASSIGN_OR_RETURN(auto held_out, source->hold_out(o.eval_docs));
    DISTCA_ASSIGN_OR_RETURN(t->validation_,
                            make_validation_steps(std::move(held_out), dp.size(), o.context, o.eval_steps));
  }
  t->packer_ = std::make_unique<Packer>(std::move(source), dp.size(), o.context);
  t->model_ = std::make_unique<model::Model<float>>(shard, o.context, model::LayerRange{}, tensor_parallel(t->groups_));
  t->shard_ = shard;
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
      for (int n = 0; n < 2; ++n) run->nano[n]->set_trace_nano(n);
    }
    run->state = model::ModelState<float>::create(o.model, o.tp, t->groups_.me.tp);
    t->runs_.push_back(std::move(run));
  }
  if (o.memory_budget != 0 && !t->runs_.empty()) {
    // The least any step's attention can do with: each rank's own rows colocated, stateless, on
    // a batch of a document per rank (a document that continues from the rank before brings
    // its prefix's K/V along).
    DISTCA_ASSIGN_OR_RETURN(plan::Batch any, plan::batch_from_ranks(std::vector<std::vector<int64_t>>(
                                                                         static_cast<size_t>(dp.size()), {o.context}),
                                                                     o.context));
    DISTCA_ASSIGN_OR_RETURN(plan::Plan local, plan::plan_none(any, t->runs_.front()->attention->cost(), {}));
    DISTCA_ASSIGN_OR_RETURN(t->floor_, t->whole_bytes(*t->runs_.front(), any, local, plan::BackwardMode::kStateless));
    t->budget_ = o.memory_budget;
    if (t->budget_ > 0 && t->budget_ < t->floor_) {
      return invalid_argument(fmt::format("--memory-budget {:.3f} MiB is below what any plan needs on a rank: {:.3f} MiB "
                                          "(model states, activations and its own rows' attention, stateless); give at "
                                          "least that, or unlimited",
                                          static_cast<double>(t->budget_) / (1 << 20), static_cast<double>(t->floor_) / (1 << 20)));
    }
  }
  if (o.grad_sync != "after" && dp.size() > 1 && o.tp == 1 && !t->runs_.empty()) {  // every backend's state has this layout
    DISTCA_ASSIGN_OR_RETURN(t->grad_sync_, GradientSync::create(dp, t->runs_.front()->state.grads));
    t->model_->set_grads_done([sync = t->grad_sync_.get()](model::GradsDone part) { sync->done(part); });
  }
  if (!o.resume_path.empty()) {
    std::vector<model::NamedState> states;
    for (auto& r : t->runs_) states.push_back({r->name, &r->state});
    DISTCA_ASSIGN_OR_RETURN(nlohmann::json header, model::load_checkpoint(o.resume_path, states));
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

Status DataParallelTrainer::save() const {
  if (options_.checkpoint_path.empty()) return invalid_argument("no checkpoint path");
  Status status = Status::ok();
  if (comm_.rank() == 0) {
    std::vector<model::NamedState> states;
    for (const auto& r : runs_) states.push_back({r->name, &r->state});
    const nlohmann::json run = {{"data", packer_->source().identity()}, {"ranks", comm_.size()}, {"context", options_.context}};
    status = model::save_checkpoint(options_.checkpoint_path, states, run);
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

Result<std::vector<StepRecord>> DataParallelTrainer::step() {
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

Result<std::vector<EvalRecord>> DataParallelTrainer::evaluate() {
  DISTCA_CHECK(!validation_.empty()) << "evaluate() without held-out steps (eval_every is 0)";
  const int rank = groups_.me.dp;  // the replica's tokens (its TP ranks share them)
  std::vector<EvalRecord> out;
  for (auto& run : runs_) {
    // Sums over ranks and held-out steps of the loss and the targets; the forward alone (the
    // next training step's begin_step and forward overwrite what it leaves).
    std::array<float, 1> loss_sum{0};
    int64_t targets = 0;
    // The forward alone keeps nothing for a backward: stateless holds one layer's buffers.
    if (budget_ != 0) run->attention->set_backward_mode(plan::BackwardMode::kStateless);
    // Its spans are a "step" of their own in the trace, not the last training step's.
    if (trace::Recorder* tr = trace::active()) tr->begin_step(fmt::format("{} validation-{}", step_, run->name));
    for (const StepData& data : validation_) {
      DISTCA_RETURN_IF_ERROR(run->attention->begin_step(data.batch));
      const model::StepTokens in{data.slice(data.tokens, rank), data.slice(data.targets, rank), data.slice(data.positions, rank)};
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

int64_t DataParallelTrainer::fixed_bytes(const Run& run) const {
  return 4 * static_cast<int64_t>(run.state.params.size() * sizeof(float)) + model_->allocated_bytes();
}

Result<int64_t> DataParallelTrainer::whole_bytes(const Run& run, const plan::Batch& batch, const plan::Plan& plan,
                                                 plan::BackwardMode mode) const {
  DISTCA_ASSIGN_OR_RETURN(std::vector<int64_t> ranks,
                          DispatchAttention::predict_bytes(batch, plan.tasks, shard_, mode, options_.grad_return));
  return fixed_bytes(run) + *std::max_element(ranks.begin(), ranks.end());
}

Result<int64_t> DataParallelTrainer::pingpong_bytes(const Run& run, const layout::NanoSplit& split,
                                                    plan::BackwardMode mode) const {
  const layout::NanoBatches& nb = split.nano;
  DISTCA_ASSIGN_OR_RETURN(std::vector<int64_t> a, DispatchAttention::predict_bytes(nb.batches[0], split.plans[0].tasks, shard_, mode,
                                                                                   options_.grad_return, true, {},
                                                                                   !split.held_kv.empty()));
  DISTCA_ASSIGN_OR_RETURN(std::vector<int64_t> b, DispatchAttention::predict_bytes(nb.batches[1], split.plans[1].tasks, shard_, mode,
                                                                                   options_.grad_return, true, split.held_kv));
  const bool shares_rows = std::any_of(nb.context_rows.begin(), nb.context_rows.end(), [](int64_t r) { return r > 0; });
  int64_t most = 0;
  for (size_t r = 0; r < a.size(); ++r) {
    int64_t bytes = a[r] + b[r];
    if (shares_rows) {
      // B's backward return of its rows and the context rows (ContextRows::dk, dv), and the
      // context rows' dK/dV held until A adds them: every layer's at most (the sequential
      // schedule runs B's whole backward first).
      const int64_t kv_row = shard_.kv_width(), ctx = nb.context_rows[r];
      bytes += 2 * (ctx + static_cast<int64_t>(nb.rows[1][r].size())) * kv_row * 4 + shard_.num_layers * 2 * ctx * kv_row * 4;
    }
    most = std::max(most, bytes);
  }
  return fixed_bytes(run) + most;
}

Result<DataParallelTrainer::Pass> DataParallelTrainer::run_pass(Run& run, const StepData& data) {
  DISTCA_ASSIGN_OR_RETURN(plan::Plan whole, run.attention->plan_step(data.batch));
  // The step's budget: auto, kAutoBudgetRatio x what colocated attention needs on this batch as
  // configured (a document continued from the rank before brings its prefix's K/V).
  int64_t budget = budget_;
  std::optional<plan::Plan> local;
  if (budget_ != 0) {
    DISTCA_ASSIGN_OR_RETURN(local, plan::plan_none(data.batch, run.attention->cost(), {}));
    if (budget_ == TrainOptions::kAutoBudget) {
      DISTCA_ASSIGN_OR_RETURN(const int64_t colocated, whole_bytes(run, data.batch, *local, options_.backward_mode));
      budget = static_cast<int64_t>(TrainOptions::kAutoBudgetRatio * static_cast<double>(colocated));
    }
  }
  // The configurations in order of preference: as configured, then without ping-pong, then
  // stateless (the backward sends Q/K/V/O/LSE again instead of keeping them per layer).
  struct Choice {
    bool pingpong;
    plan::BackwardMode mode;
  };
  const plan::BackwardMode configured = options_.backward_mode;
  std::vector<Choice> choices;
  if (run.pingpong) choices.push_back({true, configured});
  choices.push_back({false, configured});
  if (configured == plan::BackwardMode::kStateful) {
    if (run.pingpong) choices.push_back({true, plan::BackwardMode::kStateless});
    choices.push_back({false, plan::BackwardMode::kStateless});
  }
  if (budget == 0) choices.resize(run.pingpong ? 2 : 1);  // as configured (a split that leaves a side empty runs whole)
  for (const Choice& c : choices) {
    if (c.pingpong) {
      // Stateful: B's servers keep the K/V rows A's forward brought them (held K/V), so the
      // split may cut inside a server's share of a document without moving its prefix twice.
      DISTCA_ASSIGN_OR_RETURN(layout::NanoSplit split,
                              layout::split_step(data.batch, whole, run.attention->cost(),
                                                 {.hold_kv = c.mode == plan::BackwardMode::kStateful}));
      // A step no split leaves work on both sides of (one short document) runs whole.
      if (split.nano.batches[0].num_docs() == 0 || split.nano.batches[1].num_docs() == 0) continue;
      int64_t predicted = 0;
      if (budget != 0) {
        DISTCA_ASSIGN_OR_RETURN(predicted, pingpong_bytes(run, split, c.mode));
        if (predicted > budget) continue;
      }
      run.attention->release();
      DISTCA_ASSIGN_OR_RETURN(Pass p, pingpong_pass(run, data, std::move(split), c.mode));
      p.predicted = predicted;
      p.budget = budget;
      return p;
    }
    int64_t predicted = 0;
    if (budget != 0) {
      DISTCA_ASSIGN_OR_RETURN(predicted, whole_bytes(run, data.batch, whole, c.mode));
      if (predicted > budget) continue;
    }
    for (auto& nano : run.nano) {
      if (nano) nano->release();
    }
    DISTCA_ASSIGN_OR_RETURN(Pass p, whole_pass(run, data, std::move(whole), c.mode));
    p.predicted = predicted;
    p.budget = budget;
    return p;
  }
  // Nothing fits: this step's attention colocated, stateless (under auto it always fits).
  DISTCA_ASSIGN_OR_RETURN(const int64_t predicted, whole_bytes(run, data.batch, *local, plan::BackwardMode::kStateless));
  if (predicted > budget) {
    return invalid_argument(fmt::format("step {} ({}): no configuration fits --memory-budget {:.3f} MiB on this batch; "
                                        "the least, attention colocated and stateless, needs {:.3f} MiB on its fullest "
                                        "rank (a document continued from the rank before brings its prefix's K/V): raise "
                                        "--memory-budget, or give auto or unlimited",
                                        step_ + 1, run.name, static_cast<double>(budget) / (1 << 20),
                                        static_cast<double>(predicted) / (1 << 20)));
  }
  for (auto& nano : run.nano) {
    if (nano) nano->release();
  }
  DISTCA_ASSIGN_OR_RETURN(Pass p, whole_pass(run, data, std::move(*local), plan::BackwardMode::kStateless));
  p.colocated_plan = run.name != "colocated";
  p.predicted = predicted;
  p.budget = budget;
  return p;
}

Result<DataParallelTrainer::Pass> DataParallelTrainer::whole_pass(Run& run, const StepData& data, plan::Plan plan,
                                                                  plan::BackwardMode mode) {
  const int rank = groups_.me.dp;  // this replica's tokens
  DispatchAttention& attention = *run.attention;
  attention.times = {};
  Pass out;
  out.mode = mode;
  attention.set_backward_mode(mode);
  DISTCA_RETURN_IF_ERROR(attention.begin_step(data.batch, std::move(plan)));
  if (groups_.map.tp > 1) {
    const auto t0 = Clock::now();
    DISTCA_RETURN_IF_ERROR(check_same_plan(*groups_.tp, attention.plan().hash, fmt::format("step {} ({})", step_ + 1, run.name)));
    attention.times.comm += seconds_since(t0);
    trace::add("plan check (tensor parallel)", "comm", t0, Clock::now());
  }
  out.setup = attention.times.comm;
  const model::StepTokens in{data.slice(data.tokens, rank), data.slice(data.targets, rank), data.slice(data.positions, rank)};
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
  count_tasks(attention.plan().tasks, out.tasks, out.split_tasks);
  return out;
}

// One plan for the micro-batch, its tasks split between the nano-batches (layout::split_step):
// together they move the whole step's bytes.
Result<DataParallelTrainer::Pass> DataParallelTrainer::pingpong_pass(Run& run, const StepData& data, layout::NanoSplit split,
                                                                     plan::BackwardMode mode) {
  const layout::NanoBatches& nb = split.nano;
  const int rank = groups_.me.dp;
  Pass out;
  out.nano_batches = 2;
  out.mode = mode;
  for (int n = 0; n < 2; ++n) {
    DispatchAttention& att = *run.nano[n];
    att.times = {};
    att.set_backward_mode(mode);
    DISTCA_RETURN_IF_ERROR(att.begin_step(nb.batches[n], std::move(split.plans[n]), /*is_part=*/n == 1,
                                          n == 1 ? std::move(split.held_kv) : std::vector<layout::KvInterval>{},
                                          run.nano[0].get()));
    if (groups_.map.tp > 1) {
      const auto t0 = Clock::now();
      DISTCA_RETURN_IF_ERROR(check_same_plan(*groups_.tp, att.plan().hash,
                                             fmt::format("step {} ({}, nano-batch {})", step_ + 1, run.name, n)));
      att.times.comm += seconds_since(t0);
      trace::add("plan check (tensor parallel)", "comm", t0, Clock::now(), trace::kMain, -1, n);
    }
    out.setup += att.times.comm;
  }
  // Each nano-batch's rows of this rank, gathered into a row slice of the one workspace.
  const std::span<const int32_t> tokens = data.slice(data.tokens, rank), targets = data.slice(data.targets, rank),
                                 positions = data.slice(data.positions, rank);
  std::array<NanoPass, 2> passes;
  std::array<std::unique_ptr<model::Model<float>>, 2> slices;
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
    passes[n] = NanoPass{slices[n].get(), &run.state, run.nano[n].get(), model::StepTokens{ids[0], ids[1], ids[2]},
                         nullptr, nullptr, scale, 0};
  }
  // B's layout begins with A's last rows (the prefixes of the documents the split shares): B
  // reads their K/V, and its backward runs first so that A adds their dK/dV before its own
  // linear backward. Every rank knows whether any rank has such rows: the same schedule on all.
  const bool shares_rows = std::any_of(nb.context_rows.begin(), nb.context_rows.end(), [](int64_t r) { return r > 0; });
  if (shares_rows) {
    const model::ModelConfig& c = slices[1]->config();
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
  } else {
    context_ = ContextRows{};  // last step's buffers freed
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
  const auto t1 = Clock::now();
  out.times.total = std::chrono::duration<double>(t1 - t0).count();
  // As Model::forward's pass span: what the spans inside leave of it is linear time.
  trace::add("ping-pong schedule", "linear", t0, t1);
  for (int n = 0; n < 2; ++n) {
    const DispatchAttention& att = *run.nano[n];
    out.loss_sum += passes[n].loss;
    out.times.attention += att.times.compute;
    out.times.comm += att.times.comm + slices[n]->tp_seconds();
    out.bytes += bytes_sent(*att.dispatcher());
    out.attention_memory += att.buffer_bytes();
    count_tasks(att.plan().tasks, out.tasks, out.split_tasks);
  }
  if (shares_rows) out.attention_memory += context_.peak_bytes();
  out.times.comm -= out.setup;  // the plan checks ran before the passes
  return out;
}

Result<StepRecord> DataParallelTrainer::step_one(Run& run, const StepData& data) {
  const int R = comm_.size();
  if (trace::Recorder* tr = trace::active()) tr->begin_step(fmt::format("{} {}", step_ + 1, run.name));
  const auto begin = Clock::now();
  DISTCA_ASSIGN_OR_RETURN(Pass p, run_pass(run, data));
  const model::PassTimes& pass = p.times;
  const double setup = p.setup;
  const double loss_sum = p.loss_sum;
  // The gradient all-reduces posted during the passes: communication, not the linear work
  // the passes' time would otherwise count them as.
  const double posts = grad_sync_ ? grad_sync_->post_seconds() : 0.0;
  auto t = Clock::now();
  DISTCA_RETURN_IF_ERROR(comm_.barrier());
  const double wait = seconds_since(t);
  trace::add("wait for the slowest rank", "wait", t, Clock::now());
  t = Clock::now();
  if (grad_sync_) {
    DISTCA_RETURN_IF_ERROR(grad_sync_->finish());  // what the backward left in flight
  } else if (groups_.dp->size() > 1) {
    DISTCA_RETURN_IF_ERROR(groups_.dp->all_reduce_sum(run.state.grads.data(), run.state.grads.size()));
  }
  // The global norm: with TP, every rank's slice of the sharded blocks, the replicated ones once.
  DISTCA_ASSIGN_OR_RETURN(const double squares, gradient_square_sum(run.state, 0, run.state.grads.size(), groups_));
  const double reduce = seconds_since(t);
  trace::add("gradient all-reduce and norm", "comm", t, Clock::now());
  t = Clock::now();
  const double lr = options_.optim.lr_at(run.state.step);
  const double norm = std::sqrt(squares);
  model::adamw_step_range(run.state, options_.optim, 0, run.state.params.size(), norm);
  const double optimizer = seconds_since(t);
  const double step_seconds = seconds_since(begin);
  trace::add("optimizer", "optimizer", t, Clock::now());
  trace::add("step", "", begin, Clock::now());
  // Every rank's numbers, a row each: its parts (StepRecord::Rank::to_row), then its loss.
  StepRecord::Rank me;
  me.step = step_seconds;
  me.linear = pass.linear() - posts;
  me.attention = pass.attention;
  me.comm = pass.comm + setup + reduce + posts;
  me.wait = wait;
  me.optimizer = optimizer;
  me.grad_reduce = reduce;
  me.attention_bytes = p.bytes;
  me.memory_states = 4 * run.state.params.size() * static_cast<int64_t>(sizeof(float));
  me.memory_activations = model_->allocated_bytes();
  me.memory_attention = p.attention_memory;
  constexpr int kLoss = StepRecord::Rank::kSlots, kRow = kLoss + 1;
  std::vector<float> all(static_cast<size_t>(kRow * R), 0.0f);
  float* row = all.data() + comm_.rank() * kRow;
  me.to_row(row);
  row[kLoss] = static_cast<float>(groups_.me.tp == 0 ? loss_sum : 0.0);  // a replica's loss once
  DISTCA_RETURN_IF_ERROR(comm_.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  StepRecord rec;
  rec.step = step_ + 1;
  rec.attention_tasks = p.tasks;  // the same plans on every rank (hash-checked)
  rec.split_tasks = p.split_tasks;
  rec.split_micro_batches = p.nano_batches == 2 ? 1 : 0;
  rec.backward_mode = plan::backward_mode_name(p.mode);
  rec.colocated_plan = p.colocated_plan;
  rec.memory_budget_bytes = p.budget;
  rec.memory_predicted_bytes = p.predicted;
  rec.backend = run.name;
  rec.grad_norm = norm;
  rec.lr = lr;
  double loss = 0;
  for (int r = 0; r < R; ++r) {
    loss += static_cast<double>(all[r * kRow + kLoss]);
    rec.ranks.push_back(StepRecord::Rank::from_row(&all[r * kRow]));
  }
  rec.derive();
  rec.loss = data.num_targets > 0 ? loss / static_cast<double>(data.num_targets) : 0.0;
  rec.tokens_per_second = static_cast<double>(groups_.map.dp * options_.context) / rec.step_seconds;
  if (!std::isfinite(rec.loss)) return internal_error(fmt::format("step {}: the loss is {} ({})", rec.step, rec.loss, run.name));
  return rec;
}

}  // namespace distca::train
