// Plan files and reports as JSON. A plan file starts with {"format": "distca-plan",
// "version": 1}; a reader refuses other formats and versions with a message saying how to
// regenerate.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/plan.h"

namespace distca::plan {

inline constexpr const char* kPlanFormat = "distca-plan";
inline constexpr int kPlanVersion = 1;

// The report of `distca plan --json`: policy, sizes, load_before/after, comm (forward, one
// layer), plan_ms, verified, hash.
nlohmann::json plan_report_json(const Plan& before, const Plan& after, const Batch& batch,
                                const CostModel& cost, double plan_ms, bool verified);

// The whole plan: batch layout, model, tasks, loads, per-phase flows.
nlohmann::json plan_to_json(const Plan& plan, const Batch& batch, const CostModel& cost);

struct LoadedPlan {
  Batch batch;
  ModelShape model;
  Plan plan;
};
// Reads a plan file back, re-verifies its tasks and re-checks its hash.
Result<LoadedPlan> plan_from_json(const nlohmann::json& json);

}  // namespace distca::plan
