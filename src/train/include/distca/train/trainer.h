// A trainer: a Llama-style model (model/) trained over a Communicator's ranks with attention
// through one or two backends ("colocated", "cad"); with two (--compare) both train from the
// same weights on the same data, step by step interleaved, so their times are measured in the
// same run. Two implementations behind this interface, chosen by options.pp:
//   pp == 1  DataParallelTrainer (data_parallel.h): data-parallel replicas, optionally tensor
//            parallel, ping-pong inside the step, checkpoints and validation
//   pp > 1   PipelineTrainer (pipeline.h): the layers over pp stages, micro-batches walked by a
//            tick table (colocated 1F1B, cad lockstep with pooled plans)
// Both fill the same StepRecord (step_record.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distca/comm/communicator.h"
#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/plan.h"
#include "distca/train/options.h"
#include "distca/train/step_record.h"
#include "distca/train/tensor_parallel.h"

namespace distca::train {

// One attention plan a step ran, over the layout it was made for.
struct TickPlan {
  bool is_backward = false;
  int nano = -1;  // ping-pong: the nano-batch (0, 1) the plan is of; -1: whole micro-batches
  std::vector<int> micro_batch;  // per stage, the micro-batch whose attention the plan holds (-1: idle)
  plan::Batch pool;              // the layout planned (pipeline cad: the tick's micro-batches pooled)
  std::vector<plan::Task> tasks;
};
// What a backend's last step planned: what the simulator prices.
struct StepPlans {
  std::vector<plan::Batch> micro_batches;  // the step's micro-batches (data parallel: the step's one)
  // Data parallel: one, the step's plan over its batch (ping-pong off: with ping-pong the step
  // ran the two nano-batches' plans, which this is not). Pipeline cad: every tick's pooled plan.
  // Pipeline colocated: none (each stage plans its micro-batches alone).
  std::vector<TickPlan> plans;
};

class Trainer {
 public:
  virtual ~Trainer() = default;
  // One step of every backend, in options().backends order (collective).
  virtual Result<std::vector<StepRecord>> step() = 0;
  // Steps done (a resumed run starts at its checkpoint's step).
  virtual int64_t steps_done() const = 0;
  // As resolved: granularity and micro_batches 0 replaced by the values in use.
  virtual const TrainOptions& options() const = 0;
  virtual const RankMap& rank_map() const = 0;
  virtual std::string data_description() const = 0;
  // The data source's epoch as of the last step (0 until a file source wraps).
  virtual int64_t epoch() const = 0;
  // The loss of every backend on the held-out steps (collective). REQUIRES: options().eval_every
  // > 0 (validate() refuses it with pp > 1).
  virtual Result<std::vector<EvalRecord>> evaluate() = 0;
  virtual StepPlans last_plans(size_t backend) const = 0;
};

// Collective (every rank creates its trainer with the same options): the data-parallel trainer
// for options.pp == 1, the pipeline trainer for pp > 1.
Result<std::unique_ptr<Trainer>> make_trainer(comm::Communicator& comm, TrainOptions options);

}  // namespace distca::train
