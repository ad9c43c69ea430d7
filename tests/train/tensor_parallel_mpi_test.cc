// Tensor parallelism under mpirun: on 2 ranks tp 2; on 4 ranks (tp, pp, dp) = (2, 1, 2), (4, 1, 1)
// and (2, 2, 1); on 8 ranks (2, 2, 2), (2, 1, 4), (8, 1, 1) and (4, 2, 1). Colocated and CAD
// (the data-parallel trainer for pp 1, with ping-pong on and off; the pipeline trainer otherwise)
// reproduce the loss curve
// of the same model on one rank, within 1e-5 relative over 6 steps, 10 with DISTCA_TEST_LONG=1. With --fault (3 ranks, one TP
// group of 3), TP rank 1 fails in step 2 and the whole job must end.
#include <fmt/format.h>

#include <array>
#include <map>

#include "../comm/mpi_test_main.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/train/data_parallel.h"
#include "pipeline_util.h"
#include "soak.h"

int main(int argc, char** argv) {
  using namespace distca;
  using namespace distca::train;
  const comm::testing::MpiTest t = comm::testing::start_mpi_test(&argc, &argv);
  if (!t.comm) return 1;
  comm::MpiComm& c = *t.comm;
  auto fail = [&t](const Status& st) { return t.fail(st); };
  kernels::blas_set_num_threads(1);
  const train::testing::ProcessDataFile data_file("distca_tp_mpi");
  const std::string& data = data_file.path();
  constexpr int64_t T = 64;
  // 6 steps (10 with DISTCA_TEST_LONG=1): each layout's curve must match from the first step.
  const int kSteps = distca::testing::soak<int>(6, 10);
  auto dp_options = [&](int tp, int64_t context, int64_t steps) {
    TrainOptions o;
    o.model = train::testing::tp_model(2);
    o.context = context;
    o.steps = steps;
    o.data_path = data;
    o.granularity = 16;
    o.tp = tp;
    o.policy = "minbytes";
    o.backends = {"colocated", "cad"};
    return o;
  };
  if (t.is_fault) {
    TrainOptions o = dp_options(c.size(), T, 5);  // every rank in one TP group
    o.model.num_q_heads = 6;
    o.model.num_kv_heads = 3;
    o.model.ffn_dim = 66;
    auto trainer = DataParallelTrainer::create(c, o);
    if (!trainer.is_ok()) return fail(trainer.status());
    for (int s = 0; s < 5; ++s) {
      if (s == 1 && c.rank() == 1) return fail(internal_error("TP rank 1 fails in step 2 on purpose"));
      auto r = trainer.value()->step();
      if (!r.is_ok()) return fail(r.status());
    }
    return 0;
  }
  std::vector<std::array<int, 2>> layouts;  // (tp, pp); dp = ranks / (tp pp)
  if (c.size() == 2) layouts = {{2, 1}};
  if (c.size() == 4) layouts = {{2, 1}, {4, 1}, {2, 2}};
  if (c.size() == 8) layouts = {{2, 2}, {2, 1}, {8, 1}, {4, 2}};
  if (layouts.empty()) return fail(invalid_argument("run with 2, 4 or 8 ranks"));
  int checks = 0;
  double worst = 0;
  for (const auto& [tp, pp] : layouts) {
    const int dp = c.size() / (tp * pp);
    std::vector<double> want;
    std::map<std::string, std::vector<double>> got;
    if (pp == 1) {
      const int64_t context = dp == 1 ? 2 * T : T;  // ping-pong needs two documents in a step
      TrainOptions one = dp_options(1, dp * context, kSteps);
      one.backends = {"colocated"};
      auto self = c.split(c.rank(), 0, "self");  // one rank alone (each rank computes the reference)
      if (!self.is_ok()) return fail(self.status());
      auto reference = DataParallelTrainer::create(*self.value(), one);
      if (!reference.is_ok()) return fail(reference.status());
      for (int s = 0; s < kSteps; ++s) {
        auto r = reference.value()->step();
        if (!r.is_ok()) return fail(r.status());
        want.push_back(r.value()[0].loss);
      }
      for (const char* pingpong : {"on", "off"}) {
        TrainOptions o = dp_options(tp, context, kSteps);
        o.pingpong = pingpong;
        auto trainer = DataParallelTrainer::create(c, o);
        if (!trainer.is_ok()) return fail(trainer.status());
        int split = 0;
        for (int s = 0; s < kSteps; ++s) {
          auto records = trainer.value()->step();
          if (!records.is_ok()) return fail(records.status());
          for (const StepRecord& x : records.value()) {
            got[fmt::format("{}, ping-pong {}", x.backend, pingpong)].push_back(x.loss);
            split += x.backend == "cad" && x.split_micro_batches;
          }
        }
        if ((std::string(pingpong) == "on") != (split >= kSteps / 2)) {
          return fail(internal_error(fmt::format("ping-pong {}: {} of {} steps ran as two nano-batches", pingpong, split, kSteps)));
        }
      }
    } else {
      auto options = [&](int tp_, int pp_, int64_t context, const std::string& schedule, const std::string& policy) {
        TrainOptions o = train::testing::pipeline_options(data, pp_, 2 * pp, schedule, policy, context, kSteps, 2 * pp);
        o.model = train::testing::tp_model(2 * pp);
        o.tp = tp_;
        return o;
      };
      auto one = train::testing::one_rank_curve(options(1, 1, dp * T, "colocated", "none"));
      if (!one.is_ok()) return fail(one.status());
      want = one.value().losses;
      for (const auto& [schedule, policy] : std::vector<std::pair<std::string, std::string>>{{"colocated", "none"}, {"cad", "minbytes"}}) {
        for (const char* pingpong : {"on", "off"}) {
          TrainOptions o = options(tp, pp, T, schedule, policy);
          o.pingpong = pingpong;
          auto trainer = PipelineTrainer::create(c, o);
          if (!trainer.is_ok()) return fail(trainer.status());
          int split = 0;
          for (int s = 0; s < kSteps; ++s) {
            auto r = trainer.value()->step();
            if (!r.is_ok()) return fail(r.status());
            got[fmt::format("{}, ping-pong {}", schedule, pingpong)].push_back(r.value().at(0).loss);
            split += r.value().at(0).split_micro_batches;
          }
          // On: most of the micro-batches hold several documents and split.
          if ((std::string(pingpong) == "on") != (split >= kSteps * o.micro_batches / 2)) {
            return fail(internal_error(fmt::format("{}, ping-pong {}: {} of {} micro-batches ran as two nano-batches", schedule,
                                                   pingpong, split, kSteps * o.micro_batches)));
          }
        }
      }
    }
    for (const auto& [backend, losses] : got) {
      const double d = train::testing::worst_relative(losses, want);
      if (d > 1e-5) {
        return fail(internal_error(fmt::format("tp {}, pp {}, dp {}, {}: the loss differs from one rank's by {:.2e}", tp, pp,
                                               dp, backend, d)));
      }
      if (c.rank() == 0) fmt::print("tp {}, pp {}, dp {}, {}: largest relative loss difference {:.2e}\n", tp, pp, dp, backend, d);
      worst = std::max(worst, d);
      ++checks;
    }
  }
  if (c.rank() == 0) fmt::print("tensor-parallel checks passed on {} ranks ({} runs, worst {:.2e})\n", c.size(), checks, worst);
  return 0;
}
