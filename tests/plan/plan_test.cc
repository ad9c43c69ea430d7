#include "distca/plan/plan.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace distca::plan {
namespace {

using testing::tiny_cost;

const PhaseTraffic& phase(const Traffic& t, Phase p) { return t.phases[static_cast<int>(p)]; }

// rank 0 holds doc 0 (256 tokens); rank 1 holds doc 1 (100 tokens). q = kv = 16, out = 24.
TEST(CountTraffic, MovedShardSendsQueriesAndItsKeyPrefixOnce) {
  Batch b = batch_from_ranks({{256}, {100}}, 256).value();
  const CostModel cost = tiny_cost();
  std::vector<Task> tasks = {causal_task(0, 0, 128, 0), causal_task(0, 128, 192, 1),
                             causal_task(0, 192, 256, 1), causal_task(1, 0, 100, 1)};
  Traffic t = count_traffic(b, cost.token_bytes(), tasks);
  // Q: 128 rows 0 -> 1; KV: the union [0, 256) once, not [0,192) + [0,256).
  EXPECT_EQ(t.forward.q_bytes, 128 * 16);
  EXPECT_EQ(t.forward.kv_bytes, 256 * 16);
  EXPECT_EQ(t.forward.out_bytes, 128 * 24);
  EXPECT_EQ(t.forward.total_bytes, 128 * 16 + 256 * 16 + 128 * 24);
  const auto& d = phase(t, Phase::kFwdDispatch);
  ASSERT_EQ(d.flows.size(), 1u);
  EXPECT_EQ(d.flows[0].src, 0);
  EXPECT_EQ(d.flows[0].dst, 1);
  EXPECT_EQ(d.send_bytes[0], 128 * 16 + 256 * 16);
  const auto& r = phase(t, Phase::kFwdReturn);
  ASSERT_EQ(r.flows.size(), 1u);
  EXPECT_EQ(r.flows[0].src, 1);
  EXPECT_EQ(t.forward.max_send_bytes, 128 * 16 + 256 * 16);
  EXPECT_EQ(t.forward.max_recv_bytes, 128 * 16 + 256 * 16);
  // Backward returns dQ for the moved rows and fp32 dK/dV for the keys.
  const auto& bwd = phase(t, Phase::kBwdReturn);
  EXPECT_EQ(bwd.total_bytes, 128 * cost.token_bytes().bwd_dq + 256 * cost.token_bytes().bwd_dkv);
}

TEST(CountTraffic, ColocatedSingleRankDocumentsMoveNothing) {
  Batch b = batch_from_ranks({{10, 20}, {30}}, 0).value();
  std::vector<Task> tasks;
  for (const Piece& p : b.pieces) tasks.push_back(causal_task(p.doc, p.begin, p.end, p.rank));
  Traffic t = count_traffic(b, tiny_cost().token_bytes(), tasks);
  for (const auto& ph : t.phases) EXPECT_EQ(ph.total_bytes, 0);
}

TEST(CountTraffic, KeysOwnedByTheServerAreNotSent) {
  // doc 0 spans rank 0 [0,8) and rank 1 [8,16); rank 1 attends its piece: keys [0,8) move.
  Batch b = pack_documents({16}, 2, 8).value();
  Traffic t = count_traffic(b, tiny_cost().token_bytes(), {causal_task(0, 0, 8, 0), causal_task(0, 8, 16, 1)});
  EXPECT_EQ(t.forward.kv_bytes, 8 * 16);
  EXPECT_EQ(t.forward.q_bytes, 0);
}

TEST(FinalizePlan, LoadsPairsAndHashAreCanonical) {
  Batch b = batch_from_ranks({{64}, {32}}, 0).value();
  const CostModel cost = tiny_cost();
  std::vector<Task> tasks = {causal_task(1, 0, 32, 1), causal_task(0, 32, 64, 1), causal_task(0, 0, 32, 0)};
  Plan p = finalize_plan("test", 0.1, b, cost, tasks);
  std::reverse(tasks.begin(), tasks.end());
  Plan q = finalize_plan("test", 0.1, b, cost, tasks);
  EXPECT_EQ(p.hash, q.hash);
  EXPECT_EQ(p.tasks, q.tasks);
  EXPECT_EQ(p.server_pairs[0], causal_pairs(0, 32));
  EXPECT_EQ(p.server_pairs[1], causal_pairs(32, 64) + causal_pairs(0, 32));
  EXPECT_DOUBLE_EQ(p.load.pairs_imbalance,
                   p.server_pairs[1] / ((p.server_pairs[0] + p.server_pairs[1]) / 2.0));
  tasks[0].server = 1 - tasks[0].server;
  EXPECT_NE(finalize_plan("test", 0.1, b, cost, tasks).hash, p.hash);
}

TEST(TaskPairs, CausalWithKeyOffsetAndNonCausal) {
  EXPECT_EQ(causal_task(0, 4, 8, 0).pairs(), causal_pairs(4, 8));
  Task shifted{0, 4, 8, 2, 8, 0};  // rows 4..7 see keys [2, q]
  EXPECT_EQ(shifted.pairs(), 3 + 4 + 5 + 6);
  Task prefix{0, 4, 8, 0, 2, 0};  // non-causal keys [0, 2)
  EXPECT_EQ(prefix.pairs(), 4 * 2);
}

}  // namespace
}  // namespace distca::plan
