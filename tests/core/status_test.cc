#include "distca/core/status.h"

#include <gtest/gtest.h>

namespace distca {
namespace {

Result<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("not positive");
  return v;
}

Result<int> doubled(int v) {
  DISTCA_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}

Status check_positive(int v) {
  DISTCA_RETURN_IF_ERROR(parse_positive(v).status());
  return Status::ok();
}

TEST(Status, OkAndErrorsCarryCodeAndMessage) {
  EXPECT_TRUE(Status::ok().is_ok());
  EXPECT_EQ(Status::ok().to_string(), "ok");
  Status s = infeasible("budget too small");
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInfeasible);
  EXPECT_EQ(s.to_string(), "infeasible: budget too small");
}

TEST(Result, AssignOrReturnPropagatesErrors) {
  EXPECT_EQ(doubled(4).value(), 8);
  EXPECT_FALSE(doubled(-1).is_ok());
  EXPECT_EQ(doubled(-1).status().message(), "not positive");
  EXPECT_TRUE(check_positive(3).is_ok());
  EXPECT_EQ(check_positive(0).code(), StatusCode::kInvalidArgument);
}

TEST(ResultDeathTest, ValueOfFailedResultAborts) {
  EXPECT_DEATH((void)parse_positive(0).value(), "value\\(\\) of a failed Result: invalid argument");
}

TEST(CheckDeathTest, FailedCheckNamesFileLineAndMessage) {
  EXPECT_DEATH(DISTCA_CHECK(1 + 1 == 3) << "arithmetic is broken", "status_test.cc:[0-9]+: check failed: 1 \\+ 1 == 3: arithmetic is broken");
}

}  // namespace
}  // namespace distca
