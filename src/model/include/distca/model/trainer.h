// The training loop: data-parallel ranks, each with T tokens of every step, a Llama-style model,
// attention through one or two backends ("colocated", "cad"), gradients all-reduced through the
// Communicator, clipped, AdamW. With two backends (--compare) both train from the same weights
// on the same data, step by step interleaved, so their times are measured in the same run.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/comm/communicator.h"
#include "distca/comm/emulated_link.h"
#include "distca/model/config.h"
#include "distca/model/data.h"
#include "distca/model/dispatch_attention.h"
#include "distca/model/grad_sync.h"
#include "distca/model/model.h"
#include "distca/model/nano_chain.h"
#include "distca/model/tensor_parallel.h"
#include "distca/plan/planner.h"

namespace distca::model {

struct TrainOptions {
  ModelConfig model;
  OptimConfig optim;
  int64_t context = 256;          // tokens per rank per step
  int64_t steps = 20;
  std::string workload = "pretrain";  // synthetic source lengths (when data_path is empty)
  std::string data_path;          // a .jsonl file or a directory; empty: the synthetic source
  uint64_t data_seed = 1;
  std::vector<std::string> backends = {"cad"};  // "colocated" and/or "cad", in run order
  std::string policy = std::string(plan::kDefaultPlanner);  // the CAD planner
  plan::BackwardMode backward_mode = plan::BackwardMode::kStateful;
  // The dtype CAD's dK/dV partial sums cross ranks in, summed in fp32 at the owner. fp32 by
  // default: this trainer is fp32 throughout and checks that CAD equals colocated to 1e-5 (fp32
  // rounding); bf16 (the paper's) halves those bytes and moved the demo's losses by 6.4e-6
  // relative at most over 50 steps, too close to that check to be the default here
  // (reports/cpu/2026-11-27-grad-return).
  plan::GradReturn grad_return = plan::GradReturn::kFp32;
  int tp = 1;                     // tensor-parallel ranks per model replica (see tensor_parallel.h)
  // Ping-pong inside the step: "on" plans the step once and splits the plan into two
  // nano-batches at a position in each document (runtime::split_plan), whose layers alternate so
  // that one's attention dispatch and return are in flight while the other computes; "off" runs the step
  // whole, each layer dispatch -> compute -> return; "auto": on for cad, off for colocated.
  // "sequential" (benchmarks): the two nano-batches of "on", one after the other, nothing
  // overlapped: the same plans and bytes as "on", so the two times differ by the overlap alone.
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
  // The data-parallel gradient all-reduce: "overlap" sums each block's (the head's, each
  // layer's two, the embedding's; grad_sync.h) once the backward has finished it, so that it
  // moves during the backward of the layers below (advanced as `progress` says): with ping-pong
  // paced, in slices posted right after each backward attention exchange (queued behind it on
  // the link, not ahead of the next); "eager", each block's at once; "after", one all-reduce of
  // every gradient after the backward. The sums are the same. With tp > 1 the shared key/value
  // heads' gradients are summed after the backward, so the sync runs after too.
  std::string grad_sync = "overlap";
  // Benchmarks: the attention's dispatch and return over an emulated link of this latency and
  // bandwidth (comm/emulated_link.h) over the data-parallel group; unset: that group itself.
  std::optional<comm::LinkOptions> attention_link;
  int threads = 1;                // BLAS and attention threads per rank
  int64_t granularity = 0;        // planner granularity; 0: context / 32 rounded down to a power of two, 16..128
  double tolerance = 0.05;
  std::string checkpoint_path;    // where to save; empty: never
  int64_t save_every = 0;         // steps between saves (0: only at the end)
  std::string resume_path;        // a checkpoint to start from
  // Validation: every eval_every steps (0: never) the loss on eval_steps steps of held-out
  // documents (the last eval_docs documents of a file source, never trained on; for the
  // synthetic source another seed's stream), the same R x T tokens per step as training.
  int64_t eval_every = 0;
  int64_t eval_docs = 64;
  int64_t eval_steps = 1;

  Status validate() const;
  nlohmann::json to_json() const;
};

// One step of one backend, over all ranks.
struct StepRecord {
  int64_t step = 0;           // 1 for the first step of a run from scratch, as printed
  std::string backend;
  double loss = 0;            // mean over the step's targets
  double grad_norm = 0;       // before clipping
  double lr = 0;
  double step_seconds = 0;    // the straggler's (slowest_rank's)
  double tokens_per_second = 0;
  // The straggler's own breakdown of its step; the terms add up to step_seconds exactly. The
  // straggler (slowest_rank) is the rank with the most busy time, step - wait: the others wait
  // for it at the all-reduce, so its breakdown is the step's critical path.
  int slowest_rank = 0;
  double linear_seconds = 0;     // everything in the model but attention (norms, GEMMs, loss)
  double attention_seconds = 0;  // attention kernels
  double comm_seconds = 0;       // attention dispatch and return, plan check, gradient all-reduce
  // Of comm_seconds: the gradient all-reduce (data parallel) and norm after the backward; with
  // grad_sync "overlap", what was left of the all-reduces when the backward ended.
  double grad_reduce_seconds = 0;
  double wait_seconds = 0;       // at the barrier before the all-reduce: waiting for the slowest rank
  double optimizer_seconds = 0;
  double other_seconds = 0;      // the rest of the step (planning, bookkeeping)
  // Across ranks.
  double attention_min_seconds = 0, attention_max_seconds = 0;
  double wait_max_seconds = 0;
  double attention_imbalance = 0;  // max / mean over ranks of attention seconds
  // A lower bound on this step's time, from what each rank computed: no step can beat
  // max(the largest rank's linear + optimizer work, the mean over ranks of linear + optimizer +
  // attention work), the step with compute perfectly balanced and communication and waiting free.
  double bound_seconds = 0;
  int64_t attention_bytes = 0;  // sent between ranks by the attention backend, all ranks and phases
  int64_t attention_tasks = 0;  // CA tasks in this step's plan (one plan per step, all layers)
  int64_t split_tasks = 0;      // of them, tasks over part of their rows' key range (k0 > 0 or non-causal)
  // 2: the step ran as two ping-pong nano-batches (tasks and bytes are both plans'); 1: whole
  // (ping-pong off, or a step with a single document, which cannot be split).
  int nano_batches = 1;
  // Memory per rank at the end of the step (the buffers only grow within a step): this backend's
  // parameters, gradients and AdamW moments, the model's activation workspace (the same on every
  // rank), and its attention buffers (server buffers per layer and exchange buffers), which
  // differ by rank; max and mean over ranks.
  int64_t memory_states_bytes = 0;
  int64_t memory_activations_bytes = 0;
  int64_t memory_attention_max_bytes = 0;
  double memory_attention_mean_bytes = 0;
  int64_t memory_max_bytes = 0;
  double memory_mean_bytes = 0;
  nlohmann::json to_json() const;
};

// A memory estimate for one rank of a run with these options, in bytes: parameters, gradients
// and AdamW moments of every backend, the model's activation workspace, and the attention
// buffers (CAD: the largest exchange a plan within the tolerance may ask for).
struct MemoryEstimate {
  int64_t states_bytes = 0;
  int64_t activations_bytes = 0;
  int64_t attention_bytes = 0;
  int64_t data_bytes = 0;
  int64_t total() const { return states_bytes + activations_bytes + attention_bytes + data_bytes; }
};
// `ranks`: the world (with tensor parallelism, options.tp of them share each replica's tokens).
MemoryEstimate estimate_memory(const TrainOptions& options, int ranks);

// The planner granularity a run of `context` tokens per rank uses when --granularity is 0 (auto):
// the largest power of two <= context / 32, within 16..128 (tile boundaries; see distca plan).
int64_t default_granularity(int64_t context);

// The loss of one backend on the held-out steps.
struct EvalRecord {
  int64_t step = 0;  // after this many training steps
  std::string backend;
  double loss = 0;   // mean over the held-out targets
  int64_t targets = 0;
  nlohmann::json to_json() const;
};

// With tensor parallelism (options.tp = T > 1) the world is T x D ranks (rank map in
// tensor_parallel.h): the D replicas each take a context of tokens; the T ranks of a replica share
// it, each running its slice of the heads and FFN; CAD plans over the D replicas and every TP
// index dispatches its own head slice among the ranks of the same index.
class Trainer {
 public:
  // Collective (every rank creates its trainer with the same options).
  static Result<std::unique_ptr<Trainer>> create(comm::Communicator& comm, TrainOptions options);
  ~Trainer();
  // One step of every backend.
  Result<std::vector<StepRecord>> step();
  int64_t steps_done() const { return step_; }
  const RankMap& rank_map() const { return groups_.map; }
  // The emulated link of options().attention_link (nullptr without one): its counters, and new
  // latency and bandwidth between steps.
  comm::EmulatedLink* attention_link() { return link_.get(); }
  const RankCoords& coords() const { return groups_.me; }
  // The data source's epoch as of the last step (0 until a file source wraps).
  int64_t epoch() const { return packer_->epoch(); }
  // The loss of every backend on the held-out steps (collective). REQUIRES: eval_every > 0.
  Result<std::vector<EvalRecord>> evaluate();
  const TrainOptions& options() const { return options_; }
  std::string data_description() const;
  // Saves every backend's state to options().checkpoint_path (rank 0 writes).
  Status save() const;
  // The state of backend i (tests).
  ModelState<float>& state(size_t i);
  // The last step's layout, and backend i's plan of it (calibration prices exactly these).
  const plan::Batch& last_batch() const { return last_batch_; }
  // With ping-pong the step ran two plans, of the nano-batches: this is the unsplit backend's, so
  // it is meaningful with ping-pong off only.
  const plan::Plan& last_plan(size_t i) const;

 private:
  struct Run;
  struct Pass;
  Trainer(comm::Communicator& comm, TrainOptions options);
  Result<StepRecord> step_one(Run& run, const StepData& data);
  // The forward and backward of one step on this rank, whole or as two ping-pong nano-batches.
  Result<Pass> whole_pass(Run& run, const StepData& data);
  Result<Pass> pingpong_pass(Run& run, const StepData& data);

  comm::Communicator& comm_;
  TrainOptions options_;
  RankGroups groups_;  // tp and dp (no pipeline: pp groups of one)
  std::unique_ptr<comm::EmulatedLink> link_;  // over groups_.dp, for the attention (benchmarks)
  comm::Communicator& attention_comm() { return link_ ? static_cast<comm::Communicator&>(*link_) : *groups_.dp; }
  std::unique_ptr<Packer> packer_;
  std::unique_ptr<Model<float>> model_;  // one workspace, shared by the backends' states
  std::unique_ptr<GradientSync> grad_sync_;  // grad_sync "overlap" over more than one replica
  std::vector<std::unique_ptr<Run>> runs_;
  int64_t step_ = 0;
  plan::Batch last_batch_;
  std::vector<StepData> validation_;
  ContextRows context_;  // ping-pong: the rows nano-batch B reads of A's (positional split)
  std::array<std::array<std::vector<int32_t>, 3>, 2> nano_ids_;  // ping-pong: tokens, targets, positions per nano-batch
};

// A summary of a whole run: per backend mean step time (and its parts), tokens/s, waits, the
// lower bound and losses, and with two backends the speedup and the loss agreement. The first
// `skip` steps (warm-up) are left out of the time means (at least one step is kept). The loss
// means are over the first and last k = min(10, steps / 2) steps (k = 1 for one step).
// REQUIRES: records is not empty.
nlohmann::json summarize(const std::vector<StepRecord>& records, int64_t skip);

}  // namespace distca::model
