#include "distca/train/dispatch_attention.h"

#include <chrono>

#include <fmt/format.h>

#include "distca/core/stopwatch.h"
#include "distca/core/trace.h"

namespace distca::train {

namespace {
using Clock = SteadyClock;
}  // namespace

plan::ModelShape model_shape(const model::ModelConfig& c, plan::GradReturn grad_return) {
  plan::ModelShape m;
  m.name = "train";
  m.num_layers = static_cast<int>(c.num_layers);
  m.hidden = static_cast<int>(c.d_model);
  m.num_q_heads = static_cast<int>(c.num_q_heads);
  m.num_kv_heads = static_cast<int>(c.num_kv_heads);
  m.head_dim = static_cast<int>(c.head_dim);
  m.ffn_hidden = static_cast<int>(c.ffn_dim);
  m.dtype_bytes = 4;
  m.tp = 1;
  m.grad_return = grad_return;
  return m;
}

int64_t bytes_sent(const runtime::Dispatcher& d) {
  int64_t bytes = 0;
  for (int p = 0; p < plan::kNumPhases; ++p) bytes += d.stats(static_cast<plan::Phase>(p)).bytes_sent;
  return bytes;
}

void count_tasks(const std::vector<plan::Task>& plan_tasks, int64_t& tasks, int64_t& split) {
  for (const plan::Task& task : plan_tasks) {
    ++tasks;
    split += task.k0 > 0 || !task.is_causal() ? 1 : 0;
  }
}

Result<std::unique_ptr<DispatchAttention>> DispatchAttention::create(comm::Communicator& comm, const model::ModelConfig& config,
                                                                     DispatchAttentionOptions options) {
  DISTCA_RETURN_IF_ERROR(config.validate());
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn fn, plan::find_planner(options.policy));
  plan::PlannerOptions po;
  po.tolerance = options.tolerance;
  po.granularity = options.granularity;
  DISTCA_RETURN_IF_ERROR(po.validate());
  if (options.threads < 1 || options.threads > 1024) {
    return invalid_argument(fmt::format("attention threads must be 1..1024, got {}", options.threads));
  }
  DISTCA_RETURN_IF_ERROR(model_shape(config, options.grad_return).validate());
  return std::unique_ptr<DispatchAttention>(new DispatchAttention(comm, config, std::move(options), fn));
}

DispatchAttention::DispatchAttention(comm::Communicator& comm, const model::ModelConfig& config,
                                     DispatchAttentionOptions options, plan::PlanFn planner)
    : comm_(comm),
      config_(config),
      options_(std::move(options)),
      planner_(planner),
      cost_(model_shape(config, options_.grad_return), plan::cpu_throughput_profile()) {
  servers_.resize(static_cast<size_t>(config.num_layers));
}

Result<plan::Plan> DispatchAttention::plan_step(const plan::Batch& batch) {
  const auto begin = Clock::now();
  plan::PlannerOptions po;
  po.tolerance = options_.tolerance;
  po.granularity = options_.granularity;
  Result<plan::Plan> p = planner_(batch, cost_, po);
  planning_seconds += seconds_since(begin);
  trace::add("planning", "other", begin, Clock::now());
  return p;
}

Status DispatchAttention::begin_step(const plan::Batch& batch) {
  DISTCA_ASSIGN_OR_RETURN(plan::Plan p, plan_step(batch));
  return begin_step(batch, std::move(p));
}

Status DispatchAttention::begin_step(const plan::Batch& batch, plan::Plan plan, bool is_part,
                                     std::vector<layout::KvInterval> held_kv, DispatchAttention* earlier) {
  if (!held_kv.empty() && (earlier == nullptr || earlier == this || earlier->servers_.size() != servers_.size())) {
    return invalid_argument("DispatchAttention: held K/V needs the earlier nano-batch's backend, of the same layers");
  }
  plan_ = std::move(plan);
  earlier_ = held_kv.empty() ? nullptr : earlier;
  // The last step's buffers are freed: this step's, sized by its plan, are what buffer_bytes()
  // reports (and predict_bytes() foretells), whatever the steps before needed.
  release();
  runtime::DispatchOptions d;
  d.is_part = is_part;
  d.held_kv = std::move(held_kv);
  d.backward_mode = options_.backward_mode;
  d.num_threads = options_.threads;
  d.grad_return = options_.grad_return;
  d.poll = poll_;
  dispatcher_.reset();
  const auto check = Clock::now();
  DISTCA_ASSIGN_OR_RETURN(dispatcher_, runtime::Dispatcher::create(
                                           comm_, batch, plan_,
                                           layout::HeadShape{config_.num_q_heads, config_.num_kv_heads, config_.head_dim}, d));
  times.comm += seconds_since(check);  // the plan-hash check is a collective
  trace::add("plan check", "comm", check, Clock::now(), trace::kMain, -1, nano_);
  peak_bytes_ = current_bytes();
  pass_layer_ = -1;
  pass_lends_ = false;
  return Status::ok();
}

int64_t DispatchAttention::current_bytes() const {
  int64_t floats = 0;
  for (const runtime::ServerBuffers* s : {&backward_scratch_}) {
    for (const auto* v : {&s->d_o, &s->dq, &s->dk, &s->dv}) floats += static_cast<int64_t>(v->capacity());
  }
  for (const runtime::ServerBuffers& s : servers_) {
    for (const auto* v : {&s.q, &s.k, &s.v, &s.o, &s.lse, &s.d_o, &s.dq, &s.dk, &s.dv, &s.held_dk, &s.held_dv}) {
      floats += static_cast<int64_t>(v->capacity());
    }
  }
  return floats * static_cast<int64_t>(sizeof(float)) + (dispatcher_ ? dispatcher_->exchange_bytes() : 0);
}

void DispatchAttention::exchanged(const char* name) const {
  // An exchange from its post to the end of the wait for it (a silent plan posts none).
  if (!dispatcher_->is_silent()) trace::add(name, "", posted_, Clock::now(), trace::kExchange, pass_layer_, nano_);
}

void DispatchAttention::release() {
  dispatcher_.reset();
  for (runtime::ServerBuffers& s : servers_) s = runtime::ServerBuffers{};
  backward_scratch_ = runtime::ServerBuffers{};
  peak_bytes_ = 0;
}

Result<std::vector<int64_t>> DispatchAttention::predict_bytes(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                                              const model::ModelConfig& config, plan::BackwardMode mode,
                                                              plan::GradReturn grad_return, bool is_part,
                                                              const std::vector<layout::KvInterval>& held_kv,
                                                              bool holds_for_later) {
  const layout::HeadShape heads{config.num_q_heads, config.num_kv_heads, config.head_dim};
  const bool is_stateful = mode == plan::BackwardMode::kStateful;
  std::vector<int64_t> out(static_cast<size_t>(batch.num_ranks), 0);
  for (int32_t r = 0; r < batch.num_ranks; ++r) {
    DISTCA_ASSIGN_OR_RETURN(layout::Route route, is_part ? layout::build_partial_route(batch, tasks, r, held_kv)
                                                         : layout::build_route(batch, tasks, r));
    const runtime::BufferBytes b = runtime::buffer_bytes(route, heads, grad_return);
    // Stateful: a forward set per layer and the one backward set every layer borrows;
    // stateless: one set of both, shared by the layers.
    const int64_t sets = is_stateful ? config.num_layers * b.forward_set + b.backward_set : b.forward_set + b.backward_set;
    out[static_cast<size_t>(r)] = sets + b.exchange[static_cast<int>(mode)] + (holds_for_later ? 2 * b.kv : 0);
  }
  return out;
}

void DispatchAttention::lend_backward_set(runtime::ServerBuffers& server) {
  for (auto [a, b] : {std::pair{&server.d_o, &backward_scratch_.d_o}, {&server.dq, &backward_scratch_.dq},
                      {&server.dk, &backward_scratch_.dk}, {&server.dv, &backward_scratch_.dv}}) {
    a->swap(*b);
  }
}

Status DispatchAttention::start_pass(int layer, bool is_backward, const runtime::ForwardArgs& f,
                                     const runtime::BackwardArgs& b) {
  if (!dispatcher_) return invalid_argument("DispatchAttention: begin_step first");
  if (layer < 0 || layer >= static_cast<int>(servers_.size())) return invalid_argument(fmt::format("no layer {}", layer));
  if (pass_layer_ >= 0) return internal_error(fmt::format("DispatchAttention: layer {}'s pass is still running", pass_layer_));
  // The stateful backward needs each layer's forward buffers; the stateless one keeps nothing
  // between passes, so every layer reuses one set. The backward set moves between the scratch
  // and the layer's buffers for the pass.
  const bool is_stateful = options_.backward_mode == plan::BackwardMode::kStateful;
  runtime::ServerBuffers& server = is_stateful ? servers_[layer] : servers_[0];
  server.held = earlier_ ? &earlier_->servers_[layer] : nullptr;
  pass_layer_ = layer;
  is_backward_pass_ = is_backward;
  pass_lends_ = is_backward && is_stateful;
  if (pass_lends_) lend_backward_set(server);
  posted_ = Clock::now();
  const Status st = trace::timed_span(times.comm, is_backward ? "post dispatch (backward)" : "post dispatch (forward)", "comm",
                                      layer, nano_, [&] {
                                        return is_backward ? dispatcher_->start_backward(b, server)
                                                           : dispatcher_->start_forward(f, server);
                                      });
  sample();
  return st;
}

Status DispatchAttention::start_forward(int layer, const runtime::ForwardArgs& f) { return start_pass(layer, false, f, {}); }
Status DispatchAttention::start_backward(int layer, const runtime::BackwardArgs& b) { return start_pass(layer, true, {}, b); }

Status DispatchAttention::finish_dispatch() {
  const Status st = trace::timed_span(times.comm, "wait for the dispatch", "comm", pass_layer_, nano_,
                                      [this] { return dispatcher_->finish_comm(); });
  exchanged(is_backward_pass_ ? "dispatch (backward)" : "dispatch (forward)");
  return st;
}
// Sampled before the kernel too: an earlier nano-batch's buffers hold the later one's pending
// dK/dV of its held rows until this layer's backward compute adds them.
Status DispatchAttention::compute() {
  sample();
  const Status st = trace::timed_span(times.compute, is_backward_pass_ ? "server kernel backward" : "server kernel forward",
                                      "attention", pass_layer_, nano_, [this] { return dispatcher_->compute(); });
  sample();
  return st;
}
Status DispatchAttention::start_return() {
  posted_ = Clock::now();
  return trace::timed_span(times.comm, "post return", "comm", pass_layer_, nano_, [this] { return dispatcher_->start_return(); });
}

Status DispatchAttention::finish_return() {
  DISTCA_RETURN_IF_ERROR(trace::timed_span(times.comm, "wait for the return", "comm", pass_layer_, nano_,
                                           [this] { return dispatcher_->finish_comm(); }));
  exchanged(is_backward_pass_ ? "return (backward)" : "return (forward)");
  sample();
  if (pass_lends_) {
    const bool is_stateful = options_.backward_mode == plan::BackwardMode::kStateful;
    lend_backward_set(is_stateful ? servers_[pass_layer_] : servers_[0]);
  }
  pass_layer_ = -1;
  pass_lends_ = false;
  return Status::ok();
}

Status DispatchAttention::run(int layer, bool is_backward, const runtime::ForwardArgs& f, const runtime::BackwardArgs& b) {
  DISTCA_RETURN_IF_ERROR(start_pass(layer, is_backward, f, b));
  DISTCA_RETURN_IF_ERROR(finish_dispatch());
  DISTCA_RETURN_IF_ERROR(compute());
  DISTCA_RETURN_IF_ERROR(start_return());
  return finish_return();
}

Status DispatchAttention::forward(int layer, const float* q, const float* k, const float* v, float* o, float* lse) {
  return run(layer, false, {q, k, v, o, lse}, {});
}

Status DispatchAttention::backward(int layer, const float* q, const float* k, const float* v, const float* o,
                                   const float* lse, const float* d_o, float* dq, float* dk, float* dv) {
  return run(layer, true, {}, {q, k, v, o, lse, d_o, dq, dk, dv});
}

}  // namespace distca::train
