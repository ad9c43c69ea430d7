// The options of a training run, for both trainers (trainer.h): pp == 1 trains data-parallel
// (data_parallel.h), pp > 1 pipeline-parallel (pipeline.h); everything else means the same in
// both unless its comment says otherwise.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/comm/emulated_link.h"
#include "distca/core/status.h"
#include "distca/model/config.h"
#include "distca/plan/planner.h"

namespace distca::train {

struct TrainOptions {
  model::ModelConfig model;
  model::OptimConfig optim;
  int64_t context = 256;          // tokens per rank per step (with pp > 1: per micro-batch)
  int64_t steps = 20;
  std::string workload = "pretrain";  // synthetic source lengths (when data_path is empty)
  std::string data_path;          // a .jsonl file or a directory; empty: the synthetic source
  uint64_t data_seed = 1;
  // "colocated" and/or "cad", in run order. With pp > 1 each is a pipeline schedule: colocated
  // runs 1F1B, cad lockstep ticks with one pooled plan per tick (pipeline.h).
  std::vector<std::string> backends = {"cad"};
  std::string policy = std::string(plan::kDefaultPlanner);  // the CAD planner
  // With pp > 1 CAD plans every tick anew (a micro-batch's forward and backward fall in
  // different ticks), so its backward is stateless whatever this says; colocated 1F1B uses it.
  plan::BackwardMode backward_mode = plan::BackwardMode::kStateful;
  // The dtype CAD's dK/dV partial sums cross ranks in, summed in fp32 at the owner. fp32 by
  // default: this trainer is fp32 throughout and checks that CAD equals colocated to 1e-5 (fp32
  // rounding); bf16 (the paper's) halves those bytes and moved the demo's losses by 6.4e-6
  // relative at most over 50 steps, too close to that check to be the default here
  // (reports/cpu/2026-11-27-grad-return).
  plan::GradReturn grad_return = plan::GradReturn::kFp32;
  int tp = 1;                     // tensor-parallel ranks per model replica (see tensor_parallel.h)
  // Pipeline parallelism: the model's layers over pp stages (pp divides the layers, tp x pp the
  // ranks; the rest is data parallelism). micro_batches per step (0: 2 pp). recompute: every
  // stage holds as many activation workspaces as the last stage (the fewest micro-batches in
  // flight) and recomputes the others' linear activations before their backward, from their
  // stage input and saved attention outputs: memory even across stages, for some compute.
  int pp = 1;
  int micro_batches = 0;
  bool recompute = false;
  // Ping-pong inside the step: "on" plans the step once and splits the plan into two
  // nano-batches at a position in each document (layout::split_step), whose layers alternate so
  // that one's attention dispatch and return are in flight while the other computes; "off" runs the step
  // whole, each layer dispatch -> compute -> return; "auto": on for cad, off for colocated.
  // "sequential" (benchmarks): the two nano-batches of "on", one after the other, nothing
  // overlapped: the same plans and bytes as "on", so the two times differ by the overlap alone.
  // With pp > 1 each micro-batch splits by whole documents (layout::split_step_by_documents).
  std::string pingpong = "auto";
  // How a ping-pong step's transfers advance while the rank computes (MPI moves data only inside
  // MPI calls): "none", only when the schedule finishes a communication; "poll", between the
  // GEMMs of the model's phases; "thread", a progress thread polling every
  // progress_interval_us (each poll wakes it, and on a machine without a spare core takes the
  // core from compute; 1 ms keeps a slow link busy through 4 MB socket buffers: on the demo over
  // a 160 Mbit/s link its step was faster shaped and unshaped than at 50 us or 5 ms,
  // reports/cpu/2026-11-27-grad-sync).
  std::string progress = "poll";
  int64_t progress_interval_us = 1000;
  // The data-parallel gradient all-reduce (pp == 1): "overlap" sums each block's (the head's,
  // each layer's two, the embedding's; grad_sync.h) once the backward has finished it, so that it
  // moves during the backward of the layers below (advanced as `progress` says): with ping-pong
  // paced, in slices posted right after each backward attention exchange (queued behind it on
  // the link, not ahead of the next); "eager", each block's at once; "after", one all-reduce of
  // every gradient after the backward. The sums are the same. With tp > 1 the shared key/value
  // heads' gradients are summed after the backward, so the sync runs after too. With pp > 1 the
  // stage's accumulated gradient is all-reduced after the step's last backward.
  std::string grad_sync = "overlap";
  // Benchmarks (pp == 1): the attention's dispatch and return over an emulated link of this
  // latency and bandwidth (comm/emulated_link.h) over the data-parallel group; unset: that group.
  std::optional<comm::LinkOptions> attention_link;
  // The most bytes a rank may hold for a backend (pp == 1): its model states, activations and
  // attention buffers, StepRecord::Rank::memory(). Each step every backend runs the first of
  // these that its plan's buffers fit, predicted exactly before anything moves
  // (DispatchAttention::predict_bytes): as configured; without ping-pong; stateless with
  // ping-pong; stateless whole; and, for CAD, the step's attention colocated (stateless). A
  // budget below what that needs with a document per rank is refused before training; a step
  // that nothing fits (a long document's prefix K/V) is an error naming what it needs.
  // kAutoBudget: each step's is kAutoBudgetRatio x what colocated attention needs on that
  // step's batch as configured (so the last resort always fits; distca train's default); 0:
  // none, every step as configured (the default here, for a caller that asks for one
  // configuration: benchmarks, the profiler, tests).
  static constexpr int64_t kAutoBudget = -1;
  static constexpr double kAutoBudgetRatio = 1.05;
  int64_t memory_budget = 0;
  int threads = 1;                // BLAS and attention threads per rank
  int64_t granularity = 0;        // planner granularity; 0: context / 32 rounded down to a power of two, 16..128
  double tolerance = 0.05;
  // Checkpoints and validation (pp == 1).
  std::string checkpoint_path;    // where to save; empty: never
  int64_t save_every = 0;         // steps between saves (0: only at the end)
  std::string resume_path;        // a checkpoint to start from
  // Validation: every eval_every steps (0: never) the loss on eval_steps steps of held-out
  // documents (the last eval_docs documents of a file source, never trained on; for the
  // synthetic source another seed's stream), the same R x T tokens per step as training.
  int64_t eval_every = 0;
  int64_t eval_docs = 64;
  int64_t eval_steps = 1;

  // Every field in range, and the layout (tp, pp) fits `world_size` ranks and the model.
  Status validate(int world_size) const;
  nlohmann::json to_json() const;
};

// The planner granularity a run of `context` tokens per rank uses when granularity is 0 (auto):
// the largest power of two <= context / 32, within 16..128 (tile boundaries; see distca plan).
int64_t default_granularity(int64_t context);

// A memory estimate for one rank of a run with these options, in bytes: parameters, gradients
// and AdamW moments of every backend, the activation workspaces (with pp > 1 a stage's, up to
// 2 pp - 1 micro-batches in flight), and the attention buffers (CAD: the largest exchange a plan
// within the tolerance may ask for).
struct MemoryEstimate {
  int64_t states_bytes = 0;
  int64_t activations_bytes = 0;
  int64_t attention_bytes = 0;
  int64_t data_bytes = 0;
  int64_t total() const { return states_bytes + activations_bytes + attention_bytes + data_bytes; }
};
// `ranks`: the world (with tensor parallelism, options.tp of them share each replica's tokens).
MemoryEstimate estimate_memory(const TrainOptions& options, int ranks);

}  // namespace distca::train
