// The per-server memory of a plan (Plan::server_bytes) and the cap distca's planners keep on it
// (PlannerOptions::max_server_bytes, src/plan/memory_cap.h).
#include <gtest/gtest.h>

#include <algorithm>

#include "distca/plan/planner.h"
#include "distca/plan/workload.h"
#include "memory_cap.h"
#include "test_util.h"

namespace distca::plan {
namespace {

using testing::tiny_cost;

int64_t fullest(const Plan& p) { return *std::max_element(p.server_bytes.begin(), p.server_bytes.end()); }

TEST(ServerBytes, CountsEveryTasksQueryRowsAndTheUnionOfItsKeysPerDocument) {
  // tiny_model: a query row holds Q 16 + O/LSE 24 bytes, a key row K/V 16.
  const TokenBytes tb = tiny_cost().token_bytes();
  ASSERT_EQ(tb.q + tb.out, 40);
  ASSERT_EQ(tb.kv, 16);
  const std::vector<Task> tasks = {
      {0, 0, 8, 0, 8, 0},    // server 0: rows 0..8, keys 0..8
      {0, 8, 12, 0, 4, 1},   // server 1: a block, rows 8..12 x keys 0..4
      {0, 8, 12, 4, 12, 1},  // server 1: the same rows, keys 4..12 (the union: 0..12, the rows twice)
      {1, 0, 4, 0, 4, 1},    // server 1: another document's keys count apart
      {0, 12, 16, 10, 16, 0},  // server 0: keys 10..16 beside 0..8: a gap, 8 + 6 keys
  };
  const std::vector<int64_t> bytes = server_bytes(tb, tasks, 3);
  EXPECT_EQ(bytes[0], (8 + 4) * 40 + (8 + 6) * 16);
  EXPECT_EQ(bytes[1], (4 + 4 + 4) * 40 + (12 + 4) * 16);
  EXPECT_EQ(bytes[2], 0);
}

struct Case {
  const char* workload;
  uint64_t seed;
};

Batch sampled(const Case& c, int ranks = 8) {
  SamplingOptions so;
  so.seed = c.seed;
  return sample_batch(builtin_distribution(c.workload).value(), so, ranks, 131072).value();
}

const CostModel& llama() {
  static const CostModel cost(model_preset("llama-8b").value(), ThroughputProfile{});
  return cost;
}

TEST(MemoryCap, AnExplicitCapIsKeptByEveryServerOfDistcasPlanners) {
  int capped = 0;
  for (const Case& c : {Case{"prolong", 2}, Case{"pretrain", 2}, Case{"prolong", 1}}) {
    const Batch b = sampled(c);
    for (PlanFn fn : {plan_minmax, plan_minbytes, plan_minlink}) {
      SCOPED_TRACE(std::string(c.workload) + " " + std::to_string(c.seed) + " " + std::string(planner_name(fn)));
      PlannerOptions o{0.05, 128, 0};
      o.max_server_bytes = 0;
      const Plan free = fn(b, llama(), o).value();
      // Halfway between colocated's fullest and the free plan's: some moves must go elsewhere.
      const int64_t colocated = colocated_server_bytes(b, llama());
      ASSERT_GT(fullest(free), colocated);
      o.max_server_bytes = colocated + (fullest(free) - colocated) / 2;
      const Plan p = fn(b, llama(), o).value();
      EXPECT_EQ(p.memory_cap, o.max_server_bytes);
      EXPECT_TRUE(p.is_within_memory) << p.note;
      EXPECT_LE(fullest(p), o.max_server_bytes) << p.note;
      capped += p.hash != free.hash;
    }
  }
  EXPECT_GT(capped, 0);
}

TEST(MemoryCap, AutoKeepsTheFreePlanWhereItIsWithinAndLowersTheFullestWhereItBindsAtLittleLinkCost) {
  constexpr int kStateful = static_cast<int>(BackwardMode::kStateful);
  int unchanged = 0, lowered = 0;
  for (const Case& c : {Case{"prolong", 0}, Case{"prolong", 1}, Case{"prolong", 2}, Case{"pretrain", 1}, Case{"pretrain", 2}}) {
    const Batch b = sampled(c);
    const int64_t colocated = colocated_server_bytes(b, llama());
    for (PlanFn fn : {plan_minmax, plan_minbytes, plan_minlink}) {
      SCOPED_TRACE(std::string(c.workload) + " " + std::to_string(c.seed) + " " + std::string(planner_name(fn)));
      PlannerOptions o{0.05, 128, 0};
      ASSERT_EQ(o.max_server_bytes, PlannerOptions::kAutoServerBytes);  // the default
      const Plan p = fn(b, llama(), o).value();
      o.max_server_bytes = 0;
      const Plan free = fn(b, llama(), o).value();
      if (p.hash == free.hash) {
        ++unchanged;
        EXPECT_EQ(p.memory_cap, static_cast<int64_t>(1.05 * static_cast<double>(colocated)));
        EXPECT_EQ(p.is_within_memory, fullest(free) <= p.memory_cap);
        continue;
      }
      ++lowered;
      EXPECT_TRUE(p.is_balanced && p.is_within_memory) << p.note;
      EXPECT_LT(fullest(p), fullest(free));
      EXPECT_LE(fullest(p), p.memory_cap);
      EXPECT_LE(p.traffic.links[kStateful].step, 1.05 * static_cast<double>(free.traffic.links[kStateful].step));
      EXPECT_NE(p.note.find("memory capped at"), std::string::npos) << p.note;
    }
  }
  EXPECT_GT(unchanged, 0);
  EXPECT_GT(lowered, 0);
}

TEST(MemoryCap, ThePapersPlannerAndColocatedIgnoreIt) {
  const Batch b = sampled({"prolong", 2});
  for (PlanFn fn : {plan_none, plan_distca}) {
    PlannerOptions o{0.05, 128, 0};
    const uint64_t auto_hash = fn(b, llama(), o).value().hash;
    o.max_server_bytes = 1;
    EXPECT_EQ(fn(b, llama(), o).value().hash, auto_hash);
  }
}

TEST(MemoryCap, ABadCapIsRefused) {
  const Batch b = sampled({"prolong", 0});
  PlannerOptions o;
  o.max_server_bytes = -2;
  for (PlanFn fn : {plan_minmax, plan_minbytes, plan_minlink}) {
    const Result<Plan> p = fn(b, llama(), o);
    ASSERT_FALSE(p.is_ok());
    EXPECT_NE(p.status().message().find("max server bytes"), std::string::npos) << p.status().message();
  }
}

}  // namespace
}  // namespace distca::plan
