// CpuAttention allocates nothing on a call no larger than an earlier one: this binary replaces
// the global operator new with one that counts calls.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <random>

#include "distca/kernels/cpu.h"
#include "test_util.h"

namespace {
std::atomic<int64_t> g_allocations{0};
}

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t align) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (size + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace distca::kernels {
namespace {

template <typename T>
void expect_second_call_allocates_nothing() {
  std::mt19937_64 rng(9);
  const testing::TaskSet set = testing::shard_documents(rng, {300, 45, 129}, 100, 4, 2, 64, 1);
  const AttnDims& n = set.dims;
  const int64_t nq = n.num_q_rows * n.num_q_heads * n.head_dim, nkv = n.num_kv_rows * n.num_kv_heads * n.head_dim;
  auto q = testing::random_values<T>(rng, nq), d_o = testing::random_values<T>(rng, nq);
  auto k = testing::random_values<T>(rng, nkv), v = testing::random_values<T>(rng, nkv);
  std::vector<T> o(nq), dq(nq), dk(nkv), dv(nkv);
  std::vector<float> lse(n.num_q_rows * n.num_q_heads);
  const AttnFwdParams<T> fp{n, q.data(), k.data(), v.data(), set.tasks, {}, o.data(), lse.data()};
  const AttnBwdParams<T> bp{n, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(), set.tasks, {}, dq.data(), dk.data(), dv.data()};
  CpuAttention cpu({.num_threads = 2});
  ASSERT_TRUE(cpu.forward(fp).is_ok());
  ASSERT_TRUE(cpu.backward(bp).is_ok());
  const int64_t before = g_allocations.load();
  ASSERT_TRUE(cpu.forward(fp).is_ok());
  ASSERT_TRUE(cpu.backward(bp).is_ok());
  EXPECT_EQ(g_allocations.load() - before, 0);
  // The counter works: a fresh object does allocate.
  { CpuAttention other({.num_threads = 2}); }
  EXPECT_GT(g_allocations.load() - before, 0);
}

TEST(CpuAttentionAllocation, RepeatedFp32CallsAllocateNothing) { expect_second_call_allocates_nothing<float>(); }
TEST(CpuAttentionAllocation, RepeatedBf16CallsAllocateNothing) { expect_second_call_allocates_nothing<bf16>(); }

}  // namespace
}  // namespace distca::kernels
