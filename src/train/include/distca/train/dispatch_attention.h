// DispatchAttention: the model's core attention through the CAD runtime. Each step the step's
// layout is planned by a planner (plan::find_planner: "none" is colocated attention, any other
// CAD), the same on every rank, and one Dispatcher per step moves every layer's Q/K/V to the
// attention servers and O/LSE back (the backward mirrored). fp32.
#pragma once
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distca/comm/communicator.h"
#include "distca/core/stopwatch.h"
#include "distca/model/attention.h"
#include "distca/plan/cost.h"
#include "distca/plan/planner.h"
#include "distca/runtime/dispatcher.h"

namespace distca::train {

struct DispatchAttentionOptions {
  std::string policy = std::string(plan::kDefaultPlanner);  // a planner name; "none" is colocated attention
  plan::BackwardMode backward_mode = plan::BackwardMode::kStateful;
  int threads = 1;                // CPU attention threads per rank
  double tolerance = 0.05;        // planner eps
  int64_t granularity = 128;      // planner shard granularity in tokens
  // The dtype of the dK/dV partial sums on the backward return (runtime::DispatchOptions); the
  // planner counts the plan's bytes at it.
  plan::GradReturn grad_return = plan::GradReturn::kFp32;
};

plan::ModelShape model_shape(const model::ModelConfig& config, plan::GradReturn grad_return = plan::GradReturn::kFp32);

// The bytes a dispatcher sent, all phases (the trainers' attention_bytes).
int64_t bytes_sent(const runtime::Dispatcher& dispatcher);
// Adds a plan's tasks to `tasks`, and those over part of their rows' key range (k0 > 0 or
// non-causal) to `split`.
void count_tasks(const std::vector<plan::Task>& plan_tasks, int64_t& tasks, int64_t& split);

// A backend whose passes also run in stages, for a caller that overlaps them with other work
// (ping-pong; see runtime::Dispatcher): start_* packs and posts the dispatch, finish_dispatch
// waits for it, compute runs this rank's server kernel, start_return posts the return,
// finish_return waits and unpacks O/LSE (dQ/dK/dV) into the linear layout. The pointers must
// stay valid until finish_return. Communication seconds go to times.comm, the kernel's to
// times.compute.
class StagedAttention : public model::AttentionBackend<float> {
 public:
  virtual Status start_forward(int layer, const runtime::ForwardArgs& f) = 0;
  virtual Status start_backward(int layer, const runtime::BackwardArgs& b) = 0;
  virtual Status finish_dispatch() = 0;
  virtual Status compute() = 0;
  virtual Status start_return() = 0;
  virtual Status finish_return() = 0;
};

class DispatchAttention final : public StagedAttention {
 public:
  // Checks the options; `comm` must outlive the backend.
  static Result<std::unique_ptr<DispatchAttention>> create(comm::Communicator& comm, const model::ModelConfig& config,
                                                           DispatchAttentionOptions options);
  std::string name() const override { return options_.policy == "none" ? "colocated" : "cad"; }
  Status begin_step(const plan::Batch& batch) override;  // plan_step, then begin_step with its plan
  // The step's plan under this backend's policy and options (its seconds go to planning_seconds).
  Result<plan::Plan> plan_step(const plan::Batch& batch);
  // A step with a plan made elsewhere (ping-pong: a nano-batch's share of the micro-batch's plan,
  // is_part: covering part of the batch's queries, layout::split_step). held_kv: the K/V rows
  // its servers hold from `earlier`'s forward of each layer (layout::NanoSplit::held_kv; the
  // stateful backward only), whose backward must then run after this one's, layer by layer.
  Status begin_step(const plan::Batch& batch, plan::Plan plan, bool is_part = false,
                    std::vector<layout::KvInterval> held_kv = {}, DispatchAttention* earlier = nullptr);
  const model::ModelConfig& config() const { return config_; }
  const plan::CostModel& cost() const { return cost_; }
  Status forward(int layer, const float* q, const float* k, const float* v, float* o, float* lse) override;
  Status backward(int layer, const float* q, const float* k, const float* v, const float* o, const float* lse,
                  const float* d_o, float* dq, float* dk, float* dv) override;

  // The pass in stages (StagedAttention); forward() / backward() run all five.
  Status start_forward(int layer, const runtime::ForwardArgs& f) override;
  Status start_backward(int layer, const runtime::BackwardArgs& b) override;
  Status finish_dispatch() override;
  Status compute() override;
  Status start_return() override;
  Status finish_return() override;

  const DispatchAttentionOptions& options() const { return options_; }
  // From the next begin_step (a memory budget picks it step by step: data_parallel.h).
  void set_backward_mode(plan::BackwardMode mode) { options_.backward_mode = mode; }
  // Frees every buffer and the step's dispatcher (a backend that sits a step out).
  void release();
  // The bytes buffer_bytes() will report for a step of `tasks` (over `batch`; is_part and
  // held_kv as begin_step's) under `mode`, on each rank: [rank]. Exact for a step whole; for
  // the earlier of two ping-pong nano-batches `holds_for_later` adds the held rows' pending dK/dV,
  // one layer's (runtime::ServerBuffers::held_dk). No collective: every rank gets every rank's.
  static Result<std::vector<int64_t>> predict_bytes(const plan::Batch& batch, const std::vector<plan::Task>& tasks,
                                                    const model::ModelConfig& config, plan::BackwardMode mode,
                                                    plan::GradReturn grad_return, bool is_part = false,
                                                    const std::vector<layout::KvInterval>& held_kv = {},
                                                    bool holds_for_later = false);
  // From the next begin_step: called by the CPU server kernel between its work items
  // (runtime::DispatchOptions::poll), e.g. the communicator's progress under ping-pong.
  void set_poll(std::function<void()> poll) { poll_ = std::move(poll); }
  // Labels this backend's trace spans as nano-batch n's (ping-pong).
  void set_trace_nano(int n) { nano_ = n; }
  // This step's plan and dispatcher (after begin_step).
  const plan::Plan& plan() const { return plan_; }
  const runtime::Dispatcher* dispatcher() const { return dispatcher_.get(); }
  double planning_seconds = 0;  // accumulated
  // The most bytes the attention-server buffers and the exchange buffers held at once since
  // begin_step (this step's peak).
  int64_t buffer_bytes() const { return peak_bytes_; }

 private:
  DispatchAttention(comm::Communicator& comm, const model::ModelConfig& config, DispatchAttentionOptions options,
                    plan::PlanFn planner);
  Status run(int layer, bool is_backward, const runtime::ForwardArgs& f, const runtime::BackwardArgs& b);
  Status start_pass(int layer, bool is_backward, const runtime::ForwardArgs& f, const runtime::BackwardArgs& b);
  void lend_backward_set(runtime::ServerBuffers& server);
  int pass_layer_ = -1;     // the layer whose pass is between start and finish_return
  bool is_backward_pass_ = false;
  int nano_ = -1;            // the trace's label: ping-pong's nano-batch
  SteadyClock::time_point posted_{};  // the exchange in flight: when it was posted (the trace)
  void exchanged(const char* name) const;
  bool pass_lends_ = false;  // it borrowed the backward set

  comm::Communicator& comm_;
  model::ModelConfig config_;
  DispatchAttentionOptions options_;
  plan::PlanFn planner_;
  plan::CostModel cost_;
  plan::Plan plan_;
  std::unique_ptr<runtime::Dispatcher> dispatcher_;
  std::function<void()> poll_;
  DispatchAttention* earlier_ = nullptr;  // whose servers' K/V this step's dispatcher holds
  std::vector<runtime::ServerBuffers> servers_;  // one per layer (a stateful backward keeps them)
  // Stateful: the backward buffers (dO, dQ, dK, dV) of the layer in its backward; every layer
  // borrows this one set, so a server holds each layer's forward state but one backward set.
  runtime::ServerBuffers backward_scratch_;
  int64_t current_bytes() const;
  void sample() { peak_bytes_ = std::max(peak_bytes_, current_bytes()); }
  int64_t peak_bytes_ = 0;
};

}  // namespace distca::train
