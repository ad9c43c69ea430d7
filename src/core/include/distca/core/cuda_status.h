// The CUDA host code's shared helpers (kernels/cuda, comm's NcclComm, runtime's CudaServerKernel):
// a CUDA error as a Status naming the call, and the current device for a scope. Header-only and
// included only by sources built with CUDA (it includes cuda_runtime.h); core itself never links it.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <string>

#include "distca/core/status.h"

namespace distca {

// "<prefix><what> failed: <CUDA's string> (<its name>)", or ok.
inline Status cuda_status(cudaError_t e, const char* what, const char* prefix = "") {
  if (e == cudaSuccess) return Status::ok();
  return internal_error(fmt::format("{}{} failed: {} ({})", prefix, what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

// Returns the Status of a failed CUDA runtime call from the enclosing function, naming the call.
#define DISTCA_CUDA_RETURN_IF_ERROR(call) DISTCA_RETURN_IF_ERROR(::distca::cuda_status((call), #call))

// Makes `device` current for the scope of a call and restores the caller's.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      status_ = cuda_status(cudaSetDevice(device), "cudaSetDevice");
    } else {
      previous_ = -1;
    }
  }
  ~CudaDeviceScope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

}  // namespace distca
