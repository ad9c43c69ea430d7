// Plan files and reports as JSON. A plan file starts with {"format": "distca-plan",
// "version": 1}; a reader refuses other formats and versions with a message saying how to
// regenerate.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <string_view>

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
// What `distca plan --out` writes: plan_to_json(...).dump() + "\n", byte for byte, passed to
// `write` in pieces of about 1 MiB, holding one phase's flows at a time and none as JSON values
// (where documents span many ranks they number up to R^2, and as JSON values they take several
// times their text's memory). A failed write ends it with that error.
Status write_plan_text(const Plan& plan, const Batch& batch, const CostModel& cost,
                       const std::function<Status(std::string_view)>& write);
// The same text whole.
std::string plan_file_text(const Plan& plan, const Batch& batch, const CostModel& cost);

struct LoadedPlan {
  Batch batch;
  ModelShape model;
  Plan plan;
};
// Reads a plan file back. Refused (kInvalidArgument, one line naming the field, e.g.
// "plan file: batch.pieces[3][1] must be an integer in [0, 2147483647], got -1", quoting at most
// kMaxQuoted characters of the value): another format or version; a missing or unknown key at any
// level; a value of the wrong type or out of range (policy: a planner's name; tolerance in [0, 1],
// as `distca plan` takes it; model shapes within `distca plan`'s bounds; 1 to 2^20 ranks; token
// counts and positions within kMaxTokens; documents and servers of tasks and pieces within the
// batch); a batch whose pieces do not tile its documents or overfill a rank; tasks that fail
// verify_tasks; a hash that is not the tasks'; server_seconds or flows_per_layer other than what
// the tasks give on the file's model and profile.
Result<LoadedPlan> plan_from_json(const nlohmann::json& json);
// The same from the file's text, parsed with parse_json (depth, number overflow and syntax
// errors start with `origin`).
Result<LoadedPlan> plan_from_text(std::string_view text, std::string_view origin);

}  // namespace distca::plan
