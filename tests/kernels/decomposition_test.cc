// Task decompositions are exact: any partition of a document into shards (in order, scrambled,
// head/tail pairs) gives the same O and gradients as one task over the whole document, and a
// KV-range split merged by LSE equals the unsplit attention, forward and backward. Also the fast
// kernel's gradients against central finite differences in double.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "distca/kernels/cpu.h"
#include "distca/kernels/ref.h"
#include "test_util.h"

namespace distca::kernels {
namespace {

using testing::expect_close;

struct Doc {
  int64_t L, hq, hkv, D;
  std::vector<float> q, k, v, d_o;  // q, d_o [L, Hq, D]; k, v [L, Hkv, D]
};

Doc random_doc(uint64_t seed, int64_t L, int64_t hq, int64_t hkv, int64_t D) {
  std::mt19937_64 rng(seed);
  return {L, hq, hkv, D, testing::random_values<float>(rng, L * hq * D), testing::random_values<float>(rng, L * hkv * D),
          testing::random_values<float>(rng, L * hkv * D), testing::random_values<float>(rng, L * hq * D)};
}

struct Result {
  std::vector<float> o, lse, dq, dk, dv;  // in document order
};

// Runs the shards [a, b) as causal tasks with the document's prefix as keys; the Q buffer holds
// the shards' rows in task order. Results are put back in document order.
Result run_shards(CpuAttention& cpu, const Doc& doc, const std::vector<std::pair<int64_t, int64_t>>& shards) {
  const int64_t qd = doc.hq * doc.D;
  std::vector<AttnTask> tasks;
  std::vector<int64_t> row_of(doc.L);
  int64_t row = 0;
  for (auto [a, b] : shards) {
    tasks.push_back({row, b - a, 0, b, true});
    for (int64_t t = a; t < b; ++t) row_of[t] = row++;
  }
  EXPECT_EQ(row, doc.L) << "shards must cover the document";
  std::vector<float> q(doc.L * qd), d_o(doc.L * qd);
  for (int64_t t = 0; t < doc.L; ++t) {
    std::memcpy(&q[row_of[t] * qd], &doc.q[t * qd], qd * sizeof(float));
    std::memcpy(&d_o[row_of[t] * qd], &doc.d_o[t * qd], qd * sizeof(float));
  }
  const AttnDims dims{doc.L, doc.L, doc.hq, doc.hkv, doc.D};
  std::vector<float> o(q.size()), lse(doc.L * doc.hq), dq(q.size()), dk(doc.k.size()), dv(doc.v.size());
  EXPECT_TRUE(cpu.forward(AttnFwdParams<float>{dims, q.data(), doc.k.data(), doc.v.data(), tasks, {}, o.data(), lse.data()}).is_ok());
  EXPECT_TRUE(cpu.backward(AttnBwdParams<float>{dims, q.data(), doc.k.data(), doc.v.data(), o.data(), lse.data(), d_o.data(), tasks, {}, dq.data(), dk.data(), dv.data()}).is_ok());
  Result r{std::vector<float>(q.size()), std::vector<float>(lse.size()), std::vector<float>(q.size()), dk, dv};
  for (int64_t t = 0; t < doc.L; ++t) {
    std::memcpy(&r.o[t * qd], &o[row_of[t] * qd], qd * sizeof(float));
    std::memcpy(&r.dq[t * qd], &dq[row_of[t] * qd], qd * sizeof(float));
    std::memcpy(&r.lse[t * doc.hq], &lse[row_of[t] * doc.hq], doc.hq * sizeof(float));
  }
  return r;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<std::pair<int64_t, int64_t>> cut(int64_t L, std::vector<int64_t> sizes_cycle) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t a = 0, i = 0; a < L; ++i) {
    const int64_t b = std::min(L, a + sizes_cycle[i % sizes_cycle.size()]);
    out.emplace_back(a, b);
    a = b;
  }
  return out;
}

// Head/tail pairs of size m: [a, a+m) with [L-a-m, L-a), listed pair by pair.
std::vector<std::pair<int64_t, int64_t>> head_tail_pairs(int64_t L, int64_t m) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t a = 0;
  for (; 2 * (a + m) <= L; a += m) {
    out.emplace_back(a, a + m);
    out.emplace_back(L - a - m, L - a);
  }
  if (L - 2 * a > 0) out.emplace_back(a, L - a);  // the middle remainder
  return out;
}

class Decomposition : public ::testing::Test {
 protected:
  Doc doc = random_doc(21, 777, 4, 2, 64);
  CpuAttention cpu{{.num_threads = 2}};
  Result whole = run_shards(cpu, doc, {{0, doc.L}});
};

TEST_F(Decomposition, InOrderShardsAreBitIdenticalToTheWholeDocument) {
  for (const auto& shards : {cut(doc.L, {64}), cut(doc.L, {128}), cut(doc.L, {1, 2, 3, 5, 7, 11, 13, 200}), cut(doc.L, {776})}) {
    const Result r = run_shards(cpu, doc, shards);
    EXPECT_TRUE(bit_equal(r.o, whole.o)) << shards.size() << " shards: O";
    EXPECT_TRUE(bit_equal(r.lse, whole.lse)) << shards.size() << " shards: LSE";
    EXPECT_TRUE(bit_equal(r.dq, whole.dq)) << shards.size() << " shards: dQ";
    EXPECT_TRUE(bit_equal(r.dk, whole.dk)) << shards.size() << " shards: dK";
    EXPECT_TRUE(bit_equal(r.dv, whole.dv)) << shards.size() << " shards: dV";
  }
}

// Out of order, each query's O, LSE and dQ are still computed by the same lane arithmetic; only
// the order in which tasks add into a shared dK/dV row changes, so those match to rounding.
TEST_F(Decomposition, HeadTailPairsAndScrambledShardsMatchTheWholeDocument) {
  auto scrambled = cut(doc.L, {100, 37});
  std::reverse(scrambled.begin(), scrambled.end());
  std::swap(scrambled[1], scrambled[4]);
  for (const auto& shards : {head_tail_pairs(doc.L, 64), head_tail_pairs(doc.L, 128), scrambled}) {
    const Result r = run_shards(cpu, doc, shards);
    EXPECT_TRUE(bit_equal(r.o, whole.o));
    EXPECT_TRUE(bit_equal(r.lse, whole.lse));
    EXPECT_TRUE(bit_equal(r.dq, whole.dq));
    const double scale_k = testing::max_abs(whole.dk), scale_v = testing::max_abs(whole.dv);
    expect_close("dK", r.dk, whole.dk, doc.hkv, doc.D, 1e-5 * scale_k);
    expect_close("dV", r.dv, whole.dv, doc.hkv, doc.D, 1e-5 * scale_v);
  }
}

TEST_F(Decomposition, WholeDocumentMatchesTheDenseDoubleReference) {
  const int64_t L = doc.L;
  std::vector<double> q(doc.q.begin(), doc.q.end()), k(doc.k.begin(), doc.k.end()), v(doc.v.begin(), doc.v.end()),
      d_o(doc.d_o.begin(), doc.d_o.end());
  std::vector<double> o(q.size()), lse(L * doc.hq), dq(q.size()), dk(k.size()), dv(v.size());
  const ref::DenseDocument shape{L, doc.hq, doc.hkv, doc.D, {}};
  ref::dense_document_forward(shape, q.data(), k.data(), v.data(), o.data(), lse.data());
  ref::dense_document_backward(shape, q.data(), k.data(), v.data(), d_o.data(), dq.data(), dk.data(), dv.data());
  auto f = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
  expect_close("O", whole.o, f(o), doc.hq, doc.D, 1e-5);
  expect_close("LSE", whole.lse, f(lse), doc.hq, 1, 1e-5);
  expect_close("dQ", whole.dq, f(dq), doc.hq, doc.D, 1e-5 * testing::max_abs(f(dq)));
  expect_close("dK", whole.dk, f(dk), doc.hkv, doc.D, 1e-5 * testing::max_abs(f(dk)));
  expect_close("dV", whole.dv, f(dv), doc.hkv, doc.D, 1e-5 * testing::max_abs(f(dv)));
}

// Queries [a, L) with keys split at c: a non-causal piece over [0, c) and a causal piece over
// [c, L), run as two tasks of one call (the server received the query rows twice). The LSE merge
// of the forward pieces equals the unsplit O; backward pieces given the merged O and LSE add up
// to the unsplit dQ, and their dK/dV rows are the unsplit ones.
TEST_F(Decomposition, KvSplitMergedByLseEqualsTheUnsplitResult) {
  const int64_t a = 500, L = doc.L, qd = doc.hq * doc.D, kvd = doc.hkv * doc.D;
  const int64_t n = L - a;
  for (int64_t c : {int64_t{1}, int64_t{64}, int64_t{333}, a}) {
    std::vector<float> q(2 * n * qd), d_o(2 * n * qd);
    for (int copy = 0; copy < 2; ++copy) {
      std::memcpy(&q[copy * n * qd], &doc.q[a * qd], n * qd * sizeof(float));
      std::memcpy(&d_o[copy * n * qd], &doc.d_o[a * qd], n * qd * sizeof(float));
    }
    const std::vector<AttnTask> tasks = {{0, n, 0, c, false}, {n, n, c, L - c, true}};
    const AttnDims dims{2 * n, L, doc.hq, doc.hkv, doc.D};
    std::vector<float> o(q.size()), lse(2 * n * doc.hq);
    ASSERT_TRUE(cpu.forward(AttnFwdParams<float>{dims, q.data(), doc.k.data(), doc.v.data(), tasks, {}, o.data(), lse.data()}).is_ok());
    std::vector<float> o_merged(o.begin(), o.begin() + n * qd), lse_merged(lse.begin(), lse.begin() + n * doc.hq);
    lse_merge<float>(n, doc.hq, doc.D, &o[n * qd], &lse[n * doc.hq], o_merged.data(), lse_merged.data());
    const std::vector<float> o_want(whole.o.begin() + a * qd, whole.o.end());
    const std::vector<float> lse_want(whole.lse.begin() + a * doc.hq, whole.lse.end());
    expect_close("merged O", o_merged, o_want, doc.hq, doc.D, 2e-6);
    expect_close("merged LSE", lse_merged, lse_want, doc.hq, 1, 2e-6);

    // Backward: both pieces see the merged O and LSE.
    for (int copy = 0; copy < 2; ++copy) {
      std::copy(o_merged.begin(), o_merged.end(), o.begin() + copy * n * qd);
      std::copy(lse_merged.begin(), lse_merged.end(), lse.begin() + copy * n * doc.hq);
    }
    std::vector<float> dq(q.size()), dk(doc.k.size()), dv(doc.v.size());
    ASSERT_TRUE(cpu.backward(AttnBwdParams<float>{dims, q.data(), doc.k.data(), doc.v.data(), o.data(), lse.data(), d_o.data(), tasks, {}, dq.data(), dk.data(), dv.data()}).is_ok());
    std::vector<float> dq_sum(n * qd);
    for (int64_t i = 0; i < n * qd; ++i) dq_sum[i] = dq[i] + dq[n * qd + i];
    // The unsplit backward of the queries [a, L) alone.
    const std::vector<AttnTask> unsplit = {{0, n, 0, L, true}};
    const AttnDims dims1{n, L, doc.hq, doc.hkv, doc.D};
    std::vector<float> dq1(n * qd), dk1(dk.size()), dv1(dv.size());
    ASSERT_TRUE(cpu.backward(AttnBwdParams<float>{dims1, q.data(), doc.k.data(), doc.v.data(), o_merged.data(), lse_merged.data(), d_o.data(), unsplit, {}, dq1.data(), dk1.data(), dv1.data()}).is_ok());
    expect_close("dQ of the pieces", dq_sum, dq1, doc.hq, doc.D, 1e-5 * testing::max_abs(dq1));
    expect_close("dK of the pieces", dk, dk1, doc.hkv, doc.D, 1e-5 * testing::max_abs(dk1));
    expect_close("dV of the pieces", dv, dv1, doc.hkv, doc.D, 1e-5 * testing::max_abs(dv1));
    (void)kvd;
  }
}

// The fast kernel's gradients of sum(dO * O) against central differences of the dense double
// forward, on a tiny document.
TEST(FiniteDifferences, CpuGradientsMatchDoubleCentralDifferences) {
  const Doc doc = random_doc(31, 9, 2, 1, 32);
  auto to_d = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  std::vector<double> q = to_d(doc.q), k = to_d(doc.k), v = to_d(doc.v), d_o = to_d(doc.d_o);
  const ref::DenseDocument shape{doc.L, doc.hq, doc.hkv, doc.D, {}};
  auto loss = [&] {
    std::vector<double> o(q.size()), lse(doc.L * doc.hq);
    ref::dense_document_forward(shape, q.data(), k.data(), v.data(), o.data(), lse.data());
    return std::inner_product(o.begin(), o.end(), d_o.begin(), 0.0);
  };
  auto fd = [&](std::vector<double>& x) {
    std::vector<float> g(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i], h = 1e-5;
      x[i] = x0 + h;
      const double up = loss();
      x[i] = x0 - h;
      const double down = loss();
      x[i] = x0;
      g[i] = static_cast<float>((up - down) / (2 * h));
    }
    return g;
  };
  CpuAttention cpu;
  const Result r = run_shards(cpu, doc, {{0, 4}, {4, 9}});
  expect_close("dQ vs finite differences", r.dq, fd(q), doc.hq, doc.D, 1e-5);
  expect_close("dK vs finite differences", r.dk, fd(k), doc.hkv, doc.D, 1e-5);
  expect_close("dV vs finite differences", r.dv, fd(v), doc.hkv, doc.D, 1e-5);
}

}  // namespace
}  // namespace distca::kernels
