#include "distca/model/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>

#include "distca/core/stopwatch.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/model/nano_chain.h"
#include "distca/model/optimizer.h"
#include "distca/runtime/dispatcher.h"

namespace distca::model {

namespace {
using Clock = SteadyClock;

constexpr int kActivationTag = 0, kGradientTag = 1;

// The arena elements of the blocks stage `stage` of `pp` owns: the embedding (first stage), its
// layers, the final norm and the LM head (last stage): one contiguous range.
std::pair<int64_t, int64_t> stage_range(const ModelState<float>& s, int stage, int pp) {
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
int peak_in_flight(const runtime::PipelineSchedule& s, int stage) {
  int held = 0, peak = 0;
  for (const auto& tick : s.ticks) {
    held += tick[stage].op == runtime::PipeOp::kForward ? 1 : tick[stage].op == runtime::PipeOp::kBackward ? -1 : 0;
    peak = std::max(peak, held);
  }
  return std::max(peak, 1);
}

}  // namespace

Status PipelineOptions::validate(int world_size) const {
  DISTCA_RETURN_IF_ERROR(train.validate());
  if (pp < 1 || pp > world_size || world_size % pp != 0) {
    return invalid_argument(fmt::format("--pp {} must divide the {} ranks", pp, world_size));
  }
  if (world_size % (pp * train.tp) != 0) {
    return invalid_argument(fmt::format("--tp {} x --pp {} must divide the {} ranks (the rest is data parallelism)",
                                        train.tp, pp, world_size));
  }
  if (train.model.num_layers % pp != 0) {
    return invalid_argument(fmt::format("--pp {} must divide the model's {} layers (equal layers per stage)", pp,
                                        train.model.num_layers));
  }
  if (schedule != "colocated" && schedule != "cad") {
    return invalid_argument(fmt::format("pipeline schedule must be colocated or cad, got '{}'", schedule));
  }
  if (micro_batches < 0 || micro_batches > 4096) return invalid_argument(fmt::format("--micro-batches must be 1..4096 (0: 2 x --pp), got {}", micro_batches));
  if (!train.resume_path.empty() || !train.checkpoint_path.empty() || train.eval_every > 0) {
    return invalid_argument("--pp does not support checkpoints or validation yet");
  }
  return Status::ok();
}

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
  Model<float>* model = nullptr;  // the workspace holding its activations (null: none, or saved)
  int workspace = -1;
  // recompute: the stage input [T, d] (a stage after the first), then every layer's O
  // [T, Hq D] and LSE [T, Hq]
  std::vector<float> saved;
  bool split = false;              // ran as two nano-batches (the recompute runs its slices)
  std::unique_ptr<DispatchAttention> attention;
  std::array<std::unique_ptr<DispatchAttention>, 2> nano;  // colocated with ping-pong: one per nano-batch
  int micro_batch = -1;
  // Ping-pong: the nano-batches' row slices of `model` and their tokens, targets and positions.
  std::array<std::unique_ptr<Model<float>>, 2> slices;
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

PipelineTrainer::PipelineTrainer(comm::Communicator& world, PipelineOptions options)
    : world_(world), options_(std::move(options)) {}
PipelineTrainer::~PipelineTrainer() = default;

Result<std::unique_ptr<PipelineTrainer>> PipelineTrainer::create(comm::Communicator& world, PipelineOptions options) {
  options.train.optim.total_steps = options.train.steps;
  if (options.micro_batches == 0) options.micro_batches = 2 * options.pp;
  DISTCA_RETURN_IF_ERROR(options.validate(world.size()));
  TrainOptions& o = options.train;
  if (o.granularity == 0) o.granularity = default_granularity(o.context);
  kernels::blas_set_num_threads(o.threads);  // as Trainer::create
  auto t = std::unique_ptr<PipelineTrainer>(new PipelineTrainer(world, std::move(options)));
  const PipelineOptions& po = t->options_;
  DISTCA_ASSIGN_OR_RETURN(t->groups_, RankGroups::split(world, po.train.tp, po.pp, po.train.model));
  t->pp_ = po.pp;
  t->dp_ = t->groups_.map.dp;
  t->stage_ = t->groups_.me.pp;
  t->replica_ = t->groups_.me.dp;
  const ModelConfig shard = tensor_parallel_shard(po.train.model, po.train.tp).value();
  DISTCA_ASSIGN_OR_RETURN(t->schedule_, runtime::pipeline_schedule(po.schedule, po.pp, po.micro_batches));
  std::unique_ptr<DocumentSource> source;
  if (po.train.data_path.empty()) {
    DISTCA_ASSIGN_OR_RETURN(source, make_synthetic_source(po.train.workload, po.train.context, po.train.data_seed));
  } else {
    DISTCA_ASSIGN_OR_RETURN(source, open_data_source(po.train.data_path));
  }
  t->packer_ = std::make_unique<Packer>(std::move(source), t->dp_, po.train.context);
  t->state_ = ModelState<float>::create(po.train.model, po.train.tp, t->groups_.me.tp);
  std::tie(t->own_begin_, t->own_end_) = stage_range(t->state_, t->stage_, po.pp);
  const int64_t per = po.train.model.num_layers / po.pp;
  const LayerRange range{t->stage_ * per, per};
  const std::string& pingpong = po.train.pingpong;
  t->pingpong_ = pingpong == "on" || pingpong == "sequential" || (pingpong == "auto" && po.schedule == "cad");
  const int slots = peak_in_flight(t->schedule_, t->stage_);
  // Recompute: as many workspaces as the last stage needs (it holds the fewest in flight).
  const int workspaces = po.recompute ? std::min(slots, peak_in_flight(t->schedule_, po.pp - 1)) : slots;
  for (int k = 0; k < workspaces; ++k) {
    auto model = std::make_unique<Model<float>>(shard, po.train.context, range, tensor_parallel(t->groups_));
    if (t->pingpong_ && po.train.progress == "poll") {
      // Its nano-batches' slices poll the attention's communicator between their GEMMs.
      PipelineTrainer* self = t.get();
      model->set_poll([self] { (void)self->attention_comm().progress(); });
    }
    t->workspaces_.push_back(std::move(model));
    t->owners_.push_back(-1);
  }
  // The stage messages land here; the model copies them in (a micro-batch's forward or backward
  // is one tick).
  const auto message = static_cast<size_t>(po.train.context * po.train.model.d_model);
  if (t->stage_ > 0) t->x_in_.assign(message, 0.0f);
  if (t->stage_ + 1 < po.pp) t->dx_in_.assign(message, 0.0f);
  for (int k = 0; k < slots; ++k) {
    auto s = std::make_unique<Slot>();
    if (po.schedule == "colocated") {
      DispatchAttentionOptions d;
      d.policy = "none";
      d.backward_mode = po.train.backward_mode;
      d.grad_return = po.train.grad_return;
      d.threads = po.train.threads;
      d.tolerance = po.train.tolerance;
      d.granularity = po.train.granularity;
      DISTCA_ASSIGN_OR_RETURN(s->attention, DispatchAttention::create(*t->groups_.dp, shard, d));
      if (t->pingpong_) {
        for (auto& nano : s->nano) {
          DISTCA_ASSIGN_OR_RETURN(nano, DispatchAttention::create(*t->groups_.dp, shard, d));
        }
      }
    }
    t->slots_.push_back(std::move(s));
  }
  if (po.schedule == "cad") {
    for (int n = 0; n < (t->pingpong_ ? 2 : 1); ++n) t->pooled_[n] = std::make_unique<TickAttention>(range.first, per);
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

comm::Communicator& PipelineTrainer::attention_comm() const {
  return options_.schedule == "cad" ? *groups_.cad : *groups_.dp;
}

Result<runtime::ScheduleTiming> PipelineTrainer::run_chains(std::array<std::vector<runtime::Stage>, 2>& chains) {
  std::optional<runtime::ProgressThread> progress;
  if (options_.train.progress == "thread") {
    progress.emplace([this] { return attention_comm().progress(); }, std::chrono::microseconds(options_.train.progress_interval_us));
  }
  Result<runtime::ScheduleTiming> r = options_.train.pingpong == "sequential" ? runtime::run_sequential(chains[0], chains[1])
                                                                             : runtime::run_pingpong(chains[0], chains[1]);
  if (progress) DISTCA_RETURN_IF_ERROR(progress->stop());
  return r;
}

Result<std::unique_ptr<runtime::Dispatcher>> PipelineTrainer::plan_tick(const std::vector<runtime::PipeSlot>& tick,
                                                                        const std::vector<StepData>& mbs, int nano,
                                                                        bool is_backward, PipelineStepRecord::Rank& me) {
  const auto begin = Clock::now();
  // One plan for the tick: every active (stage, micro-batch) over all ranks; a micro-batch with
  // nothing in this nano-batch adds nothing (its ranks serve in it).
  std::vector<plan::PoolPart> parts;
  for (int r = 0; r < pp_; ++r) {
    if (tick[r].op == runtime::PipeOp::kIdle) continue;
    const int m = tick[r].micro_batch;
    const plan::Batch& b = nano < 0 ? mbs[m].batch : nanos_[m].batches[nano];
    if (b.num_docs() > 0) parts.push_back({&b, r * dp_, r, m});
  }
  comm::Communicator& servers = *groups_.cad;  // the ranks of this TP index, ranked stage-major
  const int64_t T = options_.train.context;
  DISTCA_ASSIGN_OR_RETURN(plan::PooledBatch pool, plan::pool_batches(parts, servers.size(), T));
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn fn, plan::find_planner(options_.train.policy));
  plan::PlannerOptions opt;
  opt.tolerance = options_.train.tolerance;
  opt.granularity = options_.train.granularity;
  const plan::CostModel cost(model_shape(options_.train.model, options_.train.grad_return), plan::cpu_throughput_profile());
  DISTCA_ASSIGN_OR_RETURN(plan::Plan p, fn(pool.batch, cost, opt));
  TickPlan record{is_backward, nano, {}, pool.batch, p.tasks};
  for (int r = 0; r < pp_; ++r) record.micro_batch.push_back(tick[r].micro_batch);
  last_ticks_.push_back(std::move(record));
  me.other += seconds_since(begin);
  const auto setup = Clock::now();
  runtime::DispatchOptions dopt;
  dopt.backward_mode = plan::BackwardMode::kStateless;
  dopt.grad_return = options_.train.grad_return;
  dopt.num_threads = options_.train.threads;
  // Ping-pong: the server kernel polls the exchange in flight while it computes (--progress poll).
  if (nano >= 0 && options_.train.progress == "poll") dopt.poll = [this] { (void)attention_comm().progress(); };
  const ModelConfig& c = state_.config;  // this TP rank's heads
  DISTCA_ASSIGN_OR_RETURN(auto dispatcher, runtime::Dispatcher::create(servers, pool.batch, p,
                                                                      runtime::HeadShape{c.num_q_heads, c.num_kv_heads, c.head_dim}, dopt));
  if (groups_.map.tp > 1) {
    DISTCA_RETURN_IF_ERROR(check_same_plan(*groups_.tp, p.hash, fmt::format("step {}, tick plan{}", step_ + 1,
                                                                           nano < 0 ? "" : fmt::format(", nano-batch {}", nano))));
  }
  me.comm += seconds_since(setup);  // the plan-hash check is a collective
  return dispatcher;
}

Status PipelineTrainer::run_tick(const std::vector<runtime::PipeSlot>& tick, std::vector<StepData>& mbs, double scale,
                                 double& loss_sum, PipelineStepRecord::Rank& me) {
  const runtime::PipeSlot mine = tick[stage_];
  const bool is_cad = options_.schedule == "cad", is_idle = mine.op == runtime::PipeOp::kIdle;
  // Two nano-batches when a micro-batch of the tick splits: cad, any (the tick's plans pool
  // them all); colocated, this rank's.
  bool is_backward = mine.op == runtime::PipeOp::kBackward, two = false;
  for (int r = 0; r < pp_; ++r) {
    if (tick[r].op == runtime::PipeOp::kIdle || (!is_cad && r != stage_)) continue;
    is_backward = tick[r].op == runtime::PipeOp::kBackward;  // cad: one direction per tick (lockstep)
    two = two || (pingpong_ && splits_[tick[r].micro_batch]);
  }
  if (!is_cad) return is_idle ? Status::ok() : run_micro_batch(mine, two, mbs[mine.micro_batch], scale, loss_sum, me);
  std::array<std::unique_ptr<runtime::Dispatcher>, 2> dispatchers;
  for (int n = 0; n < (two ? 2 : 1); ++n) {
    DISTCA_ASSIGN_OR_RETURN(dispatchers[n], plan_tick(tick, mbs, two ? n : -1, is_backward, me));
    pooled_[n]->set(dispatchers[n].get());
  }
  Status st = Status::ok();
  if (!is_idle) {
    st = run_micro_batch(mine, two, mbs[mine.micro_batch], scale, loss_sum, me);
  } else {
    // No micro-batch of its own: serve every exchange of the tick's plans.
    const auto t0 = Clock::now();
    AttentionTimes served;
    for (int n = 0; n < (two ? 2 : 1); ++n) pooled_[n]->times = {};
    if (two) {
      const int64_t per = options_.train.model.num_layers / pp_;
      std::array<std::vector<runtime::Stage>, 2> chains;
      for (int n = 0; n < 2; ++n) chains[n] = serve_stages(*pooled_[n], stage_ * per, per, is_backward);
      st = run_chains(chains).status();
    } else {
      st = pooled_[0]->serve(is_backward);
    }
    for (int n = 0; n < (two ? 2 : 1); ++n) served.compute += pooled_[n]->times.compute, served.comm += pooled_[n]->times.comm;
    me.attention += served.compute;
    me.comm += served.comm;
    me.served_in_idle += served.compute;
    me.other += seconds_since(t0) - served.compute - served.comm;
  }
  for (auto& p : pooled_) if (p) p->set(nullptr);
  return st;
}

Status PipelineTrainer::bind_workspace(int slot) {
  int w = static_cast<int>(std::find(owners_.begin(), owners_.end(), -1) - owners_.begin());
  if (w == static_cast<int>(owners_.size())) {
    // Every workspace is held: free the one whose micro-batch's backward comes last (both
    // schedules run the backwards in micro-batch order), keeping what its recompute needs.
    w = 0;
    for (int k = 1; k < static_cast<int>(owners_.size()); ++k) {
      if (slots_[owners_[k]]->micro_batch > slots_[owners_[w]]->micro_batch) w = k;
    }
    Slot& held = *slots_[owners_[w]];
    const ModelConfig& c = held.model->config();
    const int64_t T = options_.train.context, o = T * c.q_width(), lse = T * c.num_q_heads;
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
  owners_[w] = slot;
  Slot& s = *slots_[slot];
  s.workspace = w;
  s.model = workspaces_[w].get();
  return Status::ok();
}

void PipelineTrainer::release_workspace(Slot& s) {
  if (s.workspace >= 0) owners_[s.workspace] = -1;
  s.workspace = -1;
  s.model = nullptr;
  for (auto& x : s.slices) x.reset();
}

Result<double> PipelineTrainer::recompute(int slot, const StepData& data, double scale) {
  DISTCA_RETURN_IF_ERROR(bind_workspace(slot));
  Slot& s = *slots_[slot];
  Model<float>& model = *s.model;
  const ModelConfig& c = model.config();
  const int64_t T = options_.train.context, d = options_.train.model.d_model, o = T * c.q_width(), lse = T * c.num_q_heads;
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
  auto phases = [&](Model<float>& m, const StepTokens& tokens, const float* x_in) -> Status {
    const double before = m.tp_seconds();
    DISTCA_RETURN_IF_ERROR(m.begin_forward(state_, tokens, x_in));
    for (int64_t l = 0; l < m.num_stage_layers(); ++l) {
      m.forward_pre_attention(state_, l);
      DISTCA_RETURN_IF_ERROR(m.forward_post_attention(state_, l));
    }
    m.finish_forward(state_, scale);
    tp += m.tp_seconds() - before;
    return Status::ok();
  };
  const float* x_in = stage_ > 0 ? s.saved.data() : nullptr;
  if (!s.split) {
    DISTCA_RETURN_IF_ERROR(phases(model, StepTokens{data.slice(data.tokens, replica_), data.slice(data.targets, replica_),
                                                    data.slice(data.positions, replica_)}, x_in));
    return tp;
  }
  int64_t first_row = 0;
  for (int n = 0; n < 2; ++n) {
    const auto count = static_cast<int64_t>(nanos_[s.micro_batch].rows[n][replica_].size());
    s.slices[n] = model.slice(first_row, count);
    DISTCA_RETURN_IF_ERROR(phases(*s.slices[n], StepTokens{s.ids[n][0], s.ids[n][1], s.ids[n][2]},
                                  x_in ? x_in + first_row * d : nullptr));
    first_row += count;
  }
  return tp;
}

Status PipelineTrainer::run_micro_batch(runtime::PipeSlot mine, bool two, const StepData& data, double scale,
                                        double& loss_sum, PipelineStepRecord::Rank& me) {
  const int64_t T = options_.train.context, d = options_.train.model.d_model;
  const bool is_cad = options_.schedule == "cad", is_forward = mine.op == runtime::PipeOp::kForward;
  const int m = mine.micro_batch;
  const int slot = m % static_cast<int>(slots_.size());
  Slot& s = *slots_[slot];
  if (is_forward) {
    s.micro_batch = m;
    s.split = two && splits_[m];
    DISTCA_RETURN_IF_ERROR(bind_workspace(slot));
  } else if (s.micro_batch != m) {
    return internal_error(fmt::format("stage {}: backward of micro-batch {} without its forward", stage_, m));
  } else if (s.model == nullptr) {
    const auto t0 = Clock::now();
    DISTCA_ASSIGN_OR_RETURN(const double tp, recompute(slot, data, scale));
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
    AttentionBackend<float>& attention = is_cad ? static_cast<AttentionBackend<float>&>(*pooled_[0]) : *s.attention;
    PassTimes pass;
    if (is_forward) {
      if (!is_cad) DISTCA_RETURN_IF_ERROR(timed(me.comm, [&] { return s.attention->begin_step(data.batch); }));
      const StepTokens in{tokens, targets, positions};
      DISTCA_ASSIGN_OR_RETURN(double loss, s.model->forward(state_, in, attention, scale, &pass, has_message ? message : nullptr));
      if (groups_.me.tp == 0) loss_sum += loss;  // a replica's loss once
    } else {
      DISTCA_RETURN_IF_ERROR(s.model->backward(state_, attention, &pass, has_message ? message : nullptr));
    }
    me.linear += pass.linear();
    me.attention += pass.attention;
    me.comm += pass.comm;
  } else {
    // Two nano-batches in row slices of the workspace, A's rows first. A micro-batch that does
    // not split (cad: another stage's does) runs whole in nano-batch A's plan, its rows in their
    // order, and serves in B's.
    const bool split = splits_[m];
    std::array<StagedAttention*, 2> att{};
    std::array<NanoPass, 2> passes;
    std::array<Model<float>*, 2> models{s.model, nullptr};
    int64_t first_row = 0;
    for (int n = 0; n < 2; ++n) {
      att[n] = is_cad ? static_cast<StagedAttention*>(pooled_[n].get()) : s.nano[n].get();
      if (!split && n == 1) break;
      const float* in = has_message ? message + first_row * d : nullptr;
      StepTokens ids{tokens, targets, positions};
      if (split) {
        const std::vector<int64_t>& rows = nanos_[m].rows[n][replica_];
        const auto count = static_cast<int64_t>(rows.size());
        if (is_forward) {
          for (auto& v : s.ids[n]) v.clear();
          for (int64_t r : rows) {
            s.ids[n][0].push_back(tokens[r]);
            s.ids[n][1].push_back(targets[r]);
            s.ids[n][2].push_back(positions[r]);
          }
          s.slices[n] = s.model->slice(first_row, count);
          if (!is_cad) DISTCA_RETURN_IF_ERROR(timed(me.comm, [&] { return s.nano[n]->begin_step(nanos_[m].batches[n]); }));
        }
        ids = StepTokens{s.ids[n][0], s.ids[n][1], s.ids[n][2]};
        models[n] = s.slices[n].get();
        first_row += count;
      }
      passes[n] = NanoPass{models[n], &state_, att[n], ids, is_forward ? in : nullptr, is_forward ? nullptr : in, scale, 0};
    }
    const int64_t per = options_.train.model.num_layers / pp_;
    std::array<std::vector<runtime::Stage>, 2> chains;
    for (int n = 0; n < 2; ++n) {
      chains[n] = models[n] == nullptr ? serve_stages(*att[n], stage_ * per, per, !is_forward)
                  : is_forward         ? forward_stages(passes[n])
                                       : backward_stages(passes[n]);
    }
    if (!is_forward) state_.grads.fill(0.0f);  // both nano-batches add theirs
    std::array<AttentionTimes, 2> before{att[0]->times, att[1]->times};
    auto tp_seconds = [&] { return models[0]->tp_seconds() + (models[1] ? models[1]->tp_seconds() : 0.0); };
    const double tp_before = tp_seconds();
    const auto t0 = Clock::now();
    DISTCA_RETURN_IF_ERROR(run_chains(chains).status());
    if (!is_forward) DISTCA_RETURN_IF_ERROR(models[0]->reduce_shared_grads(state_));
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
    const float* g = state_.grads.data();
    for (int64_t i = own_begin_; i < own_end_; ++i) acc_[i - own_begin_] += g[i];
    me.other += seconds_since(t0);
    if (stage_ > 0) DISTCA_RETURN_IF_ERROR(send(s.model->input_grad(), T * d, stage_ - 1, kGradientTag));
    s.micro_batch = -1;
    release_workspace(s);
  }
  return Status::ok();
}

Result<PipelineStepRecord> PipelineTrainer::step() {
  const auto begin = Clock::now();
  PipelineStepRecord::Rank me;
  const int M = options_.micro_batches;
  std::vector<StepData> mbs;
  int64_t targets = 0;
  for (int m = 0; m < M; ++m) {
    DISTCA_ASSIGN_OR_RETURN(StepData data, packer_->next());
    targets += data.num_targets;
    mbs.push_back(std::move(data));
  }
  const double scale = targets > 0 ? 1.0 / static_cast<double>(targets) : 0.0;
  last_batches_.clear();
  for (const StepData& data : mbs) last_batches_.push_back(data.batch);
  last_ticks_.clear();
  acc_.assign(static_cast<size_t>(own_end_ - own_begin_), 0.0f);
  sends_peak_bytes_ = 0;
  for (auto& p : pooled_) if (p) p->reset_peak();
  nanos_.clear();
  splits_.assign(static_cast<size_t>(M), 0);
  if (pingpong_) {
    for (int m = 0; m < M; ++m) {
      DISTCA_ASSIGN_OR_RETURN(runtime::NanoBatches nb, runtime::split_nano_batches(mbs[m].batch));
      splits_[m] = nb.batches[1].num_docs() > 0;
      nanos_.push_back(std::move(nb));
    }
  }
  double loss_sum = 0;
  for (const auto& tick : schedule_.ticks) {
    const auto t0 = Clock::now();
    const PipelineStepRecord::Rank was = me;
    DISTCA_RETURN_IF_ERROR(run_tick(tick, mbs, scale, loss_sum, me));
    if (tick[stage_].op == runtime::PipeOp::kIdle) {
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
  me.idle += seconds_since(t);
  t = Clock::now();
  if (dp_ > 1) DISTCA_RETURN_IF_ERROR(groups_.dp->all_reduce_sum(acc_.data(), static_cast<int64_t>(acc_.size())));
  std::copy(acc_.begin(), acc_.end(), state_.grads.data() + own_begin_);
  // The stage's sum of squares (with TP: over its TP group), then every stage's, one slot each (a
  // float sum of P values keeps the order fixed).
  DISTCA_ASSIGN_OR_RETURN(const double ss, gradient_square_sum(state_, own_begin_, own_end_, groups_));
  std::vector<float> squares(static_cast<size_t>(pp_), 0.0f);
  squares[stage_] = static_cast<float>(ss);
  DISTCA_RETURN_IF_ERROR(groups_.pp->all_reduce_sum(squares.data(), pp_));
  double total = 0;
  for (float x : squares) total += x;
  const double norm = std::sqrt(total);
  me.comm += seconds_since(t);
  t = Clock::now();
  const double lr = options_.train.optim.lr_at(state_.step);
  adamw_step_range(state_, options_.train.optim, own_begin_, own_end_, norm);
  me.optimizer += seconds_since(t);
  me.step = seconds_since(begin);
  me.other = me.step - me.linear - me.attention - me.comm - me.pipeline_wait - me.idle - me.optimizer;
  constexpr int64_t f = sizeof(float);
  me.memory_states = 4 * state_.params.size() * f + static_cast<int64_t>(acc_.capacity()) * f;
  for (const auto& w : workspaces_) me.memory_activations += w->allocated_bytes();
  me.memory_activations += static_cast<int64_t>(x_in_.capacity() + dx_in_.capacity()) * f;
  for (const auto& s : slots_) {
    me.memory_activations += static_cast<int64_t>(s->saved.capacity()) * f;
    if (s->attention) me.memory_attention += s->attention->buffer_bytes();
  }
  for (const auto& p : pooled_) me.memory_attention += p ? p->peak_bytes() : 0;  // ping-pong: both coexist
  me.memory_messages = sends_peak_bytes_;
  // Every rank's numbers, one row each; a byte count travels as two floats of 24 bits each, so
  // it arrives exact.
  enum Col { kStep, kLinear, kAttention, kComm, kPipe, kIdle, kOpt, kOther, kServed, kRecompute, kLoss, kMem, kCols = kMem + 8 };
  const int R = world_.size();
  std::vector<float> all(static_cast<size_t>(kCols * R), 0.0f);
  const double row[kMem] = {me.step, me.linear, me.attention, me.comm, me.pipeline_wait, me.idle, me.optimizer, me.other,
                            me.served_in_idle, me.recompute, loss_sum};
  for (int i = 0; i < kMem; ++i) all[world_.rank() * kCols + i] = static_cast<float>(row[i]);
  const int64_t memory[4] = {me.memory_states, me.memory_activations, me.memory_attention, me.memory_messages};
  for (int i = 0; i < 4; ++i) {
    all[world_.rank() * kCols + kMem + 2 * i] = static_cast<float>(memory[i] >> 24);
    all[world_.rank() * kCols + kMem + 2 * i + 1] = static_cast<float>(memory[i] & ((int64_t{1} << 24) - 1));
  }
  DISTCA_RETURN_IF_ERROR(world_.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  PipelineStepRecord rec;
  rec.step = ++step_;
  rec.schedule = options_.schedule;
  for (char split : splits_) rec.split_micro_batches += split;
  rec.grad_norm = norm;
  rec.lr = lr;
  double loss = 0, attn_sum = 0, attn_max = 0;
  for (int r = 0; r < R; ++r) {
    auto at = [&](int c) { return static_cast<double>(all[r * kCols + c]); };
    PipelineStepRecord::Rank x{at(kStep), at(kLinear), at(kAttention), at(kComm), at(kPipe), at(kIdle), at(kOpt), 0,
                               at(kServed), at(kRecompute)};
    x.other = x.step - x.linear - x.attention - x.comm - x.pipeline_wait - x.idle - x.optimizer;
    auto bytes = [&](int i) {
      return (static_cast<int64_t>(all[r * kCols + kMem + 2 * i]) << 24) + static_cast<int64_t>(all[r * kCols + kMem + 2 * i + 1]);
    };
    x.memory_states = bytes(0);
    x.memory_activations = bytes(1);
    x.memory_attention = bytes(2);
    x.memory_messages = bytes(3);
    rec.memory_max_bytes = std::max(rec.memory_max_bytes, x.memory());
    rec.memory_mean_bytes += static_cast<double>(x.memory()) / R;
    rec.ranks.push_back(x);
    rec.step_seconds = std::max(rec.step_seconds, x.step);
    loss += at(kLoss);
    attn_sum += x.attention;
    attn_max = std::max(attn_max, x.attention);
  }
  rec.loss = targets > 0 ? loss / static_cast<double>(targets) : 0.0;
  rec.attention_imbalance = attn_sum > 0 ? attn_max / (attn_sum / R) : 1.0;
  rec.tokens_per_second = static_cast<double>(M) * dp_ * options_.train.context / rec.step_seconds;
  if (!std::isfinite(rec.loss)) return internal_error(fmt::format("step {}: the loss is {}", rec.step, rec.loss));
  return rec;
}

nlohmann::json PipelineStepRecord::to_json() const {
  nlohmann::json rs = nlohmann::json::array();
  for (const Rank& r : ranks) {
    rs.push_back({{"step_seconds", r.step},           {"linear_seconds", r.linear},
                  {"attention_seconds", r.attention}, {"comm_seconds", r.comm},
                  {"pipeline_wait_seconds", r.pipeline_wait}, {"idle_seconds", r.idle},
                  {"optimizer_seconds", r.optimizer}, {"other_seconds", r.other},
                  {"served_in_idle_seconds", r.served_in_idle}, {"recompute_seconds", r.recompute},
                  {"memory_states_bytes", r.memory_states}, {"memory_activations_bytes", r.memory_activations},
                  {"memory_attention_bytes", r.memory_attention}, {"memory_messages_bytes", r.memory_messages},
                  {"memory_bytes", r.memory()}});
  }
  return {{"step", step},
          {"schedule", schedule},
          {"split_micro_batches", split_micro_batches},
          {"loss", loss},
          {"grad_norm", grad_norm},
          {"lr", lr},
          {"step_seconds", step_seconds},
          {"tokens_per_second", tokens_per_second},
          {"attention_imbalance", attention_imbalance},
          {"memory_max_bytes", memory_max_bytes},
          {"memory_mean_bytes", memory_mean_bytes},
          {"ranks", rs}};
}

}  // namespace distca::model
