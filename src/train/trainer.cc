#include "distca/train/trainer.h"

#include "distca/train/data_parallel.h"
#include "distca/train/pipeline.h"

namespace distca::train {

Result<std::unique_ptr<Trainer>> make_trainer(comm::Communicator& comm, TrainOptions options) {
  if (options.pp > 1) {
    DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<PipelineTrainer> t, PipelineTrainer::create(comm, std::move(options)));
    return std::unique_ptr<Trainer>(std::move(t));
  }
  DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<DataParallelTrainer> t, DataParallelTrainer::create(comm, std::move(options)));
  return std::unique_ptr<Trainer>(std::move(t));
}

}  // namespace distca::train
