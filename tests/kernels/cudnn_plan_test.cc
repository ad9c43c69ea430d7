// CudnnAttention's host side (src/kernels/cuda/cudnn_plan.h), in every build: shape buckets, graph
// keys (a training run's plans build a bounded number of graphs), task grouping into calls, the
// dK/dV scratch layout and its sums, and the refusals; plus what create() says without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <unordered_set>

#include "../../src/kernels/cuda/cudnn_plan.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"

namespace distca::kernels::cudnn {
namespace {

const AttnDims kDims{0, 0, 8, 2, 128};

AttnDims dims_for(const std::vector<AttnTask>& tasks, int64_t extra_q = 0, int64_t extra_kv = 0) {
  AttnDims d = kDims;
  for (const AttnTask& t : tasks) {
    d.num_q_rows = std::max(d.num_q_rows, t.q_offset + t.q_len);
    d.num_kv_rows = std::max(d.num_kv_rows, t.kv_offset + t.kv_len);
  }
  d.num_q_rows += extra_q;
  d.num_kv_rows += extra_kv;
  return d;
}

// A server's list: each document cut into causal shards over its shared prefix, then non-causal
// key-range pieces (one with no key) over random K/V rows.
std::vector<AttnTask> server_tasks(std::mt19937_64& rng, const std::vector<int64_t>& docs, int64_t max_shard) {
  std::vector<AttnTask> tasks;
  int64_t q = 0, kv = 0;
  for (int64_t len : docs) {
    for (int64_t a = 0; a < len;) {
      const int64_t b = std::min(len, a + std::uniform_int_distribution<int64_t>(1, max_shard)(rng));
      tasks.push_back({q, b - a, kv, b, true});
      q += b - a;
      a = b;
    }
    kv += len;
  }
  for (int c = 0; c < 3; ++c) {
    const int64_t q_len = std::uniform_int_distribution<int64_t>(1, 70)(rng);
    const int64_t kv_len = c == 0 ? 0 : std::uniform_int_distribution<int64_t>(1, kv)(rng);
    tasks.push_back({q, q_len, std::uniform_int_distribution<int64_t>(0, kv - kv_len)(rng), kv_len, false});
    q += q_len;
  }
  std::shuffle(tasks.begin(), tasks.end(), rng);
  return tasks;
}

TEST(CudnnPlan, BucketsArePowersOfTwoAboveAFloor) {
  EXPECT_EQ(bucket(1), 1);
  EXPECT_EQ(bucket(5), 8);
  EXPECT_EQ(bucket(8), 8);
  EXPECT_EQ(bucket(1, 64), 64);
  EXPECT_EQ(bucket(64, 64), 64);
  EXPECT_EQ(bucket(65, 64), 128);
  EXPECT_EQ(bucket(32769, 64), 65536);
}

TEST(CudnnPlan, EachTaskIsOneSlotOfItsMaskKindsCall) {
  std::mt19937_64 rng(3);
  const std::vector<AttnTask> tasks = server_tasks(rng, {97, 1, 131, 5, 1023}, 61);
  const AttnDims d = dims_for(tasks, 3, 2);
  auto plan = plan_calls(d, tasks, {.backward = false, .bf16 = true, .scale = 0.125f});
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  ASSERT_EQ(plan.value().calls.size(), 2u);
  std::set<int> seen;
  for (const Call& call : plan.value().calls) {
    const GraphKey& k = call.key;
    EXPECT_FALSE(k.backward);
    EXPECT_GE(k.batch, static_cast<int64_t>(call.tasks.size()));
    EXPECT_EQ(k.batch, bucket(static_cast<int64_t>(call.tasks.size())));
    ASSERT_EQ(call.seq_q.size(), static_cast<size_t>(k.batch));
    ASSERT_EQ(call.q_off.size(), static_cast<size_t>(k.batch + 1));
    ASSERT_EQ(call.kv_off.size(), static_cast<size_t>(k.batch + 1));
    ASSERT_EQ(call.stats_off.size(), static_cast<size_t>(k.batch + 1));
    EXPECT_TRUE(call.dkv_off.empty());
    int64_t max_q = 0, max_kv = 0;
    for (size_t slot = 0; slot < call.tasks.size(); ++slot) {
      const AttnTask& t = tasks[call.tasks[slot]];
      EXPECT_TRUE(seen.insert(call.tasks[slot]).second) << "task " << call.tasks[slot] << " in two slots";
      EXPECT_EQ(t.is_causal, k.causal);
      EXPECT_GT(t.kv_len, 0) << "a task with no key is filled, not computed";
      EXPECT_EQ(call.seq_q[slot], t.q_len);
      EXPECT_EQ(call.seq_kv[slot], t.kv_len);
      EXPECT_EQ(call.q_off[slot], t.q_offset * d.num_q_heads * d.head_dim);
      EXPECT_EQ(call.stats_off[slot], t.q_offset * d.num_q_heads);
      EXPECT_EQ(call.kv_off[slot], t.kv_offset * d.num_kv_heads * d.head_dim);
      if (slot > 0) EXPECT_GT(call.q_off[slot], call.q_off[slot - 1]) << "slots in query order";
      max_q = std::max(max_q, t.q_len);
      max_kv = std::max(max_kv, t.kv_len);
    }
    EXPECT_EQ(k.s_q, bucket(max_q, 64));
    EXPECT_EQ(k.s_kv, bucket(max_kv, 64));
    for (size_t slot = call.tasks.size(); slot < static_cast<size_t>(k.batch); ++slot) {
      EXPECT_EQ(call.seq_q[slot], 0);
      EXPECT_EQ(call.seq_kv[slot], 0);
    }
    for (size_t slot = call.tasks.size(); slot < static_cast<size_t>(k.batch + 1); ++slot) {
      EXPECT_GE(call.q_off[slot], call.q_off[slot - 1]);
      EXPECT_LE(call.q_off[slot], d.num_q_rows * d.num_q_heads * d.head_dim);
    }
  }
  // Every task with work is in one call; the others' rows and the uncovered rows are filled.
  std::vector<bool> covered(d.num_q_rows, false);
  for (int i : seen) {
    for (int64_t r = 0; r < tasks[i].q_len; ++r) covered[tasks[i].q_offset + r] = true;
  }
  for (const auto& [begin, end] : plan.value().empty_q_rows) {
    for (int64_t r = begin; r < end; ++r) {
      EXPECT_FALSE(covered[r]) << "row " << r << " is both computed and filled";
      covered[r] = true;
    }
  }
  EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](bool c) { return c; })) << "a Q row nobody writes";
  int with_work = 0;
  for (const AttnTask& t : tasks) with_work += t.q_len > 0 && t.kv_len > 0;
  EXPECT_EQ(static_cast<int>(seen.size()), with_work);
}

TEST(CudnnPlan, ExactBatchHasNoEmptySlots) {
  std::mt19937_64 rng(4);
  const std::vector<AttnTask> tasks = server_tasks(rng, {300, 77}, 50);
  auto plan = plan_calls(dims_for(tasks), tasks, {.exact_batch = true});
  ASSERT_TRUE(plan.is_ok());
  for (const Call& call : plan.value().calls) EXPECT_EQ(call.key.batch, static_cast<int64_t>(call.tasks.size()));
}

TEST(CudnnPlan, ATrainingRunBuildsABoundedNumberOfGraphs) {
  // 200 steps of a server's lists: documents of 1..32K tokens, shards of up to 4K.
  std::mt19937_64 rng(5);
  std::unordered_set<GraphKey, GraphKeyHash> keys;
  size_t calls = 0;
  for (int step = 0; step < 200; ++step) {
    std::vector<int64_t> docs;
    for (int64_t total = 0; total < 32768;) {
      const int64_t len = std::min<int64_t>(32768 - total, std::uniform_int_distribution<int64_t>(1, 32768)(rng));
      docs.push_back(len);
      total += len;
    }
    const std::vector<AttnTask> tasks = server_tasks(rng, docs, 4096);
    for (bool backward : {false, true}) {
      auto plan = plan_calls(dims_for(tasks), tasks, {.backward = backward, .scale = 0.088f});
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      for (const Call& call : plan.value().calls) {
        keys.insert(call.key);
        ++calls;
      }
    }
  }
  EXPECT_GT(calls, 600u);
  EXPECT_LE(keys.size(), 60u) << "buckets must bound the graphs a run builds";
  EXPECT_GT(keys.size(), 2u);
}

TEST(CudnnPlan, KeysDifferInEverythingAGraphDependsOn) {
  const std::vector<AttnTask> tasks{{0, 100, 0, 100, true}};
  const AttnDims d = dims_for(tasks);
  auto key = [&](PlanOptions o, AttnDims dims) { return plan_calls(dims, tasks, o).value().calls.at(0).key; };
  const GraphKey base = key({.scale = 0.1f}, d);
  EXPECT_EQ(base, key({.scale = 0.1f}, d));
  EXPECT_NE(base, key({.scale = 0.2f}, d));
  EXPECT_NE(base, key({.bf16 = false, .scale = 0.1f}, d));
  EXPECT_NE(base, key({.backward = true, .scale = 0.1f}, d));
  AttnDims gqa = d;
  gqa.num_kv_heads = 4;
  EXPECT_NE(base, key({.scale = 0.1f}, gqa));
  AttnDims d64 = d;
  d64.head_dim = 64;
  EXPECT_NE(base, key({.scale = 0.1f}, d64));
  // A list in the same buckets shares the graph.
  const std::vector<AttnTask> other{{0, 90, 0, 120, true}};
  EXPECT_EQ(base, plan_calls(dims_for(other), other, {.scale = 0.1f}).value().calls.at(0).key);
  EXPECT_EQ(GraphKeyHash{}(base), GraphKeyHash{}(key({.scale = 0.1f}, d)));
}

TEST(CudnnPlan, DisjointKeysWriteDkDvInPlaceAndZeroUnreadRows) {
  const std::vector<AttnTask> tasks{{0, 50, 0, 50, true}, {50, 30, 60, 30, true}, {80, 10, 95, 5, false}};
  const AttnDims d = dims_for(tasks, 0, 7);
  auto plan = plan_calls(d, tasks, {.backward = true});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(plan.value().kv_scratch);
  EXPECT_TRUE(plan.value().add_spans.empty());
  const std::vector<std::pair<int64_t, int64_t>> unread{{50, 60}, {90, 95}, {100, 107}};
  EXPECT_EQ(plan.value().empty_kv_rows, unread);
  for (const Call& call : plan.value().calls) {
    for (size_t slot = 0; slot < call.tasks.size(); ++slot) EXPECT_EQ(call.dkv_off[slot], call.kv_off[slot]);
    EXPECT_EQ(call.key.total_q, bucket(d.num_q_rows, 64));
  }
}

TEST(CudnnPlan, SharedKeysOrFp32SumsGoThroughScratchThatSumsExactly) {
  std::mt19937_64 rng(6);
  const std::vector<AttnTask> tasks = server_tasks(rng, {200, 17, 64, 1023}, 64);
  const AttnDims d = dims_for(tasks, 0, 5);
  ASSERT_TRUE(kv_ranges_overlap(tasks));
  for (bool fp32 : {false, true}) {
    auto planned = plan_calls(d, tasks, {.backward = true, .dkv_fp32 = fp32});
    ASSERT_TRUE(planned.is_ok());
    const Plan& plan = planned.value();
    EXPECT_TRUE(plan.kv_scratch);
    EXPECT_TRUE(plan.empty_kv_rows.empty()) << "the sums are zeroed whole";
    // Emulate the kernels: each slot writes "its" gradient into its scratch rows, then the spans
    // add them; the result must be the per-row sum over the tasks that read the row.
    const int64_t row = 1;  // one element a row is enough for the layout
    std::vector<double> scratch(plan.kv_scratch_rows * row, 0.0), expect(d.num_kv_rows, 0.0), got(d.num_kv_rows, 0.0);
    int64_t scratch_used = 0;
    for (const Call& call : plan.calls) {
      EXPECT_EQ(call.key.total_kv, bucket(plan.kv_scratch_rows, 64));
      for (size_t slot = 0; slot < call.tasks.size(); ++slot) {
        const AttnTask& t = tasks[call.tasks[slot]];
        const int64_t first = call.dkv_off[slot] / (d.num_kv_heads * d.head_dim);
        ASSERT_LE(first + t.kv_len, plan.kv_scratch_rows);
        for (int64_t j = 0; j < t.kv_len; ++j) {
          const double g = 1.0 + call.tasks[slot] * 1000 + j;  // task- and row-specific
          EXPECT_EQ(scratch[first + j], 0.0) << "two slots share scratch rows";
          scratch[first + j] = g;
          expect[t.kv_offset + j] += g;
        }
        scratch_used += t.kv_len;
      }
    }
    EXPECT_EQ(scratch_used, plan.kv_scratch_rows);
    for (const AddSpan& s : plan.add_spans) {
      for (int64_t j = 0; j < s.rows; ++j) got[s.dst_row + j] += scratch[s.src_row + j];
    }
    EXPECT_EQ(got, expect);
  }
  // Disjoint keys with fp32 sums asked for also go through scratch (cuDNN writes the storage dtype).
  const std::vector<AttnTask> disjoint{{0, 10, 0, 10, true}};
  EXPECT_TRUE(plan_calls(dims_for(disjoint), disjoint, {.backward = true, .dkv_fp32 = true}).value().kv_scratch);
}

TEST(CudnnPlan, OffsetsPastInt32AreRefused) {
  const std::vector<AttnTask> tasks{{0, 10, 0, 10, true}};
  AttnDims d = dims_for(tasks);
  d.num_q_rows = int64_t{1} << 22;  // x 8 heads x 128 = 2^32 elements
  auto plan = plan_calls(d, tasks, {});
  ASSERT_FALSE(plan.is_ok());
  EXPECT_NE(plan.status().message().find("int32"), std::string::npos) << plan.status().to_string();
}

TEST(CudnnPlan, AListWithNothingToComputeHasNoCalls) {
  const std::vector<AttnTask> tasks{{0, 5, 0, 0, false}};
  auto plan = plan_calls(dims_for(tasks, 2), tasks, {.backward = true});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_TRUE(plan.value().calls.empty());
  const std::vector<std::pair<int64_t, int64_t>> all{{0, 7}};
  EXPECT_EQ(plan.value().empty_q_rows, all);
}

TEST(CudnnAttentionHost, RefusesBadInputBeforeAnyDeviceWork) {
  // Head dim 96 and a task past the end: the checks shared with the distca kernel (validate) say so.
  CudaFwdArgs a;
  a.dims = {10, 10, 2, 2, 96};
  std::vector<AttnTask> tasks{{0, 10, 0, 10, true}};
  a.tasks = tasks;
  alignas(16) static char buffer[64];
  a.q = a.k = a.v = buffer;
  a.o = buffer;
  a.lse = reinterpret_cast<float*>(buffer);
  Status st = validate(a);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("head dims 64 and 128"), std::string::npos) << st.to_string();
  a.dims.head_dim = 64;
  tasks[0].kv_len = 11;
  st = validate(a);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
}

TEST(CudnnAttentionHost, CreateSaysWhyItCannotRun) {
  auto made = CudnnAttention::create();
  if (made.is_ok()) GTEST_SKIP() << "skipped: a GPU with cuDNN is here (the GPU tests cover it)";
  EXPECT_FALSE(made.status().message().empty());
  auto via = CudaAttention::create(-1, CudaKernel::kCudnn);
  EXPECT_FALSE(via.is_ok());
  EXPECT_EQ(cudnn_built(), !cudnn_version().empty());
  EXPECT_EQ(parse_cuda_kernel("cudnn").value(), CudaKernel::kCudnn);
  EXPECT_EQ(parse_cuda_kernel("distca").value(), CudaKernel::kDistca);
  EXPECT_FALSE(parse_cuda_kernel("flash").is_ok());
}

}  // namespace
}  // namespace distca::kernels::cudnn
