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
  const std::vector<Flow> d_flows = count_flows(b, cost.token_bytes(), tasks, Phase::kFwdDispatch);
  ASSERT_EQ(d_flows.size(), 1u);
  EXPECT_EQ(d_flows[0].src, 0);
  EXPECT_EQ(d_flows[0].dst, 1);
  EXPECT_EQ(d_flows[0].bytes, 128 * 16 + 256 * 16);
  EXPECT_EQ(d.send_bytes[0], 128 * 16 + 256 * 16);
  const std::vector<Flow> r_flows = count_flows(b, cost.token_bytes(), tasks, Phase::kFwdReturn);
  ASSERT_EQ(r_flows.size(), 1u);
  EXPECT_EQ(r_flows[0].src, 1);
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

// One document over two ranks of 32 rows. Rows [32, 64) (rank 1's) see keys [0, 16) on server 1,
// [16, 32) on server 0 (non-causal pieces) and [32, q] on server 1 (causal). tiny_cost: q = kv =
// 16, out = 24, bwd_q = 56, bwd_do = 16, bwd_dq = 16, bwd_dkv = 32 bytes per row.
TEST(CountTraffic, KeySplitSendsQueriesPerTaskAndStatefulSendsTheMergedOutputs) {
  Batch b = pack_documents({64}, 2, 32).value();
  const TokenBytes tb = tiny_cost().token_bytes();
  ASSERT_EQ(tb.bwd_q, 56);
  ASSERT_EQ(tb.bwd_dkv, 32);
  const std::vector<Task> tasks = {causal_task(0, 0, 32, 0), {0, 32, 64, 0, 16, 1}, {0, 32, 64, 16, 32, 0},
                                   {0, 32, 64, 32, 64, 1}};
  for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
    SCOPED_TRACE(backward_mode_name(mode));
    const Traffic t = count_traffic(b, tb, tasks, mode);
    // Forward: rank 1's 32 query rows to server 0 for keys [16, 32); rank 0's keys [0, 16) to
    // server 1 (its keys [32, 64) are its own); O/LSE of those 32 rows back.
    EXPECT_EQ(t.forward.q_bytes, 32 * 16);
    EXPECT_EQ(t.forward.kv_bytes, 16 * 16);
    EXPECT_EQ(t.forward.out_bytes, 32 * 24);
    const auto& d = phase(t, Phase::kFwdDispatch);
    EXPECT_EQ(d.send_bytes, (std::vector<int64_t>{16 * 16, 32 * 16}));
    const auto& r = phase(t, Phase::kFwdReturn);
    EXPECT_EQ(r.send_bytes, (std::vector<int64_t>{32 * 24, 0}));
    // Backward dispatch: stateless re-sends Q, O, dO, LSE and the keys; stateful sends dO and,
    // the rows being split, their merged O and LSE, and no keys.
    const auto& bd = phase(t, Phase::kBwdDispatch);
    if (mode == BackwardMode::kStateless) {
      EXPECT_EQ(bd.send_bytes, (std::vector<int64_t>{16 * 16, 32 * 56}));
    } else {
      EXPECT_EQ(bd.send_bytes, (std::vector<int64_t>{0, 32 * (16 + 24)}));
    }
    // Backward return: server 0's dQ partials of rank 1's rows, server 1's fp32 dK/dV of [0, 16).
    const auto& br = phase(t, Phase::kBwdReturn);
    EXPECT_EQ(br.send_bytes, (std::vector<int64_t>{32 * 16, 16 * 32}));
    EXPECT_EQ(br.recv_bytes, (std::vector<int64_t>{16 * 32, 32 * 16}));
  }
}

// A query row in two tasks on one server travels there twice (once per task's Q slot); the
// server's key ranges of the document are one union.
TEST(CountTraffic, KeySplitOnOneServerSendsTheRowOncePerTask) {
  Batch b = pack_documents({64}, 2, 32).value();
  const TokenBytes tb = tiny_cost().token_bytes();
  const std::vector<Task> tasks = {causal_task(0, 0, 32, 0), {0, 32, 64, 0, 32, 0}, {0, 32, 64, 32, 64, 0}};
  const Traffic stateful = count_traffic(b, tb, tasks, BackwardMode::kStateful);
  EXPECT_EQ(stateful.forward.q_bytes, 2 * 32 * 16);
  EXPECT_EQ(stateful.forward.kv_bytes, 32 * 16);  // keys [32, 64) from rank 1, [0, 32) are server 0's
  EXPECT_EQ(stateful.forward.out_bytes, 2 * 32 * 24);
  EXPECT_EQ(phase(stateful, Phase::kBwdDispatch).total_bytes, 2 * 32 * (16 + 24));
  EXPECT_EQ(phase(stateful, Phase::kBwdReturn).total_bytes, 2 * 32 * 16 + 32 * 32);
  EXPECT_EQ(phase(count_traffic(b, tb, tasks, BackwardMode::kStateless), Phase::kBwdDispatch).total_bytes,
            2 * 32 * 56 + 32 * 16);
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
