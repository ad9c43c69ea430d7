// Plans and batches for the layout and runtime tests.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/model_shape.h"
#include "distca/plan/plan.h"
#include "distca/plan/planner.h"
#include "distca/plan/workload.h"

namespace distca::layout::testing {

// A plan of `policy` for the batch (small granularity, so small documents are cut too).
inline Result<plan::Plan> make_plan(const plan::Batch& batch, const std::string& policy, int64_t granularity = 16) {
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn fn, plan::find_planner(policy));
  DISTCA_ASSIGN_OR_RETURN(plan::ModelShape model, plan::model_preset("llama-8b"));
  const plan::CostModel cost(model, plan::ThroughputProfile{});
  plan::PlannerOptions options;
  options.granularity = granularity;
  options.tolerance = 0.05;
  return fn(batch, cost, options);
}

// Named batches: one packed by hand (short and long documents on 3 ranks) and one sampled from
// `workload` for each of `ranks`, `tokens` per rank.
inline std::vector<std::pair<std::string, plan::Batch>> mixed_and_sampled(const char* workload,
                                                                        const std::vector<int>& ranks, int64_t tokens) {
  std::vector<std::pair<std::string, plan::Batch>> out;
  out.emplace_back("mixed, 3 ranks", plan::pack_documents({500, 20, 300, 1, 77, 260, 90, 9, 400, 33}, 3, 560).value());
  for (int r : ranks) {
    plan::SamplingOptions so;
    so.seed = static_cast<uint64_t>(r);
    out.emplace_back(fmt::format("{}, {} ranks", workload, r),
                     plan::sample_batch(plan::builtin_distribution(workload).value(), so, r, tokens).value());
  }
  return out;
}

}  // namespace distca::layout::testing
