// The CUDA kernels' host-side checks (src/kernels/cuda/common/checks.cc), in every build: what
// they refuse, before any launch, and that creating a CudaAttention without a GPU says why.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "distca/kernels/cuda.h"

namespace distca::kernels {
namespace {

TEST(CudaChecks, RefuseWhatTheKernelsCannotRunBeforeAnyLaunch) {
  alignas(16) static uint16_t buffer[64 * 4 * 128];
  const AttnTask task{0, 8, 0, 8, true};
  CudaFwdArgs a;
  a.dims = {8, 8, 2, 1, 128};
  a.q = a.k = a.v = buffer;
  a.o = buffer;
  static float lse[64];
  a.lse = lse;
  a.tasks = std::span<const AttnTask>(&task, 1);
  EXPECT_TRUE(validate(a).is_ok()) << validate(a).to_string();

  CudaFwdArgs bad_dim = a;
  bad_dim.dims.head_dim = 96;
  EXPECT_NE(validate(bad_dim).message().find("head dims 64 and 128"), std::string::npos);
  CudaFwdArgs misaligned = a;
  misaligned.k = buffer + 1;
  EXPECT_NE(validate(misaligned).message().find("k must be 16-byte aligned"), std::string::npos);
  CudaFwdArgs null_out = a;
  null_out.o = nullptr;
  EXPECT_FALSE(validate(null_out).is_ok());
  const AttnTask wide{0, 8, 0, 4, true};  // causal with more queries than keys
  CudaFwdArgs bad_task = a;
  bad_task.tasks = std::span<const AttnTask>(&wide, 1);
  EXPECT_NE(validate(bad_task).message().find("q_len <= kv_len"), std::string::npos);

  CudaBwdArgs b;
  b.dims = a.dims;
  b.q = b.k = b.v = b.o = b.d_o = buffer;
  b.lse = lse;
  b.tasks = a.tasks;
  b.dq = b.dk = b.dv = buffer;
  EXPECT_TRUE(validate(b).is_ok()) << validate(b).to_string();
  b.dv = nullptr;
  EXPECT_FALSE(validate(b).is_ok());
}

TEST(CudaChecks, CreateSaysWhyWithoutAGpuInsteadOfCrashing) {
  Result<std::unique_ptr<CudaAttention>> attn = CudaAttention::create();
  if (attn.is_ok()) GTEST_SKIP() << "this machine has a GPU: " << attn.value()->device_name();
  EXPECT_FALSE(attn.status().message().empty());
  if (cuda_kernels_built()) {
    EXPECT_NE(attn.status().message().find("no CUDA device"), std::string::npos) << attn.status().to_string();
  }
}

}  // namespace
}  // namespace distca::kernels
