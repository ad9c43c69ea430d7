// Pipeline-parallel training (issue 18): the model's layers split over P stages, D = world / (P x TP)
// data-parallel replicas per stage, each replica's model optionally split over TP tensor-parallel
// ranks (the rank map of tensor_parallel.h: world rank w is TP index w % TP, replica (w / TP) % D,
// stage w / (TP x D); every group below is per TP index), M micro-batches
// per step (each D ranks x T tokens, packed from the stream as the data-parallel trainer packs a
// step), walked by a tick table (runtime/pipeline_schedule.h):
//   colocated  plain 1F1B; each stage attends its own micro-batch over its DP group (planner
//              "none": only a document split across DP ranks moves its key prefix)
//   cad        lockstep ticks; in every tick one plan pools the core attention of every active
//              (stage, micro-batch) over all P x D ranks, and a rank whose stage has nothing to
//              run in the tick serves attention without running any linear layer. Pooled plans
//              are planned per tick with the stateless backward (a forward and its backward
//              fall in different ticks, with different pools).
// Activations go forward and their gradients back between stages by point-to-point messages on
// the replica's PP group. Gradients are accumulated over the micro-batches, all-reduced over
// each stage's DP group, clipped by the global norm (summed over the PP group) and applied by
// AdamW to the blocks the stage owns. Every rank holds the whole ModelState (drawn from the same
// seed), but uses and updates only its stage's contiguous range of it.
#pragma once
#include <array>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/comm/communicator.h"
#include "distca/model/tensor_parallel.h"
#include "distca/model/trainer.h"
#include "distca/runtime/pingpong.h"
#include "distca/runtime/pipeline_schedule.h"

namespace distca::model {

struct PipelineOptions {
  TrainOptions train;            // context: tokens per rank of one micro-batch
  int pp = 1;                    // stages (divides the layers and the ranks)
  int micro_batches = 0;         // M per step; 0: 2 pp
  std::string schedule = "cad";  // "colocated" (1F1B) or "cad" (lockstep, pooled plans)
  // A stage holds as many activation workspaces as the last stage (the fewest micro-batches in
  // flight) and recomputes the linear activations of the others before their backward, from
  // their stage input and saved attention outputs: memory even across stages, for some compute.
  bool recompute = false;
  Status validate(int world_size) const;
};

// One step, over all ranks. Every rank's time is split into parts that add up to its step:
// linear + attention + comm + pipeline_wait + idle + optimizer + other.
struct PipelineStepRecord {
  int64_t step = 0;
  std::string schedule;
  int split_micro_batches = 0;  // micro-batches run as two nano-batches (ping-pong)
  double loss = 0;
  double grad_norm = 0;
  double lr = 0;
  double step_seconds = 0;  // the slowest rank's
  double tokens_per_second = 0;
  struct Rank {
    double step = 0;
    double linear = 0;         // the model outside attention, on this rank's micro-batches
    double attention = 0;      // attention kernels (as a server, for any stage)
    double comm = 0;           // attention dispatch and return, plan checks, all-reduces
    double pipeline_wait = 0;  // waiting for the previous (next) stage's activations (gradients)
    double idle = 0;           // ticks without a micro-batch of its own, less what it served in them
    double optimizer = 0;
    double other = 0;          // the rest (planning, packing, bookkeeping)
    double served_in_idle = 0; // attention seconds served in ticks without a micro-batch of its own (cad; inside attention)
    double recompute = 0;      // recomputing activations (--recompute; inside linear)
    // Memory at the step's peak, bytes (buffers only grow within a step): parameters, gradients
    // and AdamW moments as held (every rank holds the whole model's) and the stage's gradient
    // accumulator; the micro-batch workspaces (activations and the stage messages they receive);
    // attention buffers (cad: the pooled server's buffers and the tick's exchange buffers at
    // their largest; colocated: each workspace's); copies of stage messages still in flight.
    int64_t memory_states = 0, memory_activations = 0, memory_attention = 0, memory_messages = 0;
    int64_t memory() const { return memory_states + memory_activations + memory_attention + memory_messages; }
  };
  std::vector<Rank> ranks;     // (world)
  double attention_imbalance = 0;  // max / mean over all ranks of attention seconds
  int64_t attention_bytes = 0;     // sent by the attention exchanges, all ranks
  int64_t memory_max_bytes = 0;    // the fullest rank's Rank::memory()
  double memory_mean_bytes = 0;    // the mean over ranks
  nlohmann::json to_json() const;
};

class PipelineTrainer {
 public:
  // Collective over `world`.
  static Result<std::unique_ptr<PipelineTrainer>> create(comm::Communicator& world, PipelineOptions options);
  ~PipelineTrainer();
  Result<PipelineStepRecord> step();

  const PipelineOptions& options() const { return options_; }
  const runtime::PipelineSchedule& schedule() const { return schedule_; }
  const RankMap& rank_map() const { return groups_.map; }
  int tp_index() const { return groups_.me.tp; }
  int stage() const { return stage_; }
  int replica() const { return replica_; }
  ModelState<float>& state() { return state_; }
  // Arena elements [begin, end) of the blocks this rank's stage owns.
  std::pair<int64_t, int64_t> owned_range() const { return {own_begin_, own_end_}; }
  // The last step's accumulated gradient of the owned blocks, after the DP all-reduce (before
  // clipping): the tests compare it with one rank's.
  const std::vector<float>& last_gradient() const { return acc_; }
  // The last step's micro-batches, and (cad) each tick's pool and plan: what the simulator prices.
  struct TickPlan {
    bool is_backward = false;
    int nano = -1;  // ping-pong: the nano-batch (0, 1) the plan is of; -1: whole micro-batches
    std::vector<int> micro_batch;  // (stages) -1: idle
    plan::Batch pool;
    std::vector<plan::Task> tasks;
  };
  const std::vector<plan::Batch>& last_micro_batches() const { return last_batches_; }
  const std::vector<TickPlan>& last_tick_plans() const { return last_ticks_; }

 private:
  struct Slot;
  class TickAttention;
  struct Pending {
    std::vector<float> data;
    std::unique_ptr<comm::Work> work;
  };
  Status send(const float* data, int64_t count, int peer, int tag);
  PipelineTrainer(comm::Communicator& world, PipelineOptions options);
  Status run_tick(const std::vector<runtime::PipeSlot>& tick, std::vector<StepData>& mbs, double scale,
                  double& loss_sum, PipelineStepRecord::Rank& me);
  // cad: the tick's pooled plan and its dispatcher; nano -1: the whole micro-batches, else each
  // one's nano-batch `nano`.
  Result<std::unique_ptr<runtime::Dispatcher>> plan_tick(const std::vector<runtime::PipeSlot>& tick,
                                                         const std::vector<StepData>& mbs, int nano, bool is_backward,
                                                         PipelineStepRecord::Rank& me);
  // This rank's micro-batch of the tick, whole or as two nano-batches run in ping-pong.
  // Gives slot a workspace, freeing the one whose backward comes last if none is free (its
  // O and LSE saved for the recompute).
  Status bind_workspace(int slot);
  void release_workspace(Slot& s);
  // Binds a workspace to a slot whose activations were freed and recomputes them; returns the
  // seconds of tensor-parallel all-reduces in it (communication).
  Result<double> recompute(int slot, const StepData& data, double scale);
  Status run_micro_batch(runtime::PipeSlot mine, bool two, const StepData& data, double scale, double& loss_sum,
                         PipelineStepRecord::Rank& me);
  // Two chains in ping-pong (or in sequence, for benchmarks) with the progress option.
  Result<runtime::ScheduleTiming> run_chains(std::array<std::vector<runtime::Stage>, 2>& chains);
  comm::Communicator& attention_comm() const;

  comm::Communicator& world_;
  PipelineOptions options_;
  int pp_ = 1, dp_ = 1, stage_ = 0, replica_ = 0;
  RankGroups groups_;  // tp, dp, pp and cad (the pooled servers: every rank of this TP index)
  runtime::PipelineSchedule schedule_;
  std::unique_ptr<Packer> packer_;
  ModelState<float> state_;
  int64_t own_begin_ = 0, own_end_ = 0;
  std::vector<float> acc_;
  std::vector<std::unique_ptr<Slot>> slots_;  // micro-batch m uses slots_[m % size]
  std::vector<std::unique_ptr<Model<float>>> workspaces_;  // activations (as many as slots without recompute)
  std::vector<int> owners_;                                // the slot each workspace holds (-1: free)
  std::vector<float> x_in_, dx_in_;  // [T, d] the stage message from the previous / next stage
  // cad: the tick's pooled attention (ping-pong: one per nano-batch).
  std::array<std::unique_ptr<TickAttention>, 2> pooled_;
  bool pingpong_ = false;  // micro-batches of two or more documents run as two nano-batches
  // This step's micro-batches split into nano-batches (ping-pong), and whether each splits (it
  // has documents in both).
  std::vector<runtime::NanoBatches> nanos_;
  std::vector<char> splits_;  std::vector<std::unique_ptr<Pending>> sends_;  // messages in flight, with their copies
  int64_t sends_peak_bytes_ = 0;                 // the most their copies held at once this step
  std::vector<plan::Batch> last_batches_;
  std::vector<TickPlan> last_ticks_;
  int64_t step_ = 0;
};

}  // namespace distca::model
