// What `distca plan` and distca.plan share (facade/plan_request.h): the request's defaults and
// checks, the same for the command line and the Python package.
#include <gtest/gtest.h>

#include "distca/facade/plan_request.h"
#include "distca/plan/workload.h"
#include "distca/sim/profile.h"

namespace distca::facade {
namespace {

// `distca plan` and distca.plan: auto unless a number is given; none has nothing to pick.
TEST(PlanRequest, ToleranceIsAutoUnlessANumberIsGiven) {
  const sim::Profile profile = sim::default_h200_profile();
  const plan::Batch batch =
      plan::sample_batch(plan::builtin_distribution("prolong").value(), plan::SamplingOptions{}, 16, 131072).value();
  PlanRequest request;
  EXPECT_FALSE(request.tolerance.has_value());
  request.policy = "all";
  const PlanRun run = run_plan_request(request, batch, profile).value();
  for (const PolicyRun& r : run.runs) {
    SCOPED_TRACE(r.plan.policy);
    EXPECT_EQ(r.auto_tolerance.has_value(), r.plan.policy != "none");
    if (r.auto_tolerance) {
      EXPECT_EQ(r.plan.tolerance, r.auto_tolerance->tolerance);
    }
  }
  request.tolerance = 0.1;
  for (const PolicyRun& r : run_plan_request(request, batch, profile).value().runs) {
    EXPECT_FALSE(r.auto_tolerance.has_value());
    EXPECT_EQ(r.plan.tolerance, 0.1);
  }
  EXPECT_FALSE(parse_tolerance("auto").value().has_value());
  EXPECT_EQ(parse_tolerance("0.25").value(), 0.25);
  for (const char* bad : {"", "fast", "0.1x", "nan", "inf"}) EXPECT_FALSE(parse_tolerance(bad).is_ok()) << bad;
  request.tolerance = 1.5;
  EXPECT_FALSE(request.validate().is_ok());
}

}  // namespace
}  // namespace distca::facade
