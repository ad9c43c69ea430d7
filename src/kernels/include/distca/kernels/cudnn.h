// CudnnAttention: core attention over a CA-task list through cuDNN's fused attention (the kernel
// under TransformerEngine's packed THD attention), via cudnn-frontend's C++ graph API.
//
// The same contract as CudaAttention (cuda.h): CudaFwdArgs / CudaBwdArgs, packed THD, bottom-right
// causal and non-causal tasks, tasks sharing K/V rows, GQA, the dtypes and head dims of the
// registry's CUDA entries (registry.h), LSE out, and a backward that takes the merged O and LSE of
// key-split rows; every output element written.
// Not supported: `d_lse` (cuDNN's backward has no LSE gradient input): a call with one fails.
//
// How (src/kernels/cudnn/cudnn_plan.h): each task is one sequence of a ragged batch, one call per
// mask kind; graphs are built per bucketed shape and cached, so a training run builds a bounded
// number (graph_stats() says how many and how long they took). dK/dV of tasks that share K/V rows go
// through per-task scratch rows summed in fp32.
//
// Built when CMake finds cuDNN and cudnn-frontend's headers beside nvcc (DISTCA_HAVE_CUDNN);
// otherwise `create` says so. Host-side planning is tested everywhere; the GPU path is checked by
// scripts/gpu-check.sh (what ran where: reports/gpu/).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "distca/core/status.h"
#include "distca/kernels/cuda.h"

namespace distca::kernels {

// True when this build has the cuDNN path; its version, e.g. "cuDNN 9.19.0 (frontend 1.32.0)" (the
// loaded library's), or "" when not built.
bool cudnn_built();
std::string cudnn_version();

class CudnnAttention {
 public:
  // On `device` (-1: the current one). Fails when the build has no cuDNN, when there is no such
  // device, its compute capability is below 8.0, or cuDNN cannot be loaded.
  static Result<std::unique_ptr<CudnnAttention>> create(int device = -1);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Asynchronous on `stream` like CudaAttention's; thread-safe (calls are serialized).
  Status forward(const CudaFwdArgs& a, void* stream);
  Status backward(const CudaBwdArgs& a, void* stream);

  int device() const;
  std::string device_name() const;
  CudnnGraphStats graph_stats() const;

 private:
  struct State;
  explicit CudnnAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace distca::kernels
