#include "distca/train/data_parallel.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "distca/core/json.h"
#include "distca/core/stopwatch.h"
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
    run->state = model::ModelState<float>::create(o.model, o.tp, t->groups_.me.tp);
    t->runs_.push_back(std::move(run));
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

Result<DataParallelTrainer::Pass> DataParallelTrainer::whole_pass(Run& run, const StepData& data) {
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

Result<DataParallelTrainer::Pass> DataParallelTrainer::pingpong_pass(Run& run, const StepData& data) {
  // One plan for the micro-batch, its tasks split between the nano-batches (layout::split_step):
  // together they move the whole step's bytes.
  DispatchAttention& planner = *run.nano[0];
  DISTCA_ASSIGN_OR_RETURN(plan::Plan whole, planner.plan_step(data.batch));
  // Stateful: B's servers keep the K/V rows A's forward brought them (held K/V), so the split may
  // cut inside a server's share of a document without moving its prefix twice.
  const bool hold_kv = options_.backward_mode == plan::BackwardMode::kStateful;
  DISTCA_ASSIGN_OR_RETURN(layout::NanoSplit split, layout::split_step(data.batch, whole, planner.cost(), {.hold_kv = hold_kv}));
  const layout::NanoBatches& nb = split.nano;
  // A step no split leaves work on both sides of (one short document) runs whole.
  if (nb.batches[0].num_docs() == 0 || nb.batches[1].num_docs() == 0) return whole_pass(run, data);
  const int rank = groups_.me.dp;
  Pass out;
  out.nano_batches = 2;
  for (int n = 0; n < 2; ++n) {
    DispatchAttention& att = *run.nano[n];
    att.times = {};
    DISTCA_RETURN_IF_ERROR(att.begin_step(nb.batches[n], std::move(split.plans[n]), /*is_part=*/n == 1,
                                          n == 1 ? std::move(split.held_kv) : std::vector<layout::KvInterval>{},
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
    count_tasks(att.plan().tasks, out.tasks, out.split_tasks);
  }
  if (shares_rows) out.attention_memory += static_cast<int64_t>((context_.dk.size() + context_.dv.size()) * sizeof(float));
  out.times.comm -= out.setup;  // the plan checks ran before the passes
  return out;
}

Result<StepRecord> DataParallelTrainer::step_one(Run& run, const StepData& data) {
  const int R = comm_.size();
  const auto begin = Clock::now();
  DISTCA_ASSIGN_OR_RETURN(Pass p, run.pingpong ? pingpong_pass(run, data) : whole_pass(run, data));
  const model::PassTimes& pass = p.times;
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
  model::adamw_step_range(run.state, options_.optim, 0, run.state.params.size(), norm);
  const double optimizer = seconds_since(t);
  const double step_seconds = seconds_since(begin);
  // Every rank's numbers, a row each: its parts (StepRecord::Rank::to_row), then its loss.
  StepRecord::Rank me;
  me.step = step_seconds;
  me.linear = pass.linear();
  me.attention = pass.attention;
  me.comm = pass.comm + setup + reduce;
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
