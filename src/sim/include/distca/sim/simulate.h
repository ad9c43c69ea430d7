// The cluster simulator: one training iteration of a system, priced with a profile. A unit is
// one tensor-parallel group (tp GPUs, with its per-GPU share of heads and linear work). There
// are gpus / tp units: pp stages x dp replicas x cp context-parallel units. Every micro-batch
// of a replica is one packed sequence of `context` tokens (documents sampled from the
// workload), held by cp units of context / cp tokens each. Systems:
//   colocated   the sequence as packed, with per-document context parallelism (Megatron THD):
//               every document cut into 2 cp pieces over the cp units (equal attention inside
//               a CP group, in short pieces) with an exposed all-gather of the sequence's K/V
//               per layer and a reduce-scatter of its dK/dV backward; replicas (DP) and
//               micro-batches (PP) keep their imbalance; 1F1B for PP
//   wlb         WLB-LLM-style, the paper's "WLB-ideal": the iteration's documents re-packed into
//               variable-length chunks balanced by linear + attention cost, each chunk on a CP
//               group with per-document CP as above; run at every CP degree that divides a
//               stage's units and leaves at most two replicas per sequence, the fastest kept
//               (as the paper's baseline sweep), or at --wlb-cp
//   cad-distca  CAD with the paper's planner (stateless backward); cad: CAD with the default
//               planner (plan::kDefaultPlanner: key-range splits, stateful backward); cad-minmax: CAD with
//               minmax (whole causal shards, stateful). The sequence stays as packed (context / cp tokens per unit),
//               every unit is an in-place attention server for the CA tasks the planner gives
//               it, with per-layer dispatch and return and ping-pong over two nano-batches (four
//               ticks per layer, each half the work); with PP the CA tasks of a wave of pp
//               micro-batches (those in flight together) are balanced across all stages and
//               replicas, and the link time that ping-pong cannot hide is exposed; each CAD
//               system runs every iteration at the fastest of --tolerance, its half, ... its
//               512th (tolerance_sweep; the planners are priced with the profile's rates by key
//               range, as the simulator prices their tasks)
// All systems end with the DP gradient all-reduce (bf16 gradients).
// Memory per GPU: the activations a unit holds at its peak (Korthikanti et al. 2022, with flash
// attention) plus the model states of Megatron's distributed optimizer with 16-bit parameters and
// gradients, 4 + 16 / d bytes per parameter (Megatron Core developer guide, "Distributed
// Optimizer"), d = a stage's units (its DP x CP group). It is checked against the profile's
// device memory; nothing else on the GPU (CUDA context, NCCL buffers) is counted.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/progress.h"
#include "distca/core/status.h"
#include "distca/plan/model_shape.h"
#include "distca/plan/plan.h"
#include "distca/plan/workload.h"
#include "distca/sim/profile.h"

namespace distca::sim {

struct Cluster {
  int gpus = 64;
  int gpus_per_node = 8;
  int tp = 8;
  int pp = 1;
  int cp = 1;
  int units() const { return gpus / tp; }
  int dp() const { return gpus / tp / pp / cp; }
  Status validate() const;
};

struct SimOptions {
  plan::ModelShape model;     // tp is taken from the cluster
  Cluster cluster;
  int64_t context = 131072;   // tokens per micro-batch (one packed sequence, over cp units)
  int batch = 4;              // micro-batches per DP replica per iteration
  std::string workload = "pretrain";
  plan::SamplingOptions sampling;  // how documents are drawn (its seed is replaced per micro-batch)
  uint64_t seed = 1;
  double tolerance = 0.05;     // the planners' balance bound, the loosest one tried (tolerance_sweep)
  bool tolerance_sweep = true; // CAD systems run at the fastest of tolerance, /2, ..., /512 per iteration
  int64_t granularity = 128;
  int wlb_cp = 0;             // wlb's CP degree (0: WLB-ideal, the fastest of the degrees it may use)
  int iterations = 1;         // sampled iterations averaged: seeds seed, seed + 1, ...
  Status validate() const;
};

// One system's iteration; with several iterations, the mean of each time and per-unit number,
// and the peak of the memory numbers. Every unit's linear + attention + comm + idle is the
// iteration time, and so is the sum of the means over units (linear + attention + comm + idle).
struct SystemResult {
  std::string system;
  int cp = 1;              // context-parallel degree the system ran at (most iterations', if they differ)
  std::vector<int> iteration_cp;          // (iterations) the CP degree of each iteration
  std::optional<double> tolerance;        // CAD systems: the planner's tolerance (the first iteration's)
  std::vector<double> iteration_tolerance;  // (iterations) CAD systems: the tolerance each iteration ran at
  std::vector<double> iteration_seconds;  // (iterations) each iteration's time
  double seconds = 0;      // one iteration: its slowest unit, with the gradient all-reduce
  double linear = 0;       // mean over units of seconds in linear layers
  double attention = 0;    // mean over units of seconds in core attention
  double comm = 0;         // mean over units of exposed communication
  double idle = 0;         // the rest: waiting for stragglers, pipeline bubbles
  double allreduce = 0;    // the gradient all-reduce (inside comm)
  int64_t bytes = 0;       // moved between units for attention (dispatch, return, KV gathers), all units
  std::vector<double> unit_linear;     // (units) linear seconds per iteration
  std::vector<double> unit_attention;  // (units) attention seconds per iteration
  std::vector<double> unit_comm;       // (units) exposed communication seconds, with the all-reduce
  std::vector<double> unit_memory;     // (units) activation bytes per GPU at the peak
  double state_memory = 0;    // bytes per GPU of weights, gradients and optimizer states
  double memory_per_gpu = 0;  // the fullest GPU's bytes: its activations + state_memory
  double device_memory = 0;   // the profile's bytes per GPU (0: unknown, not checked)
  // Seconds unit u waits: the iteration time less its linear, attention and communication.
  double unit_idle(size_t u) const { return seconds - unit_linear[u] - unit_attention[u] - unit_comm[u]; }
  bool fits_memory() const { return device_memory <= 0 || memory_per_gpu <= device_memory; }
  nlohmann::json to_json() const;
};

// One data-parallel step of a given layout and task list (no PP, no CP), scheduled as the
// training loop runs it (distca train): per layer, each rank's linear work, then attention
// through the plan's servers; ranks meet at every exchange when any task crosses ranks, else
// only at the end. `linear_seconds_per_token_layer` and `fixed_seconds` come from a measured
// profile's LinearEntry; attention and links from the profile. Returns the predicted step.
struct StepPrediction {
  double seconds = 0;
  double linear = 0;     // per rank
  double attention = 0;  // the slowest server's
  double comm = 0;       // exposed link time
};
StepPrediction predict_step(const Profile& profile, const plan::ModelShape& model, const plan::Batch& batch,
                            const std::vector<plan::Task>& tasks, plan::BackwardMode mode,
                            double linear_seconds_per_token_layer, double fixed_seconds);

// One pipeline-parallel step as distca train --pp runs it (train::PipelineTrainer): P stages x D
// replicas (rank = stage x D + replica), M micro-batches of D ranks x T tokens.
//   colocated  1F1B (timing.h's one_f_one_b): a stage's forward (backward) of micro-batch m takes
//              its L / P layers' linear work on T tokens plus the attention of its own pieces (the
//              slowest replica's), and a stage message of T x d fp32 over the link
//   cad        the lockstep ticks: in a tick every layer slot ends at an exchange of all ranks, so a
//              slot takes the slowest rank's linear work (an idle stage has none) plus attention
//              (the tick's pooled plan) plus the exchange (each phase: the busiest rank's bytes)
// Linear work: the profile's seconds per token per layer, a third forward, two thirds backward.
struct PipelineStepInput {
  int stages = 1;
  int dp = 1;
  std::vector<plan::Batch> micro_batches;  // (M) D ranks each
  struct Tick {
    bool is_backward = false;
    std::vector<int> micro_batch;     // (stages) the micro-batch each stage runs, -1: idle
    plan::Batch pool;                 // every active (stage, micro-batch), over all P x D ranks
    std::vector<plan::Task> tasks;    // the tick's plan of the pool
  };
  std::vector<Tick> ticks;            // cad: every tick of the step; empty: colocated 1F1B
};
StepPrediction predict_pipeline_step(const Profile& profile, const plan::ModelShape& model, const PipelineStepInput& step,
                                     double linear_seconds_per_token_layer, double fixed_seconds);

std::vector<std::string> system_names();  // colocated, wlb, cad-distca, cad, cad-minmax
// One result per system, in the order asked, each the mean of options.iterations iterations.
// `progress` (may be null) is told each system, iteration, eps and planned micro-batch.
Result<std::vector<SystemResult>> simulate(const Profile& profile, const SimOptions& options,
                                           const std::vector<std::string>& systems, Progress* progress = nullptr);

}  // namespace distca::sim
