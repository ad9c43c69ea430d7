// CudaServerKernel: the attention server's compute on a GPU (kernels::CudaAttention) behind the
// runtime's ServerKernel, whose buffers are host fp32 (the Dispatcher's server layout). The kernel
// is one of the kernel registry's CUDA entries (kernels/registry.h: distca's sm_80 kernels, its
// sm_90a ones, or cuDNN's fused attention): the staging below is the same for all.
//
// Each call stages its inputs: host fp32 -> device fp32 (cudaMemcpyAsync) -> the storage dtype
// (bf16 or fp16, kernels::cuda_convert_from_f32); runs the kernel; and brings the outputs back:
// O and dQ through the storage dtype (rounded once, as the kernel writes them), LSE and dK/dV in
// fp32 (dK/dV as the kernel's fp32 sums, dkv_fp32). So results match the CPU kernel to the
// storage dtype's precision, not bit for bit. Every output element is written, as attention.h
// requires (the CUDA kernels cover rows no task reads).
//
// Device buffers grow to the largest call seen and are reused: a call no larger than an earlier
// one allocates nothing (the kernels' per-call scratch comes from CUDA's stream-ordered pool).
// All work runs on a private stream; a call returns when its outputs are on the host.
//
// Each call asks the registry first (kernels::supports: the head dim, the task list) and refuses
// what the kernel cannot run before anything is copied.
// Built when CMake finds nvcc (DISTCA_HAVE_CUDA). Thread safety: one call at a time per object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "distca/core/status.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/registry.h"
#include "distca/runtime/dispatcher.h"

namespace distca::runtime {

class CudaServerKernel final : public ServerKernel {
 public:
  // On `device` (-1: the current one), storing Q/K/V/O/dO/dQ as `dtype`, running `kernel`. Fails
  // with a Status (never a crash) when there is no CUDA device, no such device, or the build lacks
  // the kernel.
  static Result<std::unique_ptr<CudaServerKernel>> create(int device = -1,
                                                          kernels::CudaDType dtype = kernels::CudaDType::kBf16,
                                                          kernels::CudaKernel kernel = kernels::CudaKernel::kDistca);
  ~CudaServerKernel() override;
  CudaServerKernel(const CudaServerKernel&) = delete;
  CudaServerKernel& operator=(const CudaServerKernel&) = delete;

  Status forward(const kernels::AttnFwdParams<float>& p) override;
  Status backward(const kernels::AttnBwdParams<float>& p) override;
  Status supports(const kernels::AttnDims& dims) const override;  // the registry's, in the storage dtype

  int device() const;
  std::string device_name() const;  // e.g. "NVIDIA H100 80GB HBM3 (sm_90)"
  kernels::CudaDType dtype() const;
  kernels::CudaKernel kernel() const;
  const kernels::KernelInfo& info() const;  // the kernel's registry entry
  int64_t device_bytes() const;     // device memory held by the staging buffers

 private:
  struct State;
  explicit CudaServerKernel(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace distca::runtime
