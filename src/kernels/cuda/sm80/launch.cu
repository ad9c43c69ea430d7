// The sm_80 tile kernels and their launchers (launch.h): flash_fwd.cuh and flash_bwd.cuh
// instantiated for each head dim and storage dtype of the registry's CUDA entries (registry.h,
// which validate_cuda_tasks checks before any launch). Their host side is
// ../attention_cuda.cc; the small kernels every implementation shares are ../common/elementwise.cu.
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"

namespace distca::kernels::cuda {
namespace {

template <int D, typename Elt>
__global__ void __launch_bounds__(128) fwd_kernel(FwdKernelParams p) {
  extern __shared__ __align__(16) char smem[];
  fwd_block<D, Elt>(p, smem);
}

template <int D, typename Elt>
__global__ void __launch_bounds__(128) bwd_kernel(BwdKernelParams p) {
  extern __shared__ __align__(16) char smem[];
  bwd_block<D, Elt>(p, smem);
}

template <int D, typename Elt>
cudaError_t fwd_launch(const FwdKernelParams& p, int64_t blocks, cudaStream_t stream) {
  fwd_kernel<D, Elt><<<static_cast<unsigned>(blocks), 128, FwdShape<D>::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int D, typename Elt>
cudaError_t bwd_launch(const BwdKernelParams& p, int64_t blocks, cudaStream_t stream) {
  bwd_kernel<D, Elt><<<static_cast<unsigned>(blocks), 128, BwdShape<D>::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t allow_tile_smem() {
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  for (cudaError_t e : {cudaFuncSetAttribute(fwd_kernel<64, Bf16>, attr, FwdShape<64>::kSmemBytes),
                        cudaFuncSetAttribute(fwd_kernel<128, Bf16>, attr, FwdShape<128>::kSmemBytes),
                        cudaFuncSetAttribute(fwd_kernel<64, Fp16>, attr, FwdShape<64>::kSmemBytes),
                        cudaFuncSetAttribute(fwd_kernel<128, Fp16>, attr, FwdShape<128>::kSmemBytes),
                        cudaFuncSetAttribute(bwd_kernel<64, Bf16>, attr, BwdShape<64>::kSmemBytes),
                        cudaFuncSetAttribute(bwd_kernel<128, Bf16>, attr, BwdShape<128>::kSmemBytes),
                        cudaFuncSetAttribute(bwd_kernel<64, Fp16>, attr, BwdShape<64>::kSmemBytes),
                        cudaFuncSetAttribute(bwd_kernel<128, Fp16>, attr, BwdShape<128>::kSmemBytes)}) {
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launch_fwd(const FwdKernelParams& p, int head_dim, bool is_bf16, int64_t blocks, cudaStream_t stream) {
  if (head_dim == 64) return is_bf16 ? fwd_launch<64, Bf16>(p, blocks, stream) : fwd_launch<64, Fp16>(p, blocks, stream);
  return is_bf16 ? fwd_launch<128, Bf16>(p, blocks, stream) : fwd_launch<128, Fp16>(p, blocks, stream);
}

cudaError_t launch_bwd(const BwdKernelParams& p, int head_dim, bool is_bf16, int64_t blocks, cudaStream_t stream) {
  if (head_dim == 64) return is_bf16 ? bwd_launch<64, Bf16>(p, blocks, stream) : bwd_launch<64, Fp16>(p, blocks, stream);
  return is_bf16 ? bwd_launch<128, Bf16>(p, blocks, stream) : bwd_launch<128, Fp16>(p, blocks, stream);
}

}  // namespace distca::kernels::cuda
