// distca.torch's split of a plan's attention tasks (task_split.h): on sampled long-context
// batches the two nano-batches' exchanges move at most the plan's Q entries and (1 + kv_budget)x
// its K/V entries (so every phase at most 1.05x the plan's bytes, whatever the model and dtypes),
// every server's halves stay within the split's level, and every causal pair is computed exactly
// once. python/tests/test_torch_nanobatch.py checks the same through _distca, and that the split
// is exactly the NumPy implementation it replaced.
#include "distca/layout/task_split.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "distca/layout/exchange.h"
#include "distca/layout/route.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"
#include "layout/plans.h"

namespace distca::layout {
namespace {

using layout::testing::make_plan;

// (R) pairs per server, in doubles as the split counts them.
std::vector<double> server_pairs(const std::vector<plan::Task>& tasks, int32_t num_ranks) {
  std::vector<double> out(static_cast<size_t>(num_ranks), 0.0);
  for (const plan::Task& t : tasks) out[t.server] += static_cast<double>(t.pairs());
  return out;
}

// (R) the most pairs one query row of a task holds on each server (a cut's rounding).
std::vector<double> row_pairs(const std::vector<plan::Task>& tasks, int32_t num_ranks) {
  std::vector<double> out(static_cast<size_t>(num_ranks), 0.0);
  for (const plan::Task& t : tasks) out[t.server] = std::max(out[t.server], static_cast<double>(t.k1 - t.k0));
  return out;
}

// Q and K/V entries every rank sends to other ranks in the dispatch of these tasks (the return
// and the backward move the same entries back, or again), over every rank's exchange layout.
std::array<int64_t, 2> sent_entries(const plan::Batch& batch, const std::vector<plan::Task>& tasks) {
  std::array<int64_t, 2> sent{0, 0};
  for (int32_t r = 0; r < batch.num_ranks; ++r) {
    const ExchangeLayout x = exchange_layout(build_partial_route(batch, tasks, r).value());
    for (int32_t s = 0; s < batch.num_ranks; ++s) {
      if (s == r) continue;
      sent[0] += x.q_send_splits[s];
      sent[1] += x.kv_send_splits[s];
    }
  }
  return sent;
}

// Every causal pair of every document in exactly one task of the parts.
void expect_covered_once(const plan::Batch& batch, const TaskSplit& split, const std::string& what) {
  std::vector<plan::Task> all;
  for (const auto& part : split.parts) all.insert(all.end(), part.begin(), part.end());
  const Status st = plan::verify_tasks(batch, all);
  EXPECT_TRUE(st.is_ok()) << what << ": " << st.to_string();
}

// Both halves of every server within level + one row's pairs; together the plan's pairs.
void expect_within_level(const plan::Batch& batch, const std::vector<plan::Task>& tasks, const TaskSplit& split,
                         const std::string& what) {
  const int32_t R = batch.num_ranks;
  const std::vector<double> whole = server_pairs(tasks, R), slack = row_pairs(tasks, R);
  std::vector<double> sum(static_cast<size_t>(R), 0.0);
  for (const auto& part : split.parts) {
    const std::vector<double> half = server_pairs(part, R);
    for (int32_t s = 0; s < R; ++s) {
      EXPECT_LE(half[s], split.level + slack[s]) << what << ", server " << s;
      sum[s] += half[s];
    }
  }
  for (int32_t s = 0; s < R; ++s) EXPECT_DOUBLE_EQ(sum[s], whole[s]) << what << ", server " << s;
}

TEST(TaskSplit, SampledBatchesMoveAtMostTheBudgetAndKeepTheLevel) {
  struct Case {
    std::string what;
    plan::Batch batch;
  };
  std::vector<Case> cases;
  for (const char* workload : {"pretrain", "prolong"}) {
    for (const auto& [ranks, tokens] : {std::pair{4, 65536}, std::pair{8, 32768}, std::pair{16, 16384}}) {
      for (uint64_t seed : {1, 2}) {
        plan::SamplingOptions so;
        so.seed = seed;
        const plan::Batch b = plan::sample_batch(plan::builtin_distribution(workload).value(), so, ranks, tokens).value();
        cases.push_back({fmt::format("{}, {} ranks x {} tokens, seed {}", workload, ranks, tokens, seed), b});
      }
    }
  }
  int reached_cap = 0, with_cuts = 0;
  for (const Case& c : cases) {
    const plan::Plan whole = make_plan(c.batch, "minlink", 128).value();
    const TaskSplit split = split_attention_tasks(c.batch, whole.tasks, {.tolerance = whole.tolerance}).value();
    ASSERT_EQ(split.parts.size(), 2u) << c.what;
    expect_covered_once(c.batch, split, c.what);
    expect_within_level(c.batch, whole.tasks, split, c.what);
    const std::vector<double> pairs = server_pairs(whole.tasks, c.batch.num_ranks);
    EXPECT_DOUBLE_EQ(split.cap, (1 + whole.tolerance) * *std::max_element(pairs.begin(), pairs.end()) / 2) << c.what;
    EXPECT_GE(split.level, split.cap) << c.what;
    EXPECT_TRUE(split.level > split.cap || split.over.empty()) << c.what;
    // The bytes: Q entries never travel twice; the K/V rows the cuts send twice are within the
    // budget.
    EXPECT_LE(split.extra_kv_rows, kKvBudget * static_cast<double>(split.remote_kv_rows)) << c.what;
    const std::array<int64_t, 2> all = sent_entries(c.batch, whole.tasks);
    std::array<int64_t, 2> halves{0, 0};
    for (const auto& part : split.parts) {
      const std::array<int64_t, 2> h = sent_entries(c.batch, part);
      halves[0] += h[0], halves[1] += h[1];
    }
    EXPECT_EQ(all[1], split.remote_kv_rows) << c.what;
    EXPECT_LE(halves[0], all[0]) << c.what;
    EXPECT_LE(static_cast<double>(halves[1]), (1 + kKvBudget) * static_cast<double>(all[1])) << c.what;
    ASSERT_EQ(split.travel_rows.size(), 2u) << c.what;
    EXPECT_EQ(split.travel_rows[0][0] + split.travel_rows[1][0], halves[0]) << c.what;
    EXPECT_EQ(split.travel_rows[0][1] + split.travel_rows[1][1], halves[1]) << c.what;
    reached_cap += split.level == split.cap;
    with_cuts += split.num_cuts > 0;
    std::printf("%s: %lld cuts, K/V entries x%.4f, level %.3f x cap, %zu server(s) above cap\n", c.what.c_str(),
                static_cast<long long>(split.num_cuts), static_cast<double>(halves[1]) / std::max<int64_t>(all[1], 1),
                split.level / split.cap, split.over.size());
  }
  EXPECT_GE(reached_cap, static_cast<int>(cases.size()) / 4);
  EXPECT_GT(with_cuts, 0);
}

// The count can tell: with the whole K/V budget and no tolerance, some batch sends more twice.
TEST(TaskSplit, AWholeBudgetDuplicatesMore) {
  double most = 0;
  for (uint64_t seed : {1, 2, 3, 4}) {
    plan::SamplingOptions so;
    so.seed = seed;
    const plan::Batch b = plan::sample_batch(plan::builtin_distribution("prolong").value(), so, 4, 65536).value();
    const plan::Plan whole = make_plan(b, "minlink", 128).value();
    const TaskSplit split = split_attention_tasks(b, whole.tasks, {.tolerance = 0, .kv_budget = 1.0}).value();
    expect_covered_once(b, split, fmt::format("seed {}", seed));
    most = std::max(most, static_cast<double>(split.extra_kv_rows) / std::max<double>(1, static_cast<double>(split.remote_kv_rows)));
  }
  EXPECT_GT(most, kKvBudget);
}

TEST(TaskSplit, HandMadeBatchesComputeEveryPairOnceAndBalanceEveryServer) {
  const std::vector<std::pair<std::vector<std::vector<int64_t>>, std::string>> cases = {
      {{{2048, 64}, std::vector<int64_t>(8, 128)}, "minbytes"},
      {{{194, 90}, {284}}, "minbytes"},
      {{{1024, 512}, {64, 64, 64, 64}, {900}}, "minbytes"},
      {{{700, 40}, {64, 64, 64, 64}, {300}}, "distca"},
      {{{1500}, std::vector<int64_t>(20, 20), {300, 300}}, "minlink"}};
  for (const auto& [ranks, policy] : cases) {
    const plan::Batch b = plan::batch_from_ranks(ranks, 0).value();
    const plan::Plan whole = make_plan(b, policy).value();
    const std::string what = fmt::format("{} on {} ranks", policy, b.num_ranks);
    const TaskSplit split = split_attention_tasks(b, whole.tasks, {.tolerance = whole.tolerance}).value();
    ASSERT_EQ(split.parts.size(), 2u) << what;
    expect_covered_once(b, split, what);
    expect_within_level(b, whole.tasks, split, what);
    for (const auto& part : split.parts) {  // plan order
      EXPECT_TRUE(std::is_sorted(part.begin(), part.end(), [](const plan::Task& x, const plan::Task& y) {
        return std::tie(x.server, x.doc, x.q0, x.k0) < std::tie(y.server, y.doc, y.q0, y.k0);
      })) << what;
    }
  }
}

// Rank 0's long document is served partly by rank 1 (keys travel); each server's largest task
// reads keys it holds, so cutting it duplicates nothing that travels: both reach the band.
TEST(TaskSplit, CutsOfKeysAServerHoldsAreFree) {
  const plan::Batch b = plan::batch_from_ranks({{3000, 1000}, {2000, 2000}}, 0).value();
  const plan::Plan whole = make_plan(b, "minlink").value();
  const TaskSplit split = split_attention_tasks(b, whole.tasks, {.tolerance = whole.tolerance}).value();
  EXPECT_GT(split.remote_kv_rows, 0);
  EXPECT_GE(split.num_cuts, 1);
  EXPECT_EQ(split.extra_kv_rows, 0);
  EXPECT_EQ(split.level, split.cap);
  EXPECT_TRUE(split.over.empty());
  expect_covered_once(b, split, "free cuts");
}

// The demo's skew: rank 1 serves the end of rank 0's 6144-token document (its keys travel)
// beside its own short documents; halving that task would send most of those rows twice, so the
// split stays within the budget and reports the server above cap, unless the budget is whole.
TEST(TaskSplit, TheBudgetHoldsWhereBalanceWouldCostMore) {
  const plan::Batch b = plan::batch_from_ranks({{6144}, std::vector<int64_t>(16, 384)}, 0).value();
  const plan::Plan whole = make_plan(b, "minlink").value();
  const TaskSplit split = split_attention_tasks(b, whole.tasks, {.tolerance = whole.tolerance}).value();
  EXPECT_LE(split.extra_kv_rows, kKvBudget * static_cast<double>(split.remote_kv_rows));
  EXPECT_GT(split.level, split.cap);
  EXPECT_NE(std::find(split.over.begin(), split.over.end(), 1), split.over.end());
  expect_covered_once(b, split, "budget");
  const TaskSplit generous =
      split_attention_tasks(b, whole.tasks, {.tolerance = whole.tolerance, .kv_budget = 1.0}).value();
  EXPECT_EQ(generous.level, generous.cap);
  EXPECT_GT(static_cast<double>(generous.extra_kv_rows), 0.5 * static_cast<double>(generous.remote_kv_rows));
}

TEST(TaskSplit, ABudgetOfZeroCutsOnlyForFreeAndOneTaskIsNotSplit) {
  const plan::Batch b = plan::batch_from_ranks({{4096}, {4096}}, 0).value();
  const plan::Plan whole = make_plan(b, "minlink").value();
  const TaskSplit split = split_attention_tasks(b, whole.tasks, {.kv_budget = 0}).value();
  EXPECT_EQ(split.extra_kv_rows, 0);
  expect_covered_once(b, split, "zero budget");
  const plan::Batch one = plan::batch_from_ranks({{64}}, 0).value();
  const plan::Plan p = make_plan(one, "minlink").value();
  const TaskSplit single = split_attention_tasks(one, p.tasks).value();
  ASSERT_EQ(single.parts.size(), 1u);
  EXPECT_EQ(single.parts[0], p.tasks);
  EXPECT_TRUE(single.travel_rows.empty());
}

TEST(TaskSplit, BadInputIsNamed) {
  const plan::Batch b = plan::batch_from_ranks({{700, 40}, {64, 64}}, 0).value();
  const plan::Plan whole = make_plan(b, "minlink").value();
  auto message = [&](std::vector<plan::Task> tasks, TaskSplitOptions options) {
    const Result<TaskSplit> r = split_attention_tasks(b, tasks, options);
    EXPECT_FALSE(r.is_ok());
    return r.is_ok() ? std::string() : r.status().message();
  };
  EXPECT_NE(message(whole.tasks, {.tolerance = 2}).find("tolerance must be in [0, 1]"), std::string::npos);
  EXPECT_NE(message(whole.tasks, {.kv_budget = -0.1}).find("kv_budget must be in [0, 1]"), std::string::npos);
  std::vector<plan::Task> bad = whole.tasks;
  bad.back().server = 2;
  EXPECT_NE(message(bad, {}).find(fmt::format("tasks[{}]: server 2 outside [0, 2) (the batch's 2 ranks)", bad.size() - 1)),
            std::string::npos);
  EXPECT_NE(message({{0, 5, 2, 0, 2, 0}}, {}).find("tasks[0]: need 0 <= doc < 4 (the batch's documents)"),
            std::string::npos);
  EXPECT_NE(message({{0, 0, 900, 0, 900, 0}}, {}).find("tasks[0]: rows past the end of document 0 (700 tokens)"),
            std::string::npos);
}

}  // namespace
}  // namespace distca::layout
