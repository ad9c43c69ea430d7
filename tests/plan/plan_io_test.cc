#include "distca/plan/plan_io.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "distca/core/file.h"
#include "distca/core/json.h"

#include "distca/plan/planner.h"
#include "test_util.h"

namespace distca::plan {
namespace {

struct Fixture {
  Batch batch = pack_documents({900, 40, 3000, 17}, 4, 1024).value();
  CostModel cost = testing::tiny_cost();
  Plan plan = plan_minmax(batch, cost, PlannerOptions{0.05, 128, 0}).value();
};

TEST(PlanIo, RoundTripKeepsTasksAndHash) {
  Fixture f;
  const nlohmann::json j = plan_to_json(f.plan, f.batch, f.cost);
  EXPECT_EQ(j["format"], "distca-plan");
  EXPECT_EQ(j["version"], 1);
  LoadedPlan back = plan_from_json(nlohmann::json::parse(j.dump())).value();
  EXPECT_EQ(back.plan.tasks, f.plan.tasks);
  EXPECT_EQ(back.plan.hash, f.plan.hash);
  EXPECT_EQ(back.batch.doc_lengths, f.batch.doc_lengths);
  EXPECT_EQ(back.plan.traffic.forward.total_bytes, f.plan.traffic.forward.total_bytes);
}

// `distca plan --out` writes the file without holding its flows as JSON values: the same bytes as
// plan_to_json's dump, flows included (the fixture's plan moves rows in every phase).
TEST(PlanIo, FileTextIsTheJsonDumpByteForByte) {
  Fixture f;
  const nlohmann::json j = plan_to_json(f.plan, f.batch, f.cost);
  for (const auto& [phase, flows] : j["flows_per_layer"].items()) EXPECT_FALSE(flows.empty()) << phase;
  EXPECT_EQ(plan_file_text(f.plan, f.batch, f.cost), j.dump() + "\n");
  EXPECT_EQ(plan_from_text(plan_file_text(f.plan, f.batch, f.cost), "plan").value().plan.hash, f.plan.hash);
}

// The file names the return its bytes were counted at; a file without it (written before the
// option) counts fp32, and a value other than bf16 or fp32 is refused.
TEST(PlanIo, GradReturnRoundTripsAndDefaultsToFp32) {
  Fixture f;
  ModelShape m = f.cost.model();
  m.grad_return = GradReturn::kBf16;
  const CostModel bf16_cost(m, f.cost.profile());
  const Plan bf16_plan = finalize_plan(f.plan.policy, f.plan.tolerance, f.batch, bf16_cost, f.plan.tasks);
  ASSERT_LT(bf16_plan.traffic.phases[3].total_bytes, f.plan.traffic.phases[3].total_bytes);
  nlohmann::json j = plan_to_json(bf16_plan, f.batch, bf16_cost);
  EXPECT_EQ(j["model"]["grad_return"], "bf16");
  LoadedPlan back = plan_from_json(nlohmann::json::parse(j.dump())).value();
  EXPECT_EQ(back.model.grad_return, GradReturn::kBf16);
  EXPECT_EQ(back.plan.traffic.phases[3].total_bytes, bf16_plan.traffic.phases[3].total_bytes);
  nlohmann::json old = plan_to_json(f.plan, f.batch, f.cost);
  old["model"].erase("grad_return");
  EXPECT_EQ(plan_from_json(old).value().model.grad_return, GradReturn::kFp32);
  j["model"]["grad_return"] = "fp16";
  EXPECT_NE(plan_from_json(j).status().message().find("model.grad_return must be \"bf16\" or \"fp32\""),
            std::string::npos)
      << plan_from_json(j).status().message();
}

TEST(PlanIo, RefusesOtherFormatsVersionsAndEditedFiles) {
  Fixture f;
  nlohmann::json j = plan_to_json(f.plan, f.batch, f.cost);
  nlohmann::json wrong = j;
  wrong["version"] = 99;
  EXPECT_NE(plan_from_json(wrong).status().message().find("regenerate"), std::string::npos);
  wrong = j;
  wrong["format"] = "something-else";
  EXPECT_FALSE(plan_from_json(wrong).is_ok());
  wrong = j;
  wrong["tasks"].erase(0);  // a dropped task no longer covers its document
  EXPECT_FALSE(plan_from_json(wrong).is_ok());
  wrong = j;
  wrong["hash"] = "0000000000000000";
  EXPECT_NE(plan_from_json(wrong).status().message().find("hash"), std::string::npos);
  wrong = j;
  wrong["tasks"][0] = "garbage";
  EXPECT_FALSE(plan_from_json(wrong).is_ok());
}

TEST(PlanIo, ReportHasTheDocumentedFields) {
  Fixture f;
  Plan none = plan_none(f.batch, f.cost, PlannerOptions{}).value();
  const nlohmann::json r = plan_report_json(none, f.plan, f.batch, f.cost, 1.5, true);
  for (const char* key : {"policy", "ranks", "tokens_per_rank", "tolerance", "tasks", "plan_ms", "verified",
                          "load_before", "load_after", "comm"}) {
    EXPECT_TRUE(r.contains(key)) << key;
  }
  for (const char* key : {"max", "mean", "imbalance", "pairs_imbalance"}) EXPECT_TRUE(r["load_after"].contains(key));
  for (const char* key : {"total_bytes", "max_send_bytes", "max_recv_bytes", "q_bytes", "kv_bytes", "out_bytes"}) {
    EXPECT_TRUE(r["comm"].contains(key)) << key;
  }
  EXPECT_EQ(r["comm"]["total_bytes"].get<int64_t>(),
            r["comm"]["q_bytes"].get<int64_t>() + r["comm"]["kv_bytes"].get<int64_t>() +
                r["comm"]["out_bytes"].get<int64_t>());
}

// The inputs fuzzing found (tests/fuzz/crashes/plan: sums of causal pairs and of bytes that
// overflowed 64 bits under UBSan) are refused with a message, in this build too.
TEST(PlanIo, InputsThatOnceOverflowedAreRefused) {
  const std::filesystem::path dir = std::filesystem::path(__FILE__).parent_path() / "../fuzz/crashes/plan";
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    const std::string text = read_text_file(entry.path().string()).value();
    Result<nlohmann::json> j = parse_json(text, entry.path().string());
    ASSERT_TRUE(j.is_ok()) << j.status().message();
    Result<LoadedPlan> loaded = plan_from_json(j.value());
    ASSERT_FALSE(loaded.is_ok()) << entry.path();
    EXPECT_LT(loaded.status().message().size(), 400u) << loaded.status().message();
  }
  EXPECT_GE(seen, 2);
}

}  // namespace
}  // namespace distca::plan
