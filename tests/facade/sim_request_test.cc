// What `distca simulate` and distca.simulate share (facade/sim_request.h): the request's
// defaults and checks, the same for the command line and the Python package.
#include <gtest/gtest.h>

#include "distca/facade/sim_request.h"

namespace distca::facade {
namespace {

// The dK/dV return is bf16 unless told (the modelled training is bf16), and anything but bf16 or
// fp32 is refused naming the flag.
TEST(SimRequest, GradReturnIsBf16UnlessToldAndCheckedByName) {
  SimRequest request;
  EXPECT_EQ(request.options().value().model.grad_return, plan::GradReturn::kBf16);
  request.grad_return = "fp32";
  EXPECT_EQ(request.options().value().model.grad_return, plan::GradReturn::kFp32);
  request.grad_return = "fp16";
  EXPECT_NE(request.validate().message().find("--grad-return must be bf16 or fp32"), std::string::npos)
      << request.validate().message();
}

}  // namespace
}  // namespace distca::facade
