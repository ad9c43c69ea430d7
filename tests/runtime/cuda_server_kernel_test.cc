// CudaServerKernel where it cannot run: create() returns a Status that says why (never a crash).
// And the check the GPU tests make (cuda_harness.h), run here with CPU kernels in place of the
// GPU's: it accepts a kernel of bf16 precision and rejects wrong ones. Runs on any machine; the
// checks that need a GPU are in cuda_server_kernel_gpu_test.cc.
#include <gtest/gtest.h>

#include <cmath>

#include "../comm/cuda_device.h"
#include "cuda_harness.h"
#include "distca/comm/local_comm.h"
#include "distca/runtime/cuda_server_kernel.h"

namespace distca::runtime {
namespace {

TEST(CudaServerKernel, CreateWithoutCudaDeviceFailsWithTheReason) {
  if (::distca::testing::cuda_device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device (the GPU tests create the kernel)";
  for (kernels::CudaDType dtype : {kernels::CudaDType::kBf16, kernels::CudaDType::kFp16}) {
    auto kernel = CudaServerKernel::create(-1, dtype);
    ASSERT_FALSE(kernel.is_ok());
    EXPECT_NE(kernel.status().message().find("CudaServerKernel: no CUDA device"), std::string::npos)
        << kernel.status().to_string();
  }
}

TEST(CudaServerKernel, CreateOnADeviceThatDoesNotExistFails) {
  auto kernel = CudaServerKernel::create(1000);
  ASSERT_FALSE(kernel.is_ok());
  const std::string& m = kernel.status().message();
  EXPECT_TRUE(m.find("no CUDA device") != std::string::npos || m.find("CUDA device 1000 does not exist") != std::string::npos)
      << m;
}

// Stand-ins for the GPU kernel: the fp32 CPU kernel with a softmax scale 2% off, and one that
// leaves the last row of dK unwritten.
class WrongScaleKernel final : public ServerKernel {
 public:
  Status forward(const kernels::AttnFwdParams<float>& p) override {
    kernels::AttnFwdParams<float> q = p;
    q.scale = 1.02f * kernels::softmax_scale(p.dims, p.scale);
    return cpu_.forward(q);
  }
  Status backward(const kernels::AttnBwdParams<float>& p) override { return cpu_.backward(p); }

 private:
  kernels::CpuAttention cpu_{kernels::CpuAttentionOptions{.num_threads = 1}};
};

class UnwrittenRowKernel final : public ServerKernel {
 public:
  Status forward(const kernels::AttnFwdParams<float>& p) override { return cpu_.forward(p); }
  Status backward(const kernels::AttnBwdParams<float>& p) override {
    DISTCA_RETURN_IF_ERROR(cpu_.backward(p));
    const int64_t row = p.dims.num_kv_heads * p.dims.head_dim;
    std::fill(p.dk + (p.dims.num_kv_rows - 1) * row, p.dk + p.dims.num_kv_rows * row, NAN);
    return Status::ok();
  }

 private:
  kernels::CpuAttention cpu_{kernels::CpuAttentionOptions{.num_threads = 1}};
};

Status check_with(ServerKernel& kernel, int R) {
  auto batch = plan::pack_documents({300, 1, 17, 90, 2, 500, 33, 1, 64, 250}, R, 1260 / R);
  if (!batch.is_ok()) return batch.status();
  auto plan = testing::make_plan(batch.value(), "minmax");
  if (!plan.is_ok()) return plan.status();
  std::vector<Status> statuses = comm::LocalWorld::run(R, [&](comm::Communicator& comm) {
    return testing::check_kernel_against_cpu(comm, batch.value(), plan.value(), plan::BackwardMode::kStateless, kernel, 3);
  });
  for (const Status& st : statuses) DISTCA_RETURN_IF_ERROR(st);
  return Status::ok();
}

TEST(CudaHarness, AcceptsAKernelOfBf16Precision) {
  testing::Bf16CpuKernel bf16_kernel;
  const Status st = check_with(bf16_kernel, 1);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(CudaHarness, RejectsAWrongSoftmaxScale) {
  WrongScaleKernel kernel;
  const Status st = check_with(kernel, 1);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("O differs"), std::string::npos) << st.to_string();
}

TEST(CudaHarness, RejectsAnUnwrittenOutputRow) {
  UnwrittenRowKernel kernel;
  const Status st = check_with(kernel, 1);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("dK differs"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace distca::runtime
