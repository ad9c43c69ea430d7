// The training loop under mpirun: for every planner policy, CAD and colocated attention train
// the tiny model to the same loss curve (relative difference <= 1e-5 over 20 steps), and the
// loss falls; minbytes also on a skewed batch where its plans split key ranges (checked). With
// --fault, rank 1 fails at step 3 and the whole job must end.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "../comm/mpi_test_main.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/train/data_parallel.h"

int main(int argc, char** argv) {
  using namespace distca;
  const comm::testing::MpiTest t = comm::testing::start_mpi_test(&argc, &argv);
  if (!t.comm) return 1;
  comm::MpiComm& c = *t.comm;
  auto fail = [&t](const Status& st) { return t.fail(st); };
  kernels::blas_set_num_threads(1);
  auto preset = model::find_preset("tiny");
  if (!preset.is_ok()) return fail(preset.status());
  train::TrainOptions o;
  o.model = preset.value().model;
  o.context = preset.value().context;
  o.workload = preset.value().workload;
  o.steps = 20;
  o.backends = {"colocated", "cad"};
  const bool is_fault = t.is_fault;
  int checks = 0;
  for (const std::string policy : {"minmax", "minbytes", "distca", "none", "minbytes-skewed"}) {
    const bool is_skewed = policy == "minbytes-skewed";
    o.policy = is_skewed ? "minbytes" : policy;
    if (is_skewed) {  // one long document per step: minbytes cuts it into key-split blocks
      o.context = 1024;
      o.workload = "skewed";
      o.granularity = 32;
    }
    auto trainer = train::DataParallelTrainer::create(c, o);
    if (!trainer.is_ok()) return fail(trainer.status());
    double worst = 0, first = 0, last = 0;
    int64_t splits = 0;
    for (int step = 0; step < o.steps; ++step) {
      if (is_fault && step == 3 && c.rank() == 1) return fail(internal_error("rank 1 fails at step 3 on purpose"));
      auto records = trainer.value()->step();
      if (!records.is_ok()) return fail(records.status());
      const auto& r = records.value();
      worst = std::max(worst, std::abs(r[0].loss - r[1].loss) / std::abs(r[0].loss));
      splits += r[1].split_tasks;
      if (step < 5) first += r[1].loss / 5;
      if (step >= o.steps - 5) last += r[1].loss / 5;
    }
    if (worst > 1e-5) return fail(internal_error(fmt::format("policy {}: CAD and colocated losses differ by {:.2e}", policy, worst)));
    if (!is_skewed && !(first - last > 0.5)) {
      return fail(internal_error(fmt::format("policy {}: loss {} -> {} does not fall", policy, first, last)));
    }
    if (is_skewed && splits == 0) return fail(internal_error("minbytes made no key-split task on the skewed batch"));
    if (c.rank() == 0) {
      fmt::print("policy {}: max relative loss difference {:.2e}, loss {:.3f} -> {:.3f}, {} key-split tasks\n", policy,
                 worst, first, last, splits);
    }
    checks += 2;
  }
  if (c.rank() == 0) fmt::print("training checks passed on {} ranks ({} checks)\n", c.size(), checks);
  return 0;
}
