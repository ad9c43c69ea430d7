// The BLAS baseline of the benchmark computes the same attention as the reference.
#include "distca/kernels/gemm_attention.h"

#include <gtest/gtest.h>

#include <random>

#include "distca/kernels/ref.h"
#include "test_util.h"

namespace distca::kernels {
namespace {

TEST(GemmAttention, MatchesTheReferenceOnShardedDocuments) {
  std::mt19937_64 rng(17);
  testing::TaskSet set = testing::shard_documents(rng, {1, 300, 129, 64}, 150, 4, 2, 64, 1);
  set.tasks.push_back({set.dims.num_q_rows, 20, 10, 100, false});
  set.dims.num_q_rows += 20;
  const AttnDims& n = set.dims;
  const auto q = testing::random_values<float>(rng, n.num_q_rows * n.num_q_heads * n.head_dim);
  const auto k = testing::random_values<float>(rng, n.num_kv_rows * n.num_kv_heads * n.head_dim);
  const auto v = testing::random_values<float>(rng, k.size());
  auto forward = [&](auto&& fn) {
    std::vector<float> o(q.size(), std::nanf("")), lse(n.num_q_rows * n.num_q_heads, std::nanf(""));
    EXPECT_TRUE(fn(AttnFwdParams<float>{n, q.data(), k.data(), v.data(), set.tasks, {}, o.data(), lse.data()}).is_ok());
    return std::pair{o, lse};
  };
  for (int threads : {1, 2}) {
    GemmAttention gemm(threads);
    const auto [o, lse] = forward([&](const AttnFwdParams<float>& p) { return gemm.forward(p); });
    const auto [o_ref, lse_ref] = forward([](const AttnFwdParams<float>& p) { return ref::attention_forward(p); });
    testing::expect_close("O", o, o_ref, n.num_q_heads, n.head_dim, 2e-5);
    testing::expect_close("LSE", lse, lse_ref, n.num_q_heads, 1, 2e-5);
  }
}

TEST(GemmAttention, ReportsTheBlasKernelFamily) { EXPECT_FALSE(blas_core_name().empty()); }

}  // namespace
}  // namespace distca::kernels
