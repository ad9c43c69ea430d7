// The reference itself: the task-list reference equals the dense whole-document formulation, and
// both gradients equal central finite differences of the forward, all in double.
#include "distca/kernels/ref.h"

#include <gtest/gtest.h>

#include <random>

#include "test_util.h"

namespace distca::kernels {
namespace {

struct Doc {
  ref::DenseDocument shape;
  std::vector<double> q, k, v, d_o;
};

// Values that are exactly representable in float, so float-typed and double-typed
// implementations see the same inputs.
Doc random_doc(std::mt19937_64& rng, int64_t L, int64_t hq, int64_t hkv, int64_t d) {
  Doc doc{{L, hq, hkv, d, {}}, {}, {}, {}, {}};
  auto fill = [&](std::vector<double>& x, int64_t n) {
    const auto f = testing::random_values<float>(rng, n);
    x.assign(f.begin(), f.end());
  };
  fill(doc.q, L * hq * d);
  fill(doc.k, L * hkv * d);
  fill(doc.v, L * hkv * d);
  fill(doc.d_o, L * hq * d);
  return doc;
}

double loss(const Doc& doc) {  // sum(dO * O): its gradient is the backward of dO
  std::vector<double> o(doc.q.size()), lse(doc.shape.length * doc.shape.num_q_heads);
  ref::dense_document_forward(doc.shape, doc.q.data(), doc.k.data(), doc.v.data(), o.data(), lse.data());
  double sum = 0;
  for (std::size_t i = 0; i < o.size(); ++i) sum += o[i] * doc.d_o[i];
  return sum;
}

std::vector<double> finite_differences(Doc doc, std::vector<double> Doc::*field) {
  const double h = 1e-5;
  std::vector<double> grad((doc.*field).size());
  for (std::size_t i = 0; i < grad.size(); ++i) {
    const double x = (doc.*field)[i];
    (doc.*field)[i] = x + h;
    const double up = loss(doc);
    (doc.*field)[i] = x - h;
    const double down = loss(doc);
    (doc.*field)[i] = x;
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

void expect_near_all(const char* name, const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << name << " at " << i;
}

TEST(Reference, DenseBackwardEqualsFiniteDifferences) {
  std::mt19937_64 rng(4);
  const Doc doc = random_doc(rng, 6, 4, 2, 5);
  std::vector<double> dq(doc.q.size()), dk(doc.k.size()), dv(doc.v.size());
  ref::dense_document_backward(doc.shape, doc.q.data(), doc.k.data(), doc.v.data(), doc.d_o.data(),
                               dq.data(), dk.data(), dv.data());
  expect_near_all("dQ", dq, finite_differences(doc, &Doc::q), 1e-8);
  expect_near_all("dK", dk, finite_differences(doc, &Doc::k), 1e-8);
  expect_near_all("dV", dv, finite_differences(doc, &Doc::v), 1e-8);
}

// Shards (in a scrambled order, some with a gap of unused Q rows) through the task-list
// reference, against the dense document and its finite differences.
TEST(Reference, TaskListOverShardsEqualsDenseDocument) {
  std::mt19937_64 rng(8);
  const int64_t L = 11, hq = 2, hkv = 1, D = 3;
  const Doc doc = random_doc(rng, L, hq, hkv, D);
  const std::vector<std::pair<int64_t, int64_t>> shards = {{7, 11}, {0, 1}, {3, 7}, {1, 3}};
  // Q rows of the task list: shard after shard, in the order above.
  std::vector<AttnTask> tasks;
  std::vector<int64_t> q_row_of_token(L);
  int64_t row = 0;
  for (auto [a, b] : shards) {
    tasks.push_back({row, b - a, 0, b, true});
    for (int64_t t = a; t < b; ++t) q_row_of_token[t] = row++;
  }
  const int64_t qd = hq * D;
  std::vector<float> q(L * qd), d_o(L * qd), k(doc.k.begin(), doc.k.end()), v(doc.v.begin(), doc.v.end());
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t i = 0; i < qd; ++i) {
      q[q_row_of_token[t] * qd + i] = static_cast<float>(doc.q[t * qd + i]);
      d_o[q_row_of_token[t] * qd + i] = static_cast<float>(doc.d_o[t * qd + i]);
    }
  }
  const AttnDims dims{L, L, hq, hkv, D};
  std::vector<float> o(L * qd), lse(L * hq), dq(L * qd), dk(k.size()), dv(v.size());
  ASSERT_TRUE(ref::attention_forward(AttnFwdParams<float>{dims, q.data(), k.data(), v.data(), tasks, {}, o.data(), lse.data()}).is_ok());
  ASSERT_TRUE(ref::attention_backward(AttnBwdParams<float>{dims, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(), tasks, {}, dq.data(), dk.data(), dv.data()}).is_ok());

  std::vector<double> o_want(L * qd), lse_want(L * hq), dq_want(L * qd), dk_want(k.size()), dv_want(v.size());
  ref::dense_document_forward(doc.shape, doc.q.data(), doc.k.data(), doc.v.data(), o_want.data(), lse_want.data());
  ref::dense_document_backward(doc.shape, doc.q.data(), doc.k.data(), doc.v.data(), doc.d_o.data(), dq_want.data(), dk_want.data(), dv_want.data());
  const auto fd_q = finite_differences(doc, &Doc::q);
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t h = 0; h < hq; ++h) EXPECT_NEAR(lse[q_row_of_token[t] * hq + h], lse_want[t * hq + h], 1e-6);
    for (int64_t i = 0; i < qd; ++i) {
      EXPECT_NEAR(o[q_row_of_token[t] * qd + i], o_want[t * qd + i], 1e-6);
      EXPECT_NEAR(dq[q_row_of_token[t] * qd + i], dq_want[t * qd + i], 1e-6);
      EXPECT_NEAR(dq[q_row_of_token[t] * qd + i], fd_q[t * qd + i], 1e-6);
    }
  }
  const auto fd_k = finite_differences(doc, &Doc::k);
  const auto fd_v = finite_differences(doc, &Doc::v);
  for (std::size_t i = 0; i < dk.size(); ++i) {
    EXPECT_NEAR(dk[i], dk_want[i], 1e-6);
    EXPECT_NEAR(dk[i], fd_k[i], 1e-6);
    EXPECT_NEAR(dv[i], dv_want[i], 1e-6);
    EXPECT_NEAR(dv[i], fd_v[i], 1e-6);
  }
}

}  // namespace
}  // namespace distca::kernels
