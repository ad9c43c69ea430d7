#include "distca/plan/cost.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace distca::plan {
namespace {

TEST(CausalPairs, MatchesLoopCount) {
  for (int64_t q0 = 0; q0 < 20; ++q0) {
    for (int64_t q1 = q0; q1 < 40; ++q1) {
      int64_t n = 0;
      for (int64_t q = q0; q < q1; ++q) n += q + 1;
      EXPECT_EQ(causal_pairs(q0, q1), n) << q0 << " " << q1;
    }
  }
  EXPECT_EQ(causal_pairs(0, 1 << 20), (int64_t{1} << 20) * ((int64_t{1} << 20) + 1) / 2);
}

TEST(CausalPairs, HeadTailPairIsLinearInTokens) {
  // [a, a+m) and [L-a-m, L-a) hold m * (L + 1) pairs wherever a is.
  const int64_t len = 1000;
  for (int64_t a : {0, 17, 300}) {
    for (int64_t m : {1, 64, 128}) {
      EXPECT_EQ(causal_pairs(a, a + m) + causal_pairs(len - a - m, len - a), m * (len + 1));
    }
  }
}

TEST(ModelShape, PresetsAndValidation) {
  ModelShape m = model_preset("llama-8b").value();
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.num_q_heads, 32);
  EXPECT_EQ(m.num_kv_heads, 8);
  EXPECT_EQ(model_preset("llama-34b").value().hidden, 8192);
  EXPECT_EQ(model_preset("gpt-5").status().code(), StatusCode::kNotFound);
  m.tp = 16;  // 8 kv heads replicated over 16 ranks
  EXPECT_TRUE(m.validate().is_ok());
  EXPECT_EQ(m.kv_heads_per_rank(), 1);
  m.tp = 3;
  EXPECT_FALSE(m.validate().is_ok());
  m.tp = 1;
  m.num_kv_heads = 5;
  EXPECT_FALSE(m.validate().is_ok());
  m.num_kv_heads = 0;
  EXPECT_FALSE(m.validate().is_ok());
}

TEST(CostModel, TokenBytesFollowTheShape) {
  ModelShape m = model_preset("llama-8b").value();  // Hq 32, Hkv 8, D 128, bf16
  CostModel cost(m, ThroughputProfile{});
  EXPECT_EQ(cost.token_bytes().q, 32 * 128 * 2);
  EXPECT_EQ(cost.token_bytes().kv, 2 * 8 * 128 * 2);
  EXPECT_EQ(cost.token_bytes().out, 32 * 128 * 2 + 32 * 4);
  EXPECT_EQ(cost.token_bytes().bwd_dkv, 2 * 8 * 128 * 4);
  m.tp = 4;
  CostModel tp4(m, ThroughputProfile{});
  EXPECT_EQ(tp4.token_bytes().q, cost.token_bytes().q / 4);
  EXPECT_DOUBLE_EQ(tp4.fwd_flops_per_pair(), cost.fwd_flops_per_pair() / 4);
}

// A bf16 return prices dK/dV at 2 bytes an element (for a bf16 model, as K/V themselves) and
// leaves every other tensor as it was.
TEST(CostModel, Bf16GradReturnHalvesOnlyTheDkDvBytes) {
  ModelShape m = model_preset("llama-8b").value();
  const TokenBytes fp32 = CostModel(m, ThroughputProfile{}).token_bytes();
  m.grad_return = GradReturn::kBf16;
  const TokenBytes bf16 = CostModel(m, ThroughputProfile{}).token_bytes();
  EXPECT_EQ(bf16.bwd_dkv, fp32.bwd_dkv / 2);
  EXPECT_EQ(bf16.bwd_dkv, bf16.kv);
  TokenBytes rest = bf16;
  rest.bwd_dkv = fp32.bwd_dkv;
  EXPECT_EQ(rest, fp32);
  EXPECT_EQ(token_bytes(m), bf16);
  m.grad_return = static_cast<GradReturn>(3);
  EXPECT_NE(m.validate().message().find("neither fp32 nor bf16"), std::string::npos) << m.validate().message();
}

TEST(CostModel, SecondsScaleWithPairsAndPenaliseShortShards) {
  CostModel cost = testing::tiny_cost(/*overhead=*/1e-6, /*tile=*/128);
  // 1 layer x (fwd 4*D*Hq = 32 + bwd 80) FLOPs per pair at 1 GFLOP/s.
  EXPECT_DOUBLE_EQ(cost.pair_seconds(1000), 1000 * 112 / 1e9);
  EXPECT_DOUBLE_EQ(cost.task_seconds(128, 1000, 1000), cost.pair_seconds(1000) + 1e-6);
  EXPECT_DOUBLE_EQ(cost.task_seconds(64, 1000, 1000), 2 * cost.pair_seconds(1000) + 1e-6);
  ThroughputProfile bad;
  bad.flops_per_second = 0;
  EXPECT_FALSE(bad.validate().is_ok());
}

// A rate by key range: interpolated in log(keys) between points, clamped at both ends, applied to
// the task's own key range; the slowest rate bounds any pair's cost; bad curves are refused.
TEST(Cost, RateByKeysPricesShortKeyRangesSlower) {
  ThroughputProfile p;
  p.flops_per_second = 400e12;
  p.task_overhead_seconds = 0;
  p.rate_by_keys = {{1024, 100e12}, {4096, 400e12}};
  ASSERT_TRUE(p.validate().is_ok());
  EXPECT_DOUBLE_EQ(p.rate(512), 100e12);
  EXPECT_DOUBLE_EQ(p.rate(1024), 100e12);
  EXPECT_DOUBLE_EQ(p.rate(2048), 250e12);  // halfway in log(keys)
  EXPECT_DOUBLE_EQ(p.rate(1 << 20), 400e12);
  EXPECT_DOUBLE_EQ(p.slowest_rate(), 100e12);
  const CostModel cost(model_preset("llama-8b").value(), p);
  EXPECT_DOUBLE_EQ(cost.task_seconds(128, 1000, 1 << 20), cost.pair_seconds(1000));
  EXPECT_DOUBLE_EQ(cost.task_seconds(128, 1000, 1024), 4 * cost.pair_seconds(1000));
  EXPECT_DOUBLE_EQ(cost.slowest_pair_seconds(), 4 * cost.pair_seconds(1));
  for (const std::vector<RatePoint>& bad : std::vector<std::vector<RatePoint>>{
           {{0, 1e12}}, {{4096, 1e12}, {1024, 1e12}}, {{1024, 0}}, {{1024, 500e12}}}) {
    ThroughputProfile q = p;
    q.rate_by_keys = bad;
    const Status st = q.validate();
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("rate_by_keys"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace distca::plan
