// The sm_80 tile kernels' launchers (launch.cu, compiled by nvcc: flash_fwd.cuh and flash_bwd.cuh
// instantiated for each head dim and storage type), called by the host side (../attention_cuda.cc,
// compiled by the C++ compiler: fmt and Status stay out of nvcc's way). Each returns the launch's
// cudaError_t; every launch is asynchronous on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_bwd.cuh"
#include "flash_fwd.cuh"

namespace distca::kernels::cuda {

// Raises the dynamic shared memory limit of every tile kernel (once per device).
cudaError_t allow_tile_smem();
// `blocks` = items x query heads; head_dim one of the registry's "distca" head dims
// (REQUIRES: validate(CudaFwdArgs / CudaBwdArgs) passed).
cudaError_t launch_fwd(const FwdKernelParams& p, int head_dim, bool is_bf16, int64_t blocks, cudaStream_t stream);
cudaError_t launch_bwd(const BwdKernelParams& p, int head_dim, bool is_bf16, int64_t blocks, cudaStream_t stream);

}  // namespace distca::kernels::cuda
