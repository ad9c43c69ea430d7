#include "distca/train/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>

#include "distca/core/stopwatch.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/train/nano_chain.h"
#include "distca/model/optimizer.h"
#include "distca/runtime/dispatcher.h"

namespace distca::train {

namespace {
using Clock = SteadyClock;

constexpr int kActivationTag = 0, kGradientTag = 1;

// The arena elements of the blocks stage `stage` of `pp` owns: the embedding (first stage), its
// layers, the final norm and the LM head (last stage): one contiguous range.
std::pair<int64_t, int64_t> stage_range(const model::ModelState<float>& s, int stage, int pp) {
  const int64_t per = s.config.num_layers / pp;
  const int64_t first = stage * per, last = first + per;  // layers [first, last)
  int64_t begin = -1, end = -1;
  for (const auto& b : s.params.blocks()) {
    bool mine = false;
    if (b.name == "embed") mine = stage == 0;
    else if (b.name == "final_norm" || b.name == "lm_head") mine = stage == pp - 1;
    else {
      const int64_t layer = std::stoll(b.name.substr(7, b.name.find('.', 7) - 7));  // "layers.<l>.<name>"
      mine = layer >= first && layer < last;
    }
    if (!mine) continue;
    if (begin < 0) begin = b.offset;
    DISTCA_CHECK(end < 0 || end == b.offset) << "stage " << stage << "'s blocks are not contiguous";
    end = b.offset + b.count;
  }
  return {begin, end};
}

// The stage's peak number of micro-batches between their forward and their backward.
int peak_in_flight(const plan::PipelineSchedule& s, int stage) {
  int held = 0, peak = 0;
  for (const auto& tick : s.ticks) {
    held += tick[stage].op == plan::PipeOp::kForward ? 1 : tick[stage].op == plan::PipeOp::kBackward ? -1 : 0;
    peak = std::max(peak, held);
  }
  return std::max(peak, 1);
}

}  // namespace

// One workspace: the activations of one micro-batch between its forward and its backward, the
// buffers its stage messages land in, and (colocated) the attention over the stage's DP group.
// A micro-batch that runs as two nano-batches keeps its rows in nano-batch order (A's, then
// B's) on every stage, in its messages too, so that its forward and backward (different ticks)
// and its neighbour stages agree on them.
//
// With recompute, a stage has fewer workspaces than micro-batches in flight: a micro-batch whose
// workspace goes to another keeps its stage input (its first layer's input, or its tokens) and
// every layer's attention output (O and LSE, `saved`), and before its backward its linear activations are
// recomputed from them in a workspace again. Attention is not rerun: no exchange, and the
// recomputed activations are the originals bit for bit.
struct PipelineTrainer::Slot {
  model::Model<float>* model = nullptr;  // the workspace holding its activations (null: none, or saved)
  int workspace = -1;
  // recompute: the stage input [T, d] (a stage after the first), then every layer's O
  // [T, Hq D] and LSE [T, Hq]
  std::vector<float> saved;
  bool split = false;              // ran as two nano-batches (the recompute runs its slices)
  std::unique_ptr<DispatchAttention> attention;
  std::array<std::unique_ptr<DispatchAttention>, 2> nano;  // colocated with ping-pong: one per nano-batch
  int micro_batch = -1;
  // Ping-pong: the nano-batches' row slices of `model` and their tokens, targets and positions.
  std::array<std::unique_ptr<model::Model<float>>, 2> slices;
  std::array<std::array<std::vector<int32_t>, 3>, 2> ids;
};

// CAD's attention in a tick: a Dispatcher over all ranks with the tick's pooled plan (or the
// plan of one of its nano-batches); layer `l` of a stage is its slot l - first, the same on
// every stage. Stateless: no layer's buffers outlive its exchange, so all share one set.
class PipelineTrainer::TickAttention final : public StagedAttention {
 public:
  TickAttention(int64_t first_layer, int64_t layers) : first_(first_layer), layers_(layers) {}
  std::string name() const override { return "cad"; }
  Status begin_step(const plan::Batch&) override { return Status::ok(); }
  void set(runtime::Dispatcher* d) { d_ = d; }
  // The most the server buffers and a tick's exchange buffers held at once since reset_peak().
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak() { peak_bytes_ = current_bytes(); }

  Status start_forward(int layer, const runtime::ForwardArgs& f) override {
    DISTCA_RETURN_IF_ERROR(check(layer));
    return timed(times.comm, [&] { return d_->start_forward(f, server_); });
  }
  Status start_backward(int layer, const runtime::BackwardArgs& b) override {
    DISTCA_RETURN_IF_ERROR(check(layer));
    return timed(times.comm, [&] { return d_->start_backward(b, server_); });
  }
  Status finish_dispatch() override { return timed(times.comm, [this] { return d_->finish_comm(); }); }
  Status compute() override { return timed(times.compute, [this] { return d_->compute(); }); }
  Status start_return() override { return timed(times.comm, [this] { return d_->start_return(); }); }
  Status finish_return() override {
    DISTCA_RETURN_IF_ERROR(timed(times.comm, [this] { return d_->finish_comm(); }));
    peak_bytes_ = std::max(peak_bytes_, current_bytes());
    return Status::ok();
  }

  Status forward(int layer, const float* q, const float* k, const float* v, float* o, float* lse) override {
    DISTCA_RETURN_IF_ERROR(start_forward(layer, {q, k, v, o, lse}));
    return finish_pass();
  }
  Status backward(int layer, const float* q, const float* k, const float* v, const float* o, const float* lse,
                  const float* d_o, float* dq, float* dk, float* dv) override {
    DISTCA_RETURN_IF_ERROR(start_backward(layer, {q, k, v, o, lse, d_o, dq, dk, dv}));
    return finish_pass();
  }
  // A rank with no micro-batch of its own in the tick: every exchange of every layer slot, with
  // no rows of its own (it serves attention for the others).
  Status serve(bool is_backward) {
    for (int64_t i = 0; i < layers_; ++i) {
      const int layer = static_cast<int>(first_ + (is_backward ? layers_ - 1 - i : i));
      DISTCA_RETURN_IF_ERROR(is_backward ? start_backward(layer, {}) : start_forward(layer, {}));
      DISTCA_RETURN_IF_ERROR(finish_pass());
    }
    return Status::ok();
  }

 private:
  Status check(int layer) const {
    if (d_ == nullptr) return internal_error("pooled attention without a tick's dispatcher");
    if (layer < first_ || layer >= first_ + layers_) return internal_error(fmt::format("layer {} is not this stage's", layer));
    return Status::ok();
  }
  Status finish_pass() {
    DISTCA_RETURN_IF_ERROR(finish_dispatch());
    DISTCA_RETURN_IF_ERROR(compute());
    DISTCA_RETURN_IF_ERROR(start_return());
    return finish_return();
  }
  int64_t current_bytes() const {
    int64_t floats = 0;
    for (const auto* v : {&server_.q, &server_.k, &server_.v, &server_.o, &server_.lse, &server_.d_o, &server_.dq,
                          &server_.dk, &server_.dv}) {
      floats += static_cast<int64_t>(v->capacity());
    }
    return floats * static_cast<int64_t>(sizeof(float)) + (d_ ? d_->exchange_bytes() : 0);
  }
  int64_t peak_bytes_ = 0;
  int64_t first_, layers_;
  runtime::ServerBuffers server_;
  runtime::Dispatcher* d_ = nullptr;
};

// One backend's schedule: its tick table, its model state and workspaces, its attention.
struct PipelineTrainer::Run {
  std::string name;  // the backend, "colocated" (1F1B) or "cad" (lockstep, pooled plans)
  bool is_cad = false;
  plan::PipelineSchedule schedule;
  model::ModelState<float> state;
  std::vector<float> acc;  // the step's gradient of the owned blocks, accumulated over micro-batches
  std::vector<std::unique_ptr<Slot>> slots;  // micro-batch m uses slots[m % size]
  std::vector<std::unique_ptr<model::Model<float>>> workspaces;  // activations (as many as slots without recompute)
  std::vector<int> owners;                                       // the slot each workspace holds (-1: free)
  // cad: the tick's pooled attention (ping-pong: one per nano-batch).
  std::array<std::unique_ptr<TickAttention>, 2> pooled;
  bool pingpong = false;  // micro-batches of two or more documents run as two nano-batches
  // This step's micro-batches split into nano-batches (ping-pong), and whether each splits (it
  // has documents in both).
  std::vector<layout::NanoBatches> nanos;
  std::vector<char> splits;
  std::vector<TickPlan> last_ticks;  // cad: the last step's tick plans
  // The CA tasks of the plans this rank ran in this step (cad: the ticks'; colocated: its
  // stage's plans of its micro-batches), and of them the split ones.
  int64_t tasks = 0, split_tasks = 0;
};

PipelineTrainer::PipelineTrainer(comm::Communicator& world, TrainOptions options)
    : world_(world), options_(std::move(options)) {}
PipelineTrainer::~PipelineTrainer() = default;

std::string PipelineTrainer::data_description() const { return packer_->source().describe(); }

Result<std::vector<EvalRecord>> PipelineTrainer::evaluate() {
  return invalid_argument("--pp does not support --eval-every yet");
}

const plan::PipelineSchedule& PipelineTrainer::schedule(size_t backend) const { return runs_.at(backend)->schedule; }
model::ModelState<float>& PipelineTrainer::state(size_t backend) { return runs_.at(backend)->state; }
const std::vector<float>& PipelineTrainer::last_gradient(size_t backend) const { return runs_.at(backend)->acc; }

StepPlans PipelineTrainer::last_plans(size_t backend) const { return {last_batches_, runs_.at(backend)->last_ticks}; }

Result<std::unique_ptr<PipelineTrainer>> PipelineTrainer::create(comm::Communicator& world, TrainOptions options) {
  options.optim.total_steps = options.steps;
  if (options.micro_batches == 0) options.micro_batches = 2 * options.pp;
  DISTCA_RETURN_IF_ERROR(options.validate(world.size()));
  if (options.granularity == 0) options.granularity = default_granularity(options.context);
  kernels::blas_set_num_threads(options.threads);  // as DataParallelTrainer::create
  auto t = std::unique_ptr<PipelineTrainer>(new PipelineTrainer(world, std::move(options)));
  const TrainOptions& o = t->options_;
  DISTCA_ASSIGN_OR_RETURN(t->groups_, RankGroups::split(world, o.tp, o.pp, o.model));
  t->pp_ = o.pp;
  t->dp_ = t->groups_.map.dp;
  t->stage_ = t->groups_.me.pp;
  t->replica_ = t->groups_.me.dp;
  const model::ModelConfig shard = model::tensor_parallel_shard(o.model, o.tp).value();
  DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<DocumentSource> source,
                          open_training_source(o.data_path, o.workload, o.context, o.data_seed));
  t->packer_ = std::make_unique<Packer>(std::move(source), t->dp_, o.context);
  const int64_t per = o.model.num_layers / o.pp;
  const model::LayerRange range{t->stage_ * per, per};
  // The stage messages land here; the model copies them in (a micro-batch's forward or backward
  // is one tick).
  const auto message = static_cast<size_t>(o.context * o.model.d_model);
  if (t->stage_ > 0) t->x_in_.assign(message, 0.0f);
  if (t->stage_ + 1 < o.pp) t->dx_in_.assign(message, 0.0f);
  for (const std::string& name : o.backends) {
    auto owned = std::make_unique<Run>();
    Run& run = *owned;
    run.name = name;
    run.is_cad = name == "cad";
    DISTCA_ASSIGN_OR_RETURN(run.schedule, plan::pipeline_schedule(name, o.pp, o.micro_batches));
    run.state = model::ModelState<float>::create(o.model, o.tp, t->groups_.me.tp);
    std::tie(t->own_begin_, t->own_end_) = stage_range(run.state, t->stage_, o.pp);
    run.pingpong = o.pingpong == "on" || o.pingpong == "sequential" || (o.pingpong == "auto" && run.is_cad);
    const int slots = peak_in_flight(run.schedule, t->stage_);
    // Recompute: as many workspaces as the last stage needs (it holds the fewest in flight).
    const int workspaces = o.recompute ? std::min(slots, peak_in_flight(run.schedule, o.pp - 1)) : slots;
    for (int k = 0; k < workspaces; ++k) {
      auto model = std::make_unique<model::Model<float>>(shard, o.context, range, tensor_parallel(t->groups_));
      if (run.pingpong && o.progress == "poll") {
        // Its nano-batches' slices poll the attention's communicator between their GEMMs.
        model->set_poll([self = t.get(), r = &run] { (void)self->attention_comm(*r).progress(); });
      }
      run.workspaces.push_back(std::move(model));
      run.owners.push_back(-1);
    }
    for (int k = 0; k < slots; ++k) {
      auto s = std::make_unique<Slot>();
      if (!run.is_cad) {
        DispatchAttentionOptions d;
        d.policy = "none";
        d.backward_mode = o.backward_mode;
        d.grad_return = o.grad_return;
        d.threads = o.threads;
        d.tolerance = o.tolerance;
        d.granularity = o.granularity;
        DISTCA_ASSIGN_OR_RETURN(s->attention, DispatchAttention::create(*t->groups_.dp, shard, d));
        if (run.pingpong) {
          for (auto& nano : s->nano) {
            DISTCA_ASSIGN_OR_RETURN(nano, DispatchAttention::create(*t->groups_.dp, shard, d));
          }
        }
      }
      run.slots.push_back(std::move(s));
    }
    if (run.is_cad) {
      for (int n = 0; n < (run.pingpong ? 2 : 1); ++n) run.pooled[n] = std::make_unique<TickAttention>(range.first, per);
    }
    t->runs_.push_back(std::move(owned));
  }
  return t;
}

// The workspace a message comes from is rewritten by the stage's next pass, possibly before the
// peer receives it: every message goes out of a copy of its own, kept until it is delivered.
Status PipelineTrainer::send(const float* data, int64_t count, int peer, int tag) {
  auto pending = std::make_unique<Pending>();
  pending->data.assign(data, data + count);
  DISTCA_ASSIGN_OR_RETURN(pending->work, groups_.pp->send_async(pending->data.data(), count * static_cast<int64_t>(sizeof(float)), peer, tag));
  sends_.push_back(std::move(pending));
  int64_t held = 0;
  for (const auto& p : sends_) held += static_cast<int64_t>(p->data.capacity() * sizeof(float));
  sends_peak_bytes_ = std::max(sends_peak_bytes_, held);
  // Delivered messages free their copies.
  std::erase_if(sends_, [](const std::unique_ptr<Pending>& p) {
    auto done = p->work->test();
    return done.is_ok() && done.value();
  });
  return Status::ok();
}

comm::Communicator& PipelineTrainer::attention_comm(const Run& run) const {
  return run.is_cad ? *groups_.cad : *groups_.dp;
}

Result<runtime::ScheduleTiming> PipelineTrainer::run_chains(const Run& run, std::array<std::vector<runtime::Stage>, 2>& chains) {
  std::optional<runtime::ProgressThread> progress;
  if (options_.progress == "thread") {
    progress.emplace([this, &run] { return attention_comm(run).progress(); }, std::chrono::microseconds(options_.progress_interval_us));
  }
  Result<runtime::ScheduleTiming> r = options_.pingpong == "sequential" ? runtime::run_sequential(chains[0], chains[1])
                                                                             : runtime::run_pingpong(chains[0], chains[1]);
  if (progress) DISTCA_RETURN_IF_ERROR(progress->stop());
  return r;
}

Result<std::unique_ptr<runtime::Dispatcher>> PipelineTrainer::plan_tick(Run& run, const std::vector<plan::PipeSlot>& tick,
                                                                        const std::vector<StepData>& mbs, int nano,
                                                                        bool is_backward, StepRecord::Rank& me) {
  const auto begin = Clock::now();
  // One plan for the tick: every active (stage, micro-batch) over all ranks; a micro-batch with
  // nothing in this nano-batch adds nothing (its ranks serve in it).
  std::vector<plan::PoolPart> parts;
  for (int r = 0; r < pp_; ++r) {
    if (tick[r].op == plan::PipeOp::kIdle) continue;
    const int m = tick[r].micro_batch;
    const plan::Batch& b = nano < 0 ? mbs[m].batch : run.nanos[m].batches[nano];
    if (b.num_docs() > 0) parts.push_back({&b, r * dp_, r, m});
  }
  comm::Communicator& servers = *groups_.cad;  // the ranks of this TP index, ranked stage-major
  const int64_t T = options_.context;
  DISTCA_ASSIGN_OR_RETURN(plan::PooledBatch pool, plan::pool_batches(parts, servers.size(), T));
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn fn, plan::find_planner(options_.policy));
  plan::PlannerOptions opt;
  opt.tolerance = options_.tolerance;
  opt.granularity = options_.granularity;
  const plan::CostModel cost(model_shape(options_.model, options_.grad_return), plan::cpu_throughput_profile());
  DISTCA_ASSIGN_OR_RETURN(plan::Plan p, fn(pool.batch, cost, opt));
  count_tasks(p.tasks, run.tasks, run.split_tasks);
  TickPlan record{is_backward, nano, {}, pool.batch, p.tasks};
  for (int r = 0; r < pp_; ++r) record.micro_batch.push_back(tick[r].micro_batch);
  run.last_ticks.push_back(std::move(record));
  me.other += seconds_since(begin);
  const auto setup = Clock::now();
  runtime::DispatchOptions dopt;
  dopt.backward_mode = plan::BackwardMode::kStateless;
  dopt.grad_return = options_.grad_return;
  dopt.num_threads = options_.threads;
  // Ping-pong: the server kernel polls the exchange in flight while it computes (--progress poll).
  if (nano >= 0 && options_.progress == "poll") dopt.poll = [this, &run] { (void)attention_comm(run).progress(); };
  const model::ModelConfig& c = run.state.config;  // this TP rank's heads
  DISTCA_ASSIGN_OR_RETURN(auto dispatcher, runtime::Dispatcher::create(servers, pool.batch, p,
                                                                      layout::HeadShape{c.num_q_heads, c.num_kv_heads, c.head_dim}, dopt));
  if (groups_.map.tp > 1) {
    DISTCA_RETURN_IF_ERROR(check_same_plan(*groups_.tp, p.hash, fmt::format("step {}, tick plan{}", step_ + 1,
                                                                           nano < 0 ? "" : fmt::format(", nano-batch {}", nano))));
  }
  me.comm += seconds_since(setup);  // the plan-hash check is a collective
  return dispatcher;
}

Status PipelineTrainer::run_tick(Run& run, const std::vector<plan::PipeSlot>& tick, const std::vector<StepData>& mbs, double scale,
                                 double& loss_sum, StepRecord::Rank& me) {
  const plan::PipeSlot mine = tick[stage_];
  const bool is_cad = run.is_cad, is_idle = mine.op == plan::PipeOp::kIdle;
  // Two nano-batches when a micro-batch of the tick splits: cad, any (the tick's plans pool
  // them all); colocated, this rank's.
  bool is_backward = mine.op == plan::PipeOp::kBackward, two = false;
  for (int r = 0; r < pp_; ++r) {
    if (tick[r].op == plan::PipeOp::kIdle || (!is_cad && r != stage_)) continue;
    is_backward = tick[r].op == plan::PipeOp::kBackward;  // cad: one direction per tick (lockstep)
    two = two || (run.pingpong && run.splits[tick[r].micro_batch]);
  }
  if (!is_cad) return is_idle ? Status::ok() : run_micro_batch(run, mine, two, mbs[mine.micro_batch], scale, loss_sum, me);
  std::array<std::unique_ptr<runtime::Dispatcher>, 2> dispatchers;
  for (int n = 0; n < (two ? 2 : 1); ++n) {
    DISTCA_ASSIGN_OR_RETURN(dispatchers[n], plan_tick(run, tick, mbs, two ? n : -1, is_backward, me));
    run.pooled[n]->set(dispatchers[n].get());
  }
  Status st = Status::ok();
  if (!is_idle) {
    st = run_micro_batch(run, mine, two, mbs[mine.micro_batch], scale, loss_sum, me);
  } else {
    // No micro-batch of its own: serve every exchange of the tick's plans.
    const auto t0 = Clock::now();
    model::AttentionTimes served;
    for (int n = 0; n < (two ? 2 : 1); ++n) run.pooled[n]->times = {};
    if (two) {
      const int64_t per = options_.model.num_layers / pp_;
      std::array<std::vector<runtime::Stage>, 2> chains;
      for (int n = 0; n < 2; ++n) chains[n] = serve_stages(*run.pooled[n], stage_ * per, per, is_backward);
      st = run_chains(run, chains).status();
    } else {
      st = run.pooled[0]->serve(is_backward);
    }
    for (int n = 0; n < (two ? 2 : 1); ++n) served.compute += run.pooled[n]->times.compute, served.comm += run.pooled[n]->times.comm;
    me.attention += served.compute;
    me.comm += served.comm;
    me.served_in_idle += served.compute;
    me.other += seconds_since(t0) - served.compute - served.comm;
  }
  for (auto& p : run.pooled) if (p) p->set(nullptr);
  for (const auto& d : dispatchers) me.attention_bytes += d ? bytes_sent(*d) : 0;
  return st;
}

Status PipelineTrainer::bind_workspace(Run& run, int slot) {
  int w = static_cast<int>(std::find(run.owners.begin(), run.owners.end(), -1) - run.owners.begin());
  if (w == static_cast<int>(run.owners.size())) {
    // Every workspace is held: free the one whose micro-batch's backward comes last (both
    // schedules run the backwards in micro-batch order), keeping what its recompute needs.
    w = 0;
    for (int k = 1; k < static_cast<int>(run.owners.size()); ++k) {
      if (run.slots[run.owners[k]]->micro_batch > run.slots[run.owners[w]]->micro_batch) w = k;
    }
    Slot& held = *run.slots[run.owners[w]];
    const model::ModelConfig& c = held.model->config();
    const int64_t T = options_.context, o = T * c.q_width(), lse = T * c.num_q_heads;
    const int64_t input = stage_ > 0 ? T * c.d_model : 0;
    held.saved.resize(static_cast<size_t>(input + held.model->num_stage_layers() * (o + lse)));
    float* out = std::copy(held.model->stage_input(), held.model->stage_input() + input, held.saved.data());
    for (int64_t l = 0; l < held.model->num_stage_layers(); ++l) {
      const auto io = held.model->attention_io(l);
      out = std::copy(io.lse, io.lse + lse, std::copy(io.o, io.o + o, out));
    }
    held.model = nullptr;
    held.workspace = -1;
    for (auto& x : held.slices) x.reset();
  }
  run.owners[w] = slot;
  Slot& s = *run.slots[slot];
  s.workspace = w;
  s.model = run.workspaces[w].get();
  return Status::ok();
}

void PipelineTrainer::release_workspace(Run& run, Slot& s) {
  if (s.workspace >= 0) run.owners[s.workspace] = -1;
  s.workspace = -1;
  s.model = nullptr;
  for (auto& x : s.slices) x.reset();
}

Result<double> PipelineTrainer::recompute(Run& run, int slot, const StepData& data, double scale) {
  DISTCA_RETURN_IF_ERROR(bind_workspace(run, slot));
  Slot& s = *run.slots[slot];
  model::Model<float>& model = *s.model;
  const model::ModelConfig& c = model.config();
  const int64_t T = options_.context, d = options_.model.d_model, o = T * c.q_width(), lse = T * c.num_q_heads;
  const float* in = s.saved.data() + (stage_ > 0 ? T * d : 0);
  for (int64_t l = 0; l < model.num_stage_layers(); ++l) {
    const auto io = model.attention_io(l);
    std::copy(in, in + o, io.o);
    std::copy(in + o, in + o + lse, io.lse);
    in += o + lse;
  }
  // The forward's phases without attention (its outputs are back in place), on the same rows;
  // returns the seconds of tensor-parallel all-reduces among them.
  double tp = 0;
  auto phases = [&](model::Model<float>& m, const model::StepTokens& tokens, const float* x_in) -> Status {
    const double before = m.tp_seconds();
    DISTCA_RETURN_IF_ERROR(m.begin_forward(run.state, tokens, x_in));
    for (int64_t l = 0; l < m.num_stage_layers(); ++l) {
      m.forward_pre_attention(run.state, l);
      DISTCA_RETURN_IF_ERROR(m.forward_post_attention(run.state, l));
    }
    m.finish_forward(run.state, scale);
    tp += m.tp_seconds() - before;
    return Status::ok();
  };
  const float* x_in = stage_ > 0 ? s.saved.data() : nullptr;
  if (!s.split) {
    DISTCA_RETURN_IF_ERROR(phases(model, model::StepTokens{data.slice(data.tokens, replica_), data.slice(data.targets, replica_),
                                                    data.slice(data.positions, replica_)}, x_in));
    return tp;
  }
  int64_t first_row = 0;
  for (int n = 0; n < 2; ++n) {
    const auto count = static_cast<int64_t>(run.nanos[s.micro_batch].rows[n][replica_].size());
    s.slices[n] = model.slice(first_row, count);
    DISTCA_RETURN_IF_ERROR(phases(*s.slices[n], model::StepTokens{s.ids[n][0], s.ids[n][1], s.ids[n][2]},
                                  x_in ? x_in + first_row * d : nullptr));
    first_row += count;
  }
  return tp;
}

Status PipelineTrainer::run_micro_batch(Run& run, plan::PipeSlot mine, bool two, const StepData& data, double scale,
                                        double& loss_sum, StepRecord::Rank& me) {
  const int64_t T = options_.context, d = options_.model.d_model;
  const bool is_cad = run.is_cad, is_forward = mine.op == plan::PipeOp::kForward;
  const int m = mine.micro_batch;
  const int slot = m % static_cast<int>(run.slots.size());
  Slot& s = *run.slots[slot];
  if (is_forward) {
    s.micro_batch = m;
    s.split = two && run.splits[m];
    DISTCA_RETURN_IF_ERROR(bind_workspace(run, slot));
  } else if (s.micro_batch != m) {
    return internal_error(fmt::format("stage {}: backward of micro-batch {} without its forward", stage_, m));
  } else if (s.model == nullptr) {
    const auto t0 = Clock::now();
    DISTCA_ASSIGN_OR_RETURN(const double tp, recompute(run, slot, data, scale));
    const double spent = seconds_since(t0);
    me.comm += tp;
    me.linear += spent - tp;
    me.recompute += spent - tp;
  }
  // The stage message this pass starts from: activations from the previous stage, gradients
  // from the next.
  const bool has_message = is_forward ? stage_ > 0 : stage_ + 1 < pp_;
  float* message = is_forward ? x_in_.data() : dx_in_.data();
  if (has_message) {
    const auto t0 = Clock::now();
    DISTCA_RETURN_IF_ERROR(groups_.pp->recv(message, T * d * static_cast<int64_t>(sizeof(float)),
                                            is_forward ? stage_ - 1 : stage_ + 1, is_forward ? kActivationTag : kGradientTag));
    me.pipeline_wait += seconds_since(t0);
  }
  const std::span<const int32_t> tokens = data.slice(data.tokens, replica_), targets = data.slice(data.targets, replica_),
                                 positions = data.slice(data.positions, replica_);
  if (!two) {
    model::AttentionBackend<float>& attention = is_cad ? static_cast<model::AttentionBackend<float>&>(*run.pooled[0]) : *s.attention;
    model::PassTimes pass;
    if (is_forward) {
      if (!is_cad) DISTCA_RETURN_IF_ERROR(timed(me.comm, [&] { return s.attention->begin_step(data.batch); }));
      const model::StepTokens in{tokens, targets, positions};
      DISTCA_ASSIGN_OR_RETURN(double loss, s.model->forward(run.state, in, attention, scale, &pass, has_message ? message : nullptr));
      if (groups_.me.tp == 0) loss_sum += loss;  // a replica's loss once
    } else {
      DISTCA_RETURN_IF_ERROR(s.model->backward(run.state, attention, &pass, has_message ? message : nullptr));
    }
    me.linear += pass.linear();
    me.attention += pass.attention;
    me.comm += pass.comm;
  } else {
    // Two nano-batches in row slices of the workspace, A's rows first. A micro-batch that does
    // not split (cad: another stage's does) runs whole in nano-batch A's plan, its rows in their
    // order, and serves in B's.
    const bool split = run.splits[m];
    std::array<StagedAttention*, 2> att{};
    std::array<NanoPass, 2> passes;
    std::array<model::Model<float>*, 2> models{s.model, nullptr};
    int64_t first_row = 0;
    for (int n = 0; n < 2; ++n) {
      att[n] = is_cad ? static_cast<StagedAttention*>(run.pooled[n].get()) : s.nano[n].get();
      if (!split && n == 1) break;
      const float* in = has_message ? message + first_row * d : nullptr;
      model::StepTokens ids{tokens, targets, positions};
      if (split) {
        const std::vector<int64_t>& rows = run.nanos[m].rows[n][replica_];
        const auto count = static_cast<int64_t>(rows.size());
        if (is_forward) {
          for (auto& v : s.ids[n]) v.clear();
          for (int64_t r : rows) {
            s.ids[n][0].push_back(tokens[r]);
            s.ids[n][1].push_back(targets[r]);
            s.ids[n][2].push_back(positions[r]);
          }
          s.slices[n] = s.model->slice(first_row, count);
          if (!is_cad) DISTCA_RETURN_IF_ERROR(timed(me.comm, [&] { return s.nano[n]->begin_step(run.nanos[m].batches[n]); }));
        }
        ids = model::StepTokens{s.ids[n][0], s.ids[n][1], s.ids[n][2]};
        models[n] = s.slices[n].get();
        first_row += count;
      }
      passes[n] = NanoPass{models[n], &run.state, att[n], ids, is_forward ? in : nullptr, is_forward ? nullptr : in, scale, 0};
    }
    const int64_t per = options_.model.num_layers / pp_;
    std::array<std::vector<runtime::Stage>, 2> chains;
    for (int n = 0; n < 2; ++n) {
      chains[n] = models[n] == nullptr ? serve_stages(*att[n], stage_ * per, per, !is_forward)
                  : is_forward         ? forward_stages(passes[n])
                                       : backward_stages(passes[n]);
    }
    if (!is_forward) run.state.grads.fill(0.0f);  // both nano-batches add theirs
    std::array<model::AttentionTimes, 2> before{att[0]->times, att[1]->times};
    auto tp_seconds = [&] { return models[0]->tp_seconds() + (models[1] ? models[1]->tp_seconds() : 0.0); };
    const double tp_before = tp_seconds();
    const auto t0 = Clock::now();
    DISTCA_RETURN_IF_ERROR(run_chains(run, chains).status());
    if (!is_forward) DISTCA_RETURN_IF_ERROR(models[0]->reduce_shared_grads(run.state));
    double attention = 0, comm = tp_seconds() - tp_before;
    for (int n = 0; n < 2; ++n) {
      attention += att[n]->times.compute - before[n].compute;
      comm += att[n]->times.comm - before[n].comm;
    }
    me.linear += seconds_since(t0) - attention - comm;
    me.attention += attention;
    me.comm += comm;
    if (is_forward && groups_.me.tp == 0) loss_sum += passes[0].loss + passes[1].loss;
  }
  if (is_forward) {
    if (stage_ + 1 < pp_) DISTCA_RETURN_IF_ERROR(send(s.model->output(), T * d, stage_ + 1, kActivationTag));
  } else {
    const auto t0 = Clock::now();
    const float* g = run.state.grads.data();
    for (int64_t i = own_begin_; i < own_end_; ++i) run.acc[i - own_begin_] += g[i];
    me.other += seconds_since(t0);
    if (stage_ > 0) DISTCA_RETURN_IF_ERROR(send(s.model->input_grad(), T * d, stage_ - 1, kGradientTag));
    if (!is_cad) {
      // The micro-batch's plans (its forward's and backward's dispatcher): its stage's DP group.
      for (const DispatchAttention* a : s.split ? std::vector<const DispatchAttention*>{s.nano[0].get(), s.nano[1].get()}
                                                : std::vector<const DispatchAttention*>{s.attention.get()}) {
        me.attention_bytes += bytes_sent(*a->dispatcher());
        count_tasks(a->plan().tasks, run.tasks, run.split_tasks);
      }
    }
    s.micro_batch = -1;
    release_workspace(run, s);
  }
  return Status::ok();
}

Result<std::vector<StepRecord>> PipelineTrainer::step() {
  std::vector<StepData> mbs;
  for (int m = 0; m < options_.micro_batches; ++m) {
    DISTCA_ASSIGN_OR_RETURN(StepData data, packer_->next());
    mbs.push_back(std::move(data));
  }
  last_batches_.clear();
  for (const StepData& data : mbs) last_batches_.push_back(data.batch);
  std::vector<StepRecord> records;
  for (auto& run : runs_) {
    DISTCA_ASSIGN_OR_RETURN(StepRecord r, step_one(*run, mbs));
    records.push_back(std::move(r));
  }
  ++step_;
  return records;
}

Result<StepRecord> PipelineTrainer::step_one(Run& run, const std::vector<StepData>& mbs) {
  const auto begin = Clock::now();
  StepRecord::Rank me;
  const int M = options_.micro_batches;
  int64_t targets = 0;
  for (const StepData& data : mbs) targets += data.num_targets;
  const double scale = targets > 0 ? 1.0 / static_cast<double>(targets) : 0.0;
  run.last_ticks.clear();
  run.tasks = run.split_tasks = 0;
  run.acc.assign(static_cast<size_t>(own_end_ - own_begin_), 0.0f);
  sends_peak_bytes_ = 0;
  for (auto& p : run.pooled) if (p) p->reset_peak();
  run.nanos.clear();
  run.splits.assign(static_cast<size_t>(M), 0);
  if (run.pingpong) {
    for (int m = 0; m < M; ++m) {
      DISTCA_ASSIGN_OR_RETURN(layout::NanoBatches nb, layout::split_step_by_documents(mbs[m].batch));
      run.splits[m] = nb.batches[1].num_docs() > 0;
      run.nanos.push_back(std::move(nb));
    }
  }
  double loss_sum = 0;
  for (const auto& tick : run.schedule.ticks) {
    const auto t0 = Clock::now();
    const StepRecord::Rank was = me;
    DISTCA_RETURN_IF_ERROR(run_tick(run, tick, mbs, scale, loss_sum, me));
    if (tick[stage_].op == plan::PipeOp::kIdle) {
      // The idle tick's time less what was accounted (serving, planning): the bubble.
      const double accounted = (me.attention - was.attention) + (me.comm - was.comm) + (me.other - was.other);
      me.idle += seconds_since(t0) - accounted;
    }
  }
  for (auto& p : sends_) DISTCA_RETURN_IF_ERROR(p->work->wait());
  sends_.clear();
  // Waiting for the slowest rank, then the stage's DP all-reduce and the global norm.
  auto t = Clock::now();
  DISTCA_RETURN_IF_ERROR(world_.barrier());
  me.wait += seconds_since(t);
  t = Clock::now();
  if (dp_ > 1) DISTCA_RETURN_IF_ERROR(groups_.dp->all_reduce_sum(run.acc.data(), static_cast<int64_t>(run.acc.size())));
  std::copy(run.acc.begin(), run.acc.end(), run.state.grads.data() + own_begin_);
  // The stage's sum of squares (with TP: over its TP group), then every stage's, one slot each (a
  // float sum of P values keeps the order fixed).
  DISTCA_ASSIGN_OR_RETURN(const double ss, gradient_square_sum(run.state, own_begin_, own_end_, groups_));
  std::vector<float> squares(static_cast<size_t>(pp_), 0.0f);
  squares[stage_] = static_cast<float>(ss);
  DISTCA_RETURN_IF_ERROR(groups_.pp->all_reduce_sum(squares.data(), pp_));
  double total = 0;
  for (float x : squares) total += x;
  const double norm = std::sqrt(total);
  me.grad_reduce = seconds_since(t);
  me.comm += me.grad_reduce;
  t = Clock::now();
  const double lr = options_.optim.lr_at(run.state.step);
  model::adamw_step_range(run.state, options_.optim, own_begin_, own_end_, norm);
  me.optimizer += seconds_since(t);
  me.step = seconds_since(begin);
  constexpr int64_t f = sizeof(float);
  me.memory_states = 4 * run.state.params.size() * f + static_cast<int64_t>(run.acc.capacity()) * f;
  for (const auto& w : run.workspaces) me.memory_activations += w->allocated_bytes();
  me.memory_activations += static_cast<int64_t>(x_in_.capacity() + dx_in_.capacity()) * f;
  for (const auto& s : run.slots) {
    me.memory_activations += static_cast<int64_t>(s->saved.capacity()) * f;
    if (s->attention) me.memory_attention += s->attention->buffer_bytes();
  }
  for (const auto& p : run.pooled) me.memory_attention += p ? p->peak_bytes() : 0;  // ping-pong: both coexist
  me.memory_messages = sends_peak_bytes_;
  // Every rank's numbers, a row each: its parts (StepRecord::Rank::to_row), its loss, and its
  // plans' task counts (exact: put_count).
  constexpr int kLoss = StepRecord::Rank::kSlots, kTasks = kLoss + 1, kRow = kTasks + 4;
  const int R = world_.size();
  std::vector<float> all(static_cast<size_t>(kRow * R), 0.0f);
  float* row = all.data() + world_.rank() * kRow;
  me.to_row(row);
  row[kLoss] = static_cast<float>(loss_sum);
  put_count(row + kTasks, run.tasks);
  put_count(row + kTasks + 2, run.split_tasks);
  DISTCA_RETURN_IF_ERROR(world_.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  StepRecord rec;
  rec.step = step_ + 1;
  rec.backend = run.name;
  rec.micro_batches = M;
  for (char split : run.splits) rec.split_micro_batches += split;
  rec.grad_norm = norm;
  rec.lr = lr;
  double loss = 0;
  for (int r = 0; r < R; ++r) {
    const float* theirs = &all[r * kRow];
    rec.ranks.push_back(StepRecord::Rank::from_row(theirs));
    loss += static_cast<double>(theirs[kLoss]);
    // The same plan on every rank of its group counted once: cad's tick plans span every rank of
    // a TP index (rank 0's count), colocated plans a stage's DP group (one rank per stage).
    const RankCoords c = groups_.map.coords(r);
    if (run.is_cad ? r == 0 : c.tp == 0 && c.dp == 0) {
      rec.attention_tasks += get_count(theirs + kTasks);
      rec.split_tasks += get_count(theirs + kTasks + 2);
    }
  }
  rec.derive();
  rec.loss = targets > 0 ? loss / static_cast<double>(targets) : 0.0;
  rec.tokens_per_second = static_cast<double>(M) * dp_ * options_.context / rec.step_seconds;
  if (!std::isfinite(rec.loss)) return internal_error(fmt::format("step {}: the loss is {} ({})", rec.step, rec.loss, run.name));
  return rec;
}

}  // namespace distca::train
