// Plans for the layout and runtime tests.
#pragma once

#include <cstdint>
#include <string>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/model_shape.h"
#include "distca/plan/plan.h"
#include "distca/plan/planner.h"

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

}  // namespace distca::layout::testing
