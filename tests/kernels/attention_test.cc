// The shared parts of the kernel interface: validation, causal-aware FLOP counts, LSE merge.
#include "distca/kernels/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "distca/kernels/ref.h"
#include "test_util.h"

namespace distca::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Status check(AttnDims dims, std::vector<AttnTask> tasks) { return validate(dims, tasks); }

TEST(Validate, AcceptsWellFormedTasksIncludingEmptyOnes) {
  EXPECT_TRUE(check({10, 10, 4, 2, 64}, {{0, 4, 0, 4, true}, {4, 6, 0, 10, true}, {9, 0, 3, 0, true}}).is_ok());
  EXPECT_TRUE(check({3, 0, 1, 1, 8}, {{0, 3, 0, 0, false}}).is_ok());
  EXPECT_TRUE(check({0, 0, 1, 1, 8}, {}).is_ok());
}

TEST(Validate, RejectsEachMalformedInputWithItsReason) {
  struct Case {
    AttnDims dims;
    std::vector<AttnTask> tasks;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {{4, 4, 3, 2, 8}, {}, "not a multiple"},
      {{4, 4, 0, 1, 8}, {}, "must be >= 1"},
      {{4, 4, 1, 1, 0}, {}, "must be >= 1"},
      {{-1, 4, 1, 1, 8}, {}, "must be >= 0"},
      {{4, 4, 1, 1, 8}, {{0, 5, 0, 4, false}}, "exceed Tq"},
      {{4, 4, 1, 1, 8}, {{0, 2, 3, 2, false}}, "exceed Tkv"},
      {{4, 4, 1, 1, 8}, {{0, 3, 0, 2, true}}, "q_len <= kv_len"},
      {{4, 4, 1, 1, 8}, {{-1, 1, 0, 2, true}}, ">= 0"},
      {{8, 8, 1, 1, 8}, {{0, 4, 0, 4, true}, {3, 1, 0, 4, true}}, "overlap"},
  };
  for (const Case& c : cases) {
    const Status st = check(c.dims, c.tasks);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << st.message();
  }
}

TEST(Validate, RejectsNullBuffersThatHoldElements) {
  AttnDims dims{2, 2, 1, 1, 8};
  std::vector<AttnTask> tasks = {{0, 2, 0, 2, true}};
  std::vector<float> buf(16);
  std::vector<float> lse(2);
  AttnFwdParams<float> p{dims, buf.data(), buf.data(), nullptr, tasks, {}, buf.data(), lse.data()};
  const Status st = validate(p);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("V is null"), std::string::npos);
}

TEST(Flops, CountsTheBottomRightTriangle) {
  EXPECT_EQ(task_pairs({0, 4, 0, 4, true}), 10);        // 1 + 2 + 3 + 4
  EXPECT_EQ(task_pairs({0, 2, 0, 5, true}), 4 + 5);     // rows see 4 and 5 keys
  EXPECT_EQ(task_pairs({0, 3, 0, 7, false}), 21);
  EXPECT_EQ(task_pairs({0, 0, 0, 7, true}), 0);
  // Shards of a document add up to the whole document.
  const int64_t L = 1000;
  int64_t sum = 0;
  for (int64_t a = 0; a < L; a += 128) sum += task_pairs({a, std::min<int64_t>(128, L - a), 0, std::min(L, a + 128), true});
  EXPECT_EQ(sum, L * (L + 1) / 2);
  AttnDims dims{L, L, 8, 2, 128};
  std::vector<AttnTask> whole = {{0, L, 0, L, true}};
  EXPECT_DOUBLE_EQ(forward_flops(dims, whole), 4.0 * 128 * 8 * L * (L + 1) / 2);
  EXPECT_DOUBLE_EQ(backward_flops(dims, whole), 2.5 * forward_flops(dims, whole));
}

// A query block split at key c: non-causal [0, c) and causal [c, L) pieces, merged, equal the
// unsplit attention.
TEST(LseMerge, KvSplitPiecesMergeToTheUnsplitResult) {
  std::mt19937_64 rng(2);
  const int64_t L = 40, H = 2, D = 16, q0 = 25;  // queries [25, 40) of a 40-token document
  const int64_t nq = L - q0;
  const auto q = testing::random_values<float>(rng, nq * H * D);
  const auto k = testing::random_values<float>(rng, L * H * D);
  const auto v = testing::random_values<float>(rng, L * H * D);
  auto forward = [&](AttnTask task, std::vector<float>& o, std::vector<float>& lse) {
    o.assign(nq * H * D, 0.0f);
    lse.assign(nq * H, 0.0f);
    ASSERT_TRUE(ref::attention_forward(AttnFwdParams<float>{{nq, L, H, H, D}, q.data(), k.data(), v.data(),
                                                            std::vector<AttnTask>{task}, {}, o.data(), lse.data()}).is_ok());
  };
  std::vector<float> o_full, lse_full, o_a, lse_a, o_b, lse_b;
  forward({0, nq, 0, L, true}, o_full, lse_full);
  for (int64_t c : {int64_t{1}, int64_t{10}, q0}) {
    forward({0, nq, 0, c, false}, o_a, lse_a);      // keys [0, c): before every query
    forward({0, nq, c, L - c, true}, o_b, lse_b);   // keys [c, L): bottom-right causal
    lse_merge<float>(nq, H, D, o_b.data(), lse_b.data(), o_a.data(), lse_a.data());
    testing::expect_close("O after merge", o_a, o_full, H, D, 2e-6);
    testing::expect_close("LSE after merge", lse_a, lse_full, H, 1, 2e-6);
  }
}

TEST(LseMerge, NegInfPartialsAreIdentities) {
  std::vector<float> o = {1, 2}, lse = {kNegInf};
  std::vector<float> part = {3, 4}, part_lse = {0.5f};
  lse_merge<float>(1, 1, 2, part.data(), part_lse.data(), o.data(), lse.data());
  EXPECT_EQ(o, part);
  EXPECT_EQ(lse[0], 0.5f);
  std::vector<float> empty = {9, 9}, empty_lse = {kNegInf};
  lse_merge<float>(1, 1, 2, empty.data(), empty_lse.data(), o.data(), lse.data());
  EXPECT_EQ(o, part);
  EXPECT_EQ(lse[0], 0.5f);
}

TEST(LseMerge, Bf16StorageMergesInFloat) {
  std::vector<bf16> o = {bf16(1.0f)}, part = {bf16(3.0f)};
  std::vector<float> lse = {0.0f}, part_lse = {0.0f};  // equal weights
  lse_merge<bf16>(1, 1, 1, part.data(), part_lse.data(), o.data(), lse.data());
  EXPECT_EQ(static_cast<float>(o[0]), 2.0f);
  EXPECT_FLOAT_EQ(lse[0], std::log(2.0f));
}

TEST(Bf16, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(static_cast<float>(bf16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 1.0f / 256)), 1.0f);             // tie: to even
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64); // tie: to even (up)
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 1.5f / 256)), 1.0f + 1.0f / 128);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(bf16(kNegInf)), kNegInf);
}

}  // namespace
}  // namespace distca::kernels
