// Event timing of each schedule (sim/timing.h) on hand-computed cases.
#include <gtest/gtest.h>

#include <vector>

#include "distca/sim/timing.h"

namespace distca::sim {
namespace {

TEST(Timing, OneFOneBOnTwoStagesHasTheTextbookBubble) {
  // 2 stages, 4 micro-batches, forward 1, backward 2: (M + S - 1)(f + b) = 15; each stage
  // computes 12, so the bubble is (S - 1)(f + b) = 3 per stage.
  const std::vector<std::vector<double>> f(2, std::vector<double>(4, 1.0)), b(2, std::vector<double>(4, 2.0));
  const PipelineTiming t = one_f_one_b(f, b, 0);
  EXPECT_DOUBLE_EQ(t.seconds, 15.0);
  ASSERT_EQ(t.busy.size(), 2u);
  EXPECT_DOUBLE_EQ(t.busy[0], 12.0);
  EXPECT_DOUBLE_EQ(t.seconds - t.busy[1], 3.0);
  // A p2p delay of 0.5 per hop: the first forward reaches stage 1 at 1.5 and every
  // dependency crossing adds 0.5.
  EXPECT_GT(one_f_one_b(f, b, 0.5).seconds, 15.0);
  // One straggling micro-batch (backward 6 instead of 2 on stage 1) delays the whole pipeline.
  auto slow = b;
  slow[1][1] = 6.0;
  EXPECT_DOUBLE_EQ(one_f_one_b(f, slow, 0).seconds, 19.0);
  // One stage: no bubble.
  const std::vector<std::vector<double>> f1(1, std::vector<double>(3, 1.0)), b1(1, std::vector<double>(3, 2.0));
  EXPECT_DOUBLE_EQ(one_f_one_b(f1, b1, 0).seconds, 9.0);
}

TEST(Timing, PingPongHidesCommunicationUpToTheLongerOfTheTwo) {
  // Compute-bound: linear 2, attention 2, dispatch and return 1 each. Every transfer but the
  // last return runs while the other nano-batch computes: compute back to back, 8, then the
  // last return, 1: 9.
  std::vector<std::array<LayerOps, 2>> compute_bound(1, {LayerOps{2, 1, 2, 1}, LayerOps{2, 1, 2, 1}});
  EXPECT_DOUBLE_EQ(pingpong_seconds(compute_bound), 9.0);
  EXPECT_DOUBLE_EQ(sequential_seconds(compute_bound), 12.0);
  // Communication exceeds compute: linear 1, attention 1, dispatch 3, return 3. Hand schedule:
  // linear A [0,1], linear B [1,2]; dispatch A [1,4], dispatch B [4,7]; attention A [4,5],
  // attention B [7,8]; return A [7,10], return B [10,13]: 13, the link's 12 plus the first linear.
  std::vector<std::array<LayerOps, 2>> comm_bound(1, {LayerOps{1, 3, 1, 3}, LayerOps{1, 3, 1, 3}});
  EXPECT_DOUBLE_EQ(pingpong_seconds(comm_bound), 13.0);
  EXPECT_DOUBLE_EQ(sequential_seconds(comm_bound), 16.0);
  // Two such layers: the link never rests, 24, plus the first linear.
  comm_bound.push_back(comm_bound[0]);
  EXPECT_DOUBLE_EQ(pingpong_seconds(comm_bound), 25.0);
}

TEST(Timing, CollectivesFollowTheRingAlphaBetaModel) {
  const Link link{1e-5, 1e9};
  // All-gather of 8 MB over 8 ranks: 7 steps of latency and 7/8 of the buffer on the wire.
  EXPECT_NEAR(collective_seconds(Collective::kAllGather, 8e6, 8, link), 7e-5 + 7e-3, 1e-12);
  EXPECT_NEAR(collective_seconds(Collective::kReduceScatter, 8e6, 8, link), 7e-5 + 7e-3, 1e-12);
  EXPECT_NEAR(collective_seconds(Collective::kAllReduce, 8e6, 8, link), 14e-5 + 14e-3, 1e-12);
  EXPECT_NEAR(collective_seconds(Collective::kAllToAll, 4e6, 4, link), 3e-5 + 3e-3, 1e-12);
  EXPECT_EQ(collective_seconds(Collective::kAllReduce, 8e6, 1, link), 0.0);
}

}  // namespace
}  // namespace distca::sim
