// The data-parallel trainer (options.pp == 1; trainer.h): data-parallel ranks, each with T
// tokens of every step, attention through each backend in turn on the same step's data,
// gradients all-reduced through the Communicator (overlapped with the backward: grad_sync.h),
// clipped, AdamW; optionally tensor parallel (options.tp), ping-pong inside the step, checkpoints
// and a validation loss. Under a memory budget (options.memory_budget) each backend runs each
// step in the first configuration whose buffers, predicted for every rank from the plan, fit.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distca/comm/communicator.h"
#include "distca/comm/emulated_link.h"
#include "distca/layout/step_split.h"
#include "distca/model/model.h"
#include "distca/train/data.h"
#include "distca/train/dispatch_attention.h"
#include "distca/train/grad_sync.h"
#include "distca/train/nano_chain.h"
#include "distca/train/tensor_parallel.h"
#include "distca/train/trainer.h"

namespace distca::train {

// With tensor parallelism (options.tp = T > 1) the world is T x D ranks (rank map in
// tensor_parallel.h): the D replicas each take a context of tokens; the T ranks of a replica share
// it, each running its slice of the heads and FFN; CAD plans over the D replicas and every TP
// index dispatches its own head slice among the ranks of the same index.
class DataParallelTrainer final : public Trainer {
 public:
  // Collective (every rank creates its trainer with the same options). REQUIRES: options.pp == 1.
  static Result<std::unique_ptr<DataParallelTrainer>> create(comm::Communicator& comm, TrainOptions options);
  ~DataParallelTrainer() override;
  // One step of every backend on the same data; saves a checkpoint when one is due.
  Result<std::vector<StepRecord>> step() override;
  int64_t steps_done() const override { return step_; }
  const TrainOptions& options() const override { return options_; }
  const RankMap& rank_map() const override { return groups_.map; }
  std::string data_description() const override;
  int64_t epoch() const override { return packer_->epoch(); }
  Result<std::vector<EvalRecord>> evaluate() override;
  StepPlans last_plans(size_t backend) const override;

  // The emulated link of options().attention_link (nullptr without one): its counters, and new
  // latency and bandwidth between steps.
  comm::EmulatedLink* attention_link() { return link_.get(); }
  const RankCoords& coords() const { return groups_.me; }
  // Saves every backend's state to options().checkpoint_path (rank 0 writes).
  Status save() const;
  // The state of backend i (tests).
  model::ModelState<float>& state(size_t i);
  // The last step's layout, and backend i's plan of it (calibration prices exactly these).
  const plan::Batch& last_batch() const { return last_batch_; }
  // With ping-pong the step ran two plans, of the nano-batches: this is the unsplit backend's, so
  // it is meaningful with ping-pong off only.
  const plan::Plan& last_plan(size_t i) const;
  // The per-rank memory budget in bytes (0: none; TrainOptions::kAutoBudget: each step's own,
  // StepRecord::memory_budget_bytes), and the least any step can do with: a document per rank,
  // colocated, stateless (a budget below it is refused).
  int64_t memory_budget() const { return budget_; }
  int64_t memory_floor() const { return floor_; }

 private:
  struct Run;
  struct Pass;
  DataParallelTrainer(comm::Communicator& comm, TrainOptions options);
  Result<StepRecord> step_one(Run& run, const StepData& data);
  // The step's plan, and the first configuration within the budget (see above): then one of
  // the two below.
  Result<Pass> run_pass(Run& run, const StepData& data);
  // The forward and backward of one step on this rank, whole or as two ping-pong nano-batches.
  Result<Pass> whole_pass(Run& run, const StepData& data, plan::Plan plan, plan::BackwardMode mode);
  Result<Pass> pingpong_pass(Run& run, const StepData& data, layout::NanoSplit split, plan::BackwardMode mode);
  // Each rank's bytes (model states, activations, attention buffers) for a step of `run` whole
  // under `plan`, or split.
  Result<int64_t> whole_bytes(const Run& run, const plan::Batch& batch, const plan::Plan& plan, plan::BackwardMode mode) const;
  Result<int64_t> pingpong_bytes(const Run& run, const layout::NanoSplit& split, plan::BackwardMode mode) const;
  int64_t fixed_bytes(const Run& run) const;  // its model states and the activation workspace

  comm::Communicator& comm_;
  TrainOptions options_;
  RankGroups groups_;  // tp and dp (no pipeline: pp groups of one)
  std::unique_ptr<comm::EmulatedLink> link_;  // over groups_.dp, for the attention (benchmarks)
  comm::Communicator& attention_comm() { return link_ ? static_cast<comm::Communicator&>(*link_) : *groups_.dp; }
  std::unique_ptr<Packer> packer_;
  std::unique_ptr<model::Model<float>> model_;  // one workspace, shared by the backends' states
  std::unique_ptr<GradientSync> grad_sync_;  // grad_sync "overlap" over more than one replica
  std::vector<std::unique_ptr<Run>> runs_;
  int64_t step_ = 0;
  plan::Batch last_batch_;
  std::vector<StepData> validation_;
  ContextRows context_;  // ping-pong: the rows nano-batch B reads of A's (positional split)
  model::ModelConfig shard_;  // this rank's slice of the model (tensor parallelism)
  int64_t budget_ = 0, floor_ = 0;
  std::array<std::array<std::vector<int32_t>, 3>, 2> nano_ids_;  // ping-pong: tokens, targets, positions per nano-batch
};

}  // namespace distca::train
