// A plan's per-server memory (plan::Plan::server_bytes, what the planners' memory cap counts) is
// what the runtime's server buffers hold for one layer's forward (runtime::buffer_bytes), at the
// runtime's 4-byte elements, for every policy and under a memory cap.
#include <gtest/gtest.h>

#include "distca/layout/route.h"
#include "distca/plan/planner.h"
#include "distca/plan/workload.h"
#include "distca/runtime/dispatcher.h"

namespace distca::runtime {
namespace {

TEST(BufferBytes, APlansServerBytesAreTheRuntimesForwardSet) {
  // 2 layers, hidden 64, 4 query and 2 key/value heads of 8, FFN 128, at the runtime's 4-byte element.
  const plan::ModelShape m{"small", 2, 64, 4, 2, 8, 128, 4, 1};
  const plan::CostModel cost(m, plan::ThroughputProfile{});
  const layout::HeadShape heads{m.num_q_heads, m.num_kv_heads, m.head_dim};
  int checked = 0;
  for (const char* workload : {"pretrain", "prolong"}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      plan::SamplingOptions so;
      so.seed = seed;
      const plan::Batch batch = plan::sample_batch(plan::builtin_distribution(workload).value(), so, 4, 8192).value();
      for (const std::string& name : plan::planner_names()) {
        for (const int64_t cap : {plan::PlannerOptions::kAutoServerBytes, int64_t{0}}) {
          plan::PlannerOptions o;
          o.granularity = 64;
          o.max_server_bytes = name == "none" || name == "distca" ? 0 : cap;
          const plan::Plan p = plan::find_planner(name).value()(batch, cost, o).value();
          for (int32_t r = 0; r < batch.num_ranks; ++r) {
            const layout::Route route = layout::build_route(batch, p.tasks, r).value();
            EXPECT_EQ(buffer_bytes(route, heads, plan::GradReturn::kFp32).forward_set, p.server_bytes[r])
                << workload << " seed " << seed << " " << name << " rank " << r;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 3 * 5 * 2 * 4);
}

}  // namespace
}  // namespace distca::runtime
