// The pipeline-parallel trainer (options.pp = P > 1; trainer.h): the model's layers split over
// P stages, D = world / (P x TP) data-parallel replicas per stage, each replica's model
// optionally split over TP tensor-parallel ranks (the rank map of tensor_parallel.h: world rank
// w is TP index w % TP, replica (w / TP) % D, stage w / (TP x D); every group below is per TP
// index), M micro-batches per step (each D ranks x T tokens, packed from the stream as the
// data-parallel trainer packs a step), walked by a tick table (plan/pipeline_schedule.h).
// Each backend is a schedule; with two, both train on the same micro-batches, step by step:
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
#include <utility>
#include <vector>

#include "distca/comm/communicator.h"
#include "distca/layout/step_split.h"
#include "distca/model/model.h"
#include "distca/runtime/pingpong.h"
#include "distca/plan/pipeline_schedule.h"
#include "distca/train/data.h"
#include "distca/train/dispatch_attention.h"
#include "distca/train/tensor_parallel.h"
#include "distca/train/trainer.h"

namespace distca::train {

class PipelineTrainer final : public Trainer {
 public:
  // Collective over `world`. make_trainer picks this trainer for pp > 1; with pp == 1 it is one
  // stage accumulating the gradient over M micro-batches (the tests' reference for a pipeline).
  static Result<std::unique_ptr<PipelineTrainer>> create(comm::Communicator& world, TrainOptions options);
  ~PipelineTrainer() override;
  // One step of every backend's schedule, on the same M micro-batches.
  Result<std::vector<StepRecord>> step() override;
  int64_t steps_done() const override { return step_; }
  const TrainOptions& options() const override { return options_; }
  const RankMap& rank_map() const override { return groups_.map; }
  std::string data_description() const override;
  int64_t epoch() const override { return packer_->epoch(); }
  // Refused: validate() refuses validation with pp > 1.
  Result<std::vector<EvalRecord>> evaluate() override;
  StepPlans last_plans(size_t backend) const override;

  const plan::PipelineSchedule& schedule(size_t backend) const;
  int tp_index() const { return groups_.me.tp; }
  int stage() const { return stage_; }
  int replica() const { return replica_; }
  model::ModelState<float>& state(size_t backend);
  // Arena elements [begin, end) of the blocks this rank's stage owns.
  std::pair<int64_t, int64_t> owned_range() const { return {own_begin_, own_end_}; }
  // The last step's accumulated gradient of the owned blocks, after the DP all-reduce (before
  // clipping): the tests compare it with one rank's.
  const std::vector<float>& last_gradient(size_t backend) const;

 private:
  struct Slot;
  struct Run;
  class TickAttention;
  struct Pending {
    std::vector<float> data;
    std::unique_ptr<comm::Work> work;
  };
  PipelineTrainer(comm::Communicator& world, TrainOptions options);
  Result<StepRecord> step_one(Run& run, const std::vector<StepData>& mbs);
  Status send(const float* data, int64_t count, int peer, int tag);
  Status run_tick(Run& run, const std::vector<plan::PipeSlot>& tick, const std::vector<StepData>& mbs, double scale,
                  double& loss_sum, StepRecord::Rank& me);
  // cad: the tick's pooled plan and its dispatcher; nano -1: the whole micro-batches, else each
  // one's nano-batch `nano`.
  Result<std::unique_ptr<runtime::Dispatcher>> plan_tick(Run& run, const std::vector<plan::PipeSlot>& tick,
                                                         const std::vector<StepData>& mbs, int nano, bool is_backward,
                                                         StepRecord::Rank& me);
  // Gives slot a workspace, freeing the one whose backward comes last if none is free (its
  // O and LSE saved for the recompute).
  Status bind_workspace(Run& run, int slot);
  void release_workspace(Run& run, Slot& s);
  // Binds a workspace to a slot whose activations were freed and recomputes them; returns the
  // seconds of tensor-parallel all-reduces in it (communication).
  Result<double> recompute(Run& run, int slot, const StepData& data, double scale);
  // This rank's micro-batch of the tick, whole or as two nano-batches run in ping-pong.
  Status run_micro_batch(Run& run, plan::PipeSlot mine, bool two, const StepData& data, double scale,
                         double& loss_sum, StepRecord::Rank& me);
  // Two chains in ping-pong (or in sequence, for benchmarks) with the progress option.
  Result<runtime::ScheduleTiming> run_chains(const Run& run, std::array<std::vector<runtime::Stage>, 2>& chains);
  comm::Communicator& attention_comm(const Run& run) const;

  comm::Communicator& world_;
  TrainOptions options_;
  int pp_ = 1, dp_ = 1, stage_ = 0, replica_ = 0;
  RankGroups groups_;  // tp, dp, pp and cad (the pooled servers: every rank of this TP index)
  std::unique_ptr<Packer> packer_;
  int64_t own_begin_ = 0, own_end_ = 0;
  std::vector<std::unique_ptr<Run>> runs_;  // one per backend
  std::vector<float> x_in_, dx_in_;  // [T, d] the stage message from the previous / next stage
  std::vector<std::unique_ptr<Pending>> sends_;  // messages in flight, with their copies
  int64_t sends_peak_bytes_ = 0;                 // the most their copies held at once this step
  std::vector<plan::Batch> last_batches_;
  int64_t step_ = 0;
};

}  // namespace distca::train
