// What a training step measured, the same record from both trainers (trainer.h): every rank's
// time split into parts, and the straggler's breakdown and the across-rank numbers derived from
// those parts; and the summary of a run's records.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace distca::train {

// One step of one backend, over all ranks.
struct StepRecord {
  int64_t step = 0;     // 1 for the first step of a run from scratch, as printed
  std::string backend;  // "colocated" or "cad" (with pp > 1: the pipeline schedule it names)
  double loss = 0;      // mean over the step's targets
  double grad_norm = 0; // before clipping
  double lr = 0;
  double tokens_per_second = 0;
  int micro_batches = 1;        // data parallel: the step is one
  int split_micro_batches = 0;  // of them, run as two ping-pong nano-batches
  std::string backward_mode;    // data parallel: the step's (a memory budget may pick it)
  bool colocated_plan = false;  // data parallel cad: no plan fitted the budget, attention ran colocated
  // Data parallel: the per-rank budget (0: none), and the fullest rank's memory() as predicted
  // from the step's plan before it ran (0 without a budget); the measured one is at most this.
  int64_t memory_budget_bytes = 0;
  int64_t memory_predicted_bytes = 0;
  // CA tasks in the step's plans (the same plan on every rank of a group is counted once): data
  // parallel, the step's plan (with ping-pong both nano-batches'); pipeline cad, every tick's
  // pooled plan; pipeline colocated, every stage's plan of each of its micro-batches.
  int64_t attention_tasks = 0;
  int64_t split_tasks = 0;  // of them, tasks over part of their rows' key range (k0 > 0 or non-causal)

  // One rank's step. Its parts add up to `step`:
  //   linear + attention + comm + pipeline_wait + idle + wait + optimizer + other
  // (`other` is computed as what is left, so the sum holds after the gather's float rounding).
  struct Rank {
    double step = 0;
    double linear = 0;         // the model outside attention (norms, GEMMs, loss) on this rank's rows
    double attention = 0;      // attention kernels (as a server, for any rank or stage)
    double comm = 0;           // attention dispatch and return, plan checks, gradient all-reduces
    double pipeline_wait = 0;  // pp > 1: waiting for the previous (next) stage's activations (gradients)
    double idle = 0;           // pp > 1: ticks without a micro-batch of its own, less what it served in them
    double wait = 0;           // at the barrier that ends the step: waiting for the slowest rank
    double optimizer = 0;
    double other = 0;          // the rest (planning, packing, bookkeeping)
    // Inside the parts above:
    double grad_reduce = 0;     // of comm: the gradient all-reduce and norm after the backward
                                // (grad_sync "overlap": what was left in flight when it ended)
    double served_in_idle = 0;  // of attention: served in ticks without a micro-batch of its own
    double recompute = 0;       // of linear: recomputing activations (recompute)
    int64_t attention_bytes = 0;  // sent by this rank's attention exchanges, all phases
    // Memory at the step's peak, bytes (buffers only grow within a step): parameters, gradients
    // and AdamW moments as held (with pp > 1 every rank holds the whole model's, and the stage's
    // gradient accumulator); activation workspaces (with pp > 1 also the stage messages they
    // receive and the saved attention outputs of recompute); attention buffers (server and
    // exchange buffers); copies of stage messages still in flight.
    int64_t memory_states = 0, memory_activations = 0, memory_attention = 0, memory_messages = 0;
    int64_t memory() const { return memory_states + memory_activations + memory_attention + memory_messages; }

    // The rank as a row of kSlots floats of the gather (put_count below): the times rounded to
    // float, the bytes exact. from_row closes the sum with `other`, so the parts still add up to
    // the step.
    static constexpr int kSlots = 11 + 2 * 5;
    void to_row(float* row) const;
    static Rank from_row(const float* row);
  };
  std::vector<Rank> ranks;  // (world)

  // Derived from `ranks` by derive().
  // The straggler: the rank with the most busy time, step - wait: the others wait for it at the
  // step's end, so its breakdown is the step's critical path (step time alone would pick a rank
  // by noise, often one that spent most of its step waiting).
  int slowest_rank = 0;
  double step_seconds = 0;  // the straggler's
  double attention_min_seconds = 0, attention_max_seconds = 0;
  double wait_max_seconds = 0;
  double attention_imbalance = 0;  // max / mean over ranks of attention seconds
  // A lower bound on this step's time, from what each rank computed: no step can beat
  // max(the largest rank's linear + optimizer work, the mean over ranks of linear + optimizer +
  // attention work), the step with compute perfectly balanced and communication and waiting free.
  double bound_seconds = 0;
  int64_t attention_bytes = 0;  // over all ranks
  int64_t memory_max_bytes = 0;  // the fullest rank's Rank::memory()
  double memory_mean_bytes = 0;  // the mean over ranks

  const Rank& straggler() const { return ranks.at(static_cast<size_t>(slowest_rank)); }
  // Fills the derived fields from `ranks` (not empty).
  void derive();
  nlohmann::json to_json() const;
};

// The trainers gather every rank's numbers in one float all-reduce, a row of slots per rank; a
// count (bytes, tasks; below 2^48) takes two slots of 24 bits each, so that it arrives exact.
void put_count(float* slots, int64_t count);
int64_t get_count(const float* slots);

// The loss of one backend on the held-out steps.
struct EvalRecord {
  int64_t step = 0;  // after this many training steps
  std::string backend;
  double loss = 0;   // mean over the held-out targets
  int64_t targets = 0;
  nlohmann::json to_json() const;
};

// A summary of a whole run: per backend the mean step time and the straggler's parts, tokens/s,
// waits, the lower bound, memory and losses, and with two backends the speedup and the loss
// agreement. The first `skip` steps (warm-up) are left out of the time means (at least one step
// is kept). The loss means are over the first and last k = min(10, steps / 2) steps (k = 1 for
// one step). `stages`: the pipeline stages the ranks are grouped into, stage-major (memory within
// a stage, where the schedule does not decide it). REQUIRES: records is not empty.
nlohmann::json summarize(const std::vector<StepRecord>& records, int64_t skip, int stages = 1);

}  // namespace distca::train
