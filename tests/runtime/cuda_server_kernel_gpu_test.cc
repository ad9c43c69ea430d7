// CudaServerKernel on a GPU (label `gpu`): direct calls against the CPU kernels on every kind of
// task (shards sharing K/V, non-causal pieces, an empty key range, uncovered Q rows, unread K/V
// rows, GQA, head dims 64 and 128, bf16 and fp16); buffer reuse; refusals; and the Dispatcher
// with it on one rank and on two thread-ranks sharing the GPU. Each test skips, with the
// reason, where there is no CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <tuple>

#include "../comm/cuda_device.h"
#include "../kernels/test_util.h"
#include "cuda_harness.h"
#include "distca/comm/local_comm.h"
#include "distca/kernels/cudnn.h"
#include "distca/runtime/cuda_server_kernel.h"

namespace distca::runtime {
namespace {

using kernels::AttnBwdParams;
using kernels::AttnDims;
using kernels::AttnFwdParams;
using kernels::AttnTask;
using kernels::CudaDType;
using kernels::CudaKernel;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

class CpuFp32Kernel final : public ServerKernel {
 public:
  Status forward(const AttnFwdParams<float>& p) override { return cpu_.forward(p); }
  Status backward(const AttnBwdParams<float>& p) override { return cpu_.backward(p); }

 private:
  kernels::CpuAttention cpu_{kernels::CpuAttentionOptions{.num_threads = 1}};
};

struct Shape {
  const char* name;
  int64_t d, hq, hkv;
  std::vector<int64_t> docs;
  int64_t max_shard;
  int64_t gap;         // uncovered Q rows after each causal task
  int64_t unread_kv;   // K/V rows after the documents that no task reads
};

// A server's task list: documents cut into causal shards over their shared K/V prefix, then
// three non-causal pieces (one with no key) over random K/V ranges.
struct Problem {
  AttnDims dims;
  std::vector<AttnTask> tasks;
  std::vector<float> q, k, v, d_o;  // bf16 values
};

Problem make_problem(const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  kernels::testing::TaskSet set = kernels::testing::shard_documents(rng, s.docs, s.max_shard, s.hq, s.hkv, s.d, s.gap);
  Problem p;
  p.dims = set.dims;
  p.tasks = set.tasks;
  for (int c = 0; c < 3; ++c) {
    const int64_t q_len = std::uniform_int_distribution<int64_t>(1, 70)(rng);
    const int64_t kv_len = c == 0 ? 0 : std::uniform_int_distribution<int64_t>(1, p.dims.num_kv_rows)(rng);
    const int64_t kv_offset = std::uniform_int_distribution<int64_t>(0, p.dims.num_kv_rows - kv_len)(rng);
    p.tasks.push_back({p.dims.num_q_rows, q_len, kv_offset, kv_len, false});
    p.dims.num_q_rows += q_len;
  }
  p.dims.num_kv_rows += s.unread_kv;
  const int64_t q_elems = p.dims.num_q_rows * s.hq * s.d, kv_elems = p.dims.num_kv_rows * s.hkv * s.d;
  p.q = kernels::testing::to_floats(kernels::testing::random_values<bf16>(rng, q_elems));
  p.k = kernels::testing::to_floats(kernels::testing::random_values<bf16>(rng, kv_elems));
  p.v = kernels::testing::to_floats(kernels::testing::random_values<bf16>(rng, kv_elems));
  p.d_o = kernels::testing::to_floats(kernels::testing::random_values<bf16>(rng, q_elems));
  return p;
}

struct Outputs {
  std::vector<float> o, lse, dq, dk, dv;
};

// Forward, then backward from the given forward's O and LSE (the same for every kernel, so that
// the backward results compare like for like); every output starts as NaN.
Result<Outputs> run(ServerKernel& kernel, const Problem& p, const Outputs* forward_of = nullptr) {
  const AttnDims& d = p.dims;
  const int64_t q_elems = d.num_q_rows * d.num_q_heads * d.head_dim, kv_elems = d.num_kv_rows * d.num_kv_heads * d.head_dim;
  Outputs out;
  out.o.assign(q_elems, kNaN);
  out.lse.assign(d.num_q_rows * d.num_q_heads, kNaN);
  out.dq.assign(q_elems, kNaN);
  out.dk.assign(kv_elems, kNaN);
  out.dv.assign(kv_elems, kNaN);
  DISTCA_RETURN_IF_ERROR(kernel.forward(AttnFwdParams<float>{d, p.q.data(), p.k.data(), p.v.data(), p.tasks, {},
                                                             out.o.data(), out.lse.data()}));
  const Outputs& f = forward_of != nullptr ? *forward_of : out;
  DISTCA_RETURN_IF_ERROR(kernel.backward(AttnBwdParams<float>{d, p.q.data(), p.k.data(), p.v.data(), f.o.data(),
                                                              f.lse.data(), p.d_o.data(), p.tasks, {}, out.dq.data(),
                                                              out.dk.data(), out.dv.data()}));
  return out;
}

// The rows of Q no task covers, and the K/V rows no task reads.
std::pair<std::vector<bool>, std::vector<bool>> coverage(const Problem& p) {
  std::vector<bool> q(p.dims.num_q_rows, false), kv(p.dims.num_kv_rows, false);
  for (const AttnTask& t : p.tasks) {
    for (int64_t i = 0; i < t.q_len; ++i) q[t.q_offset + i] = true;
    for (int64_t j = 0; j < t.kv_len; ++j) kv[t.kv_offset + j] = true;
  }
  return {q, kv};
}

// The kernel's results against the fp32 CPU kernel, within the bound of cuda_harness.h;
// the rows no task writes exactly as attention.h says.
void expect_matches_cpu(ServerKernel& kernel, const Problem& p) {
  CpuFp32Kernel fp32_kernel;
  testing::Bf16CpuKernel bf16_kernel;
  auto fp32 = run(fp32_kernel, p);
  ASSERT_TRUE(fp32.is_ok()) << fp32.status().to_string();
  auto bf16_ref = run(bf16_kernel, p, &fp32.value());
  ASSERT_TRUE(bf16_ref.is_ok()) << bf16_ref.status().to_string();
  auto got = run(kernel, p, &fp32.value());
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  const Outputs &a = fp32.value(), &b = bf16_ref.value(), &g = got.value();
  const std::tuple<const char*, const std::vector<float>*, const std::vector<float>*, const std::vector<float>*> tensors[] = {
      {"O", &g.o, &a.o, &b.o}, {"LSE", &g.lse, &a.lse, &b.lse}, {"dQ", &g.dq, &a.dq, &b.dq},
      {"dK", &g.dk, &a.dk, &b.dk}, {"dV", &g.dv, &a.dv, &b.dv}};
  for (const auto& [name, got_t, fp32_t, bf16_t] : tensors) {
    const Status st = testing::compare_to_bf16_bound(name, 0, *got_t, *fp32_t, *bf16_t);
    EXPECT_TRUE(st.is_ok()) << st.message();
  }

  const auto [q_covered, kv_read] = coverage(p);
  const int64_t hq = p.dims.num_q_heads, hkv = p.dims.num_kv_heads, d = p.dims.head_dim;
  int64_t uncovered = 0, unread = 0;
  for (int64_t r = 0; r < p.dims.num_q_rows; ++r) {
    if (q_covered[r]) continue;
    ++uncovered;
    for (int64_t i = 0; i < hq * d; ++i) {
      ASSERT_EQ(g.o[r * hq * d + i], 0.0f) << "O of uncovered row " << r;
      ASSERT_EQ(g.dq[r * hq * d + i], 0.0f) << "dQ of uncovered row " << r;
    }
    for (int64_t h = 0; h < hq; ++h) ASSERT_EQ(g.lse[r * hq + h], kNegInf) << "LSE of uncovered row " << r;
  }
  for (int64_t r = 0; r < p.dims.num_kv_rows; ++r) {
    if (kv_read[r]) continue;
    ++unread;
    for (int64_t i = 0; i < hkv * d; ++i) {
      ASSERT_EQ(g.dk[r * hkv * d + i], 0.0f) << "dK of unread row " << r;
      ASSERT_EQ(g.dv[r * hkv * d + i], 0.0f) << "dV of unread row " << r;
    }
  }
  // The queries of the task with no key: O = 0, LSE = -inf.
  for (const AttnTask& t : p.tasks) {
    if (t.kv_len != 0) continue;
    for (int64_t i = 0; i < t.q_len * hq; ++i) ASSERT_EQ(g.lse[t.q_offset * hq + i], kNegInf);
    for (int64_t i = 0; i < t.q_len * hq * d; ++i) ASSERT_EQ(g.o[t.q_offset * hq * d + i], 0.0f);
  }
  EXPECT_GT(uncovered + unread, 0) << "the problem must have rows no task writes";
}

struct Case {
  friend void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }
  static std::string name(const Case& c) {
    return std::string(kernels::cuda_kernel_name(c.kernel)) + "_" + c.shape.name + "_" + kernels::cuda_dtype_name(c.dtype);
  }
  Shape shape;
  CudaDType dtype;
  CudaKernel kernel;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const Shape& shape : std::vector<Shape>{
           {"primes_gqa2_d64", 64, 4, 2, {97, 1, 131, 5}, 61, 1, 3},
           {"shards64_gqa8_d128", 128, 8, 1, {200, 17, 64}, 64, 0, 5},
           {"mha4_d128", 128, 4, 4, {257, 2}, 100, 2, 1},
           {"odd_gqa4_d128", 128, 8, 2, {1, 5, 77, 1023}, 300, 1, 2},
       }) {
    for (CudaKernel kernel : {CudaKernel::kDistca, CudaKernel::kCudnn, CudaKernel::kHopper}) {
      for (CudaDType dtype : {CudaDType::kBf16, CudaDType::kFp16}) out.push_back({shape, dtype, kernel});
    }
  }
  return out;
}

class CudaServerKernelVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(CudaServerKernelVsCpu, MatchesTheCpuKernelsOnEveryKindOfTask) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  const Case& c = GetParam();
  if (c.kernel == CudaKernel::kCudnn && !kernels::cudnn_built()) GTEST_SKIP() << "skipped: this build has no cuDNN kernel";
  auto kernel = CudaServerKernel::create(-1, c.dtype, c.kernel);
  if (c.kernel == CudaKernel::kHopper && !kernel.is_ok() &&
      kernel.status().message().find("compute capability 9.0") != std::string::npos) {
    GTEST_SKIP() << "skipped: " << kernel.status().message();
  }
  ASSERT_TRUE(kernel.is_ok()) << kernel.status().to_string();
  EXPECT_EQ(kernel.value()->dtype(), c.dtype);
  EXPECT_EQ(kernel.value()->kernel(), c.kernel);
  expect_matches_cpu(*kernel.value(), make_problem(c.shape, 7));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaServerKernelVsCpu, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return Case::name(info.param); });

TEST(CudaServerKernelGpu, ReusesItsDeviceBuffersAndGrowsThem) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  auto created = CudaServerKernel::create();
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  CudaServerKernel& kernel = *created.value();
  const Shape small{"small", 64, 4, 2, {40, 3}, 16, 1, 1};
  const Shape big{"big", 64, 4, 2, {300, 100}, 64, 1, 2};
  const Shape bigger{"bigger", 128, 4, 2, {600}, 64, 0, 1};
  expect_matches_cpu(kernel, make_problem(big, 1));
  const int64_t after_big = kernel.device_bytes();
  EXPECT_GT(after_big, 0);
  expect_matches_cpu(kernel, make_problem(small, 2));
  EXPECT_EQ(kernel.device_bytes(), after_big) << "a smaller call allocates nothing";
  expect_matches_cpu(kernel, make_problem(bigger, 3));
  EXPECT_GT(kernel.device_bytes(), after_big);
}

TEST(CudaServerKernelGpu, RefusesWhatItCannotRunAndStaysUsable) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  auto created = CudaServerKernel::create();
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  CudaServerKernel& kernel = *created.value();
  // Head dim 32: the CPU kernels take it, the CUDA kernels do not.
  const Problem d32 = make_problem({"d32", 32, 2, 2, {50}, 20, 0, 0}, 4);
  std::vector<float> o(d32.q.size()), lse(d32.dims.num_q_rows * 2);
  Status st = kernel.forward(AttnFwdParams<float>{d32.dims, d32.q.data(), d32.k.data(), d32.v.data(), d32.tasks, {},
                                                  o.data(), lse.data()});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("head dim"), std::string::npos) << st.to_string();
  // A task past the end of K/V: refused before anything is copied.
  Problem bad = make_problem({"bad", 64, 2, 2, {50}, 20, 0, 0}, 5);
  bad.tasks[0].kv_len = bad.dims.num_kv_rows + 1;
  std::vector<float> o2(bad.q.size()), lse2(bad.dims.num_q_rows * 2);
  st = kernel.forward(AttnFwdParams<float>{bad.dims, bad.q.data(), bad.k.data(), bad.v.data(), bad.tasks, {}, o2.data(),
                                           lse2.data()});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  expect_matches_cpu(kernel, make_problem({"after", 64, 2, 2, {50, 9}, 20, 1, 1}, 6));
}

plan::Batch dispatch_batch(int R) {
  auto batch = plan::pack_documents({300, 1, 17, 90, 2, 500, 33, 1, 64, 250}, R, 1260 / R);
  EXPECT_TRUE(batch.is_ok()) << batch.status().to_string();
  return batch.value();
}

TEST(CudaServerKernelGpu, DispatcherOnOneRankMatchesTheCpuKernels) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  const plan::Batch batch = dispatch_batch(1);
  const auto statuses = comm::LocalWorld::run(1, [&batch](comm::Communicator& comm) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto kernel, CudaServerKernel::create());
    return testing::check_kernel_on_plans(comm, batch, *kernel).status();
  });
  EXPECT_TRUE(statuses[0].is_ok()) << statuses[0].to_string();
}

// Two ranks as threads, each with its own CudaServerKernel on the same GPU.
TEST(CudaServerKernelGpu, DispatcherOnTwoRanksSharingTheGpuMatchesTheCpuKernels) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  const plan::Batch batch = dispatch_batch(2);
  const auto statuses = comm::LocalWorld::run(2, [&batch](comm::Communicator& comm) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto kernel, CudaServerKernel::create(0));
    return testing::check_kernel_on_plans(comm, batch, *kernel).status();
  });
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
}

// The same with cuDNN's kernel on both ranks (one CudnnAttention each, sharing the GPU).
TEST(CudaServerKernelGpu, DispatcherOnTwoRanksWithCudnnMatchesTheCpuKernels) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  if (!kernels::cudnn_built()) GTEST_SKIP() << "skipped: this build has no cuDNN kernel";
  const plan::Batch batch = dispatch_batch(2);
  const auto statuses = comm::LocalWorld::run(2, [&batch](comm::Communicator& comm) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto kernel, CudaServerKernel::create(0, CudaDType::kBf16, CudaKernel::kCudnn));
    return testing::check_kernel_on_plans(comm, batch, *kernel).status();
  });
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
}

}  // namespace
}  // namespace distca::runtime
