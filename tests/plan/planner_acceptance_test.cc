// The acceptance workloads: R = 64 and 512, T = 131072, pretrain and prolong. minmax at
// eps = 0.02 reaches imbalance <= 1.03 and moves fewer KV bytes than distca at eps = 0.1.
#include <gtest/gtest.h>

#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"

namespace distca::plan {
namespace {

struct Workload {
  const char* name;
  int32_t ranks;
};

class Acceptance : public ::testing::TestWithParam<Workload> {};

TEST_P(Acceptance, MinmaxBalancesWithFewerKvBytesThanDistca) {
  const Workload w = GetParam();
  const Batch batch = sample_batch(builtin_distribution(w.name).value(), SamplingOptions{}, w.ranks, 131072).value();
  const CostModel cost(model_preset("llama-8b").value(), ThroughputProfile{});
  const Plan minmax = plan_minmax(batch, cost, PlannerOptions{0.02, 128, 0}).value();
  const Plan distca = plan_distca(batch, cost, PlannerOptions{0.1, 128, 0}).value();
  ASSERT_TRUE(verify_tasks(batch, minmax.tasks).is_ok());
  ASSERT_TRUE(verify_tasks(batch, distca.tasks).is_ok());
  EXPECT_LE(minmax.load.imbalance, 1.03);
  EXPECT_LT(minmax.traffic.forward.kv_bytes, distca.traffic.forward.kv_bytes);
  std::printf("%s R=%d: minmax imbalance %.4f kv %.1f GiB | distca(0.1) imbalance %.4f kv %.1f GiB\n", w.name,
              w.ranks, minmax.load.imbalance, minmax.traffic.forward.kv_bytes / 1073741824.0, distca.load.imbalance,
              distca.traffic.forward.kv_bytes / 1073741824.0);
}

INSTANTIATE_TEST_SUITE_P(Workloads, Acceptance,
                         ::testing::Values(Workload{"pretrain", 64}, Workload{"pretrain", 512},
                                           Workload{"prolong", 64}, Workload{"prolong", 512}),
                         [](const auto& info) {
                           return std::string(info.param.name) + "_R" + std::to_string(info.param.ranks);
                         });

}  // namespace
}  // namespace distca::plan
