// The device a CUDA attention object (CudaAttention, CudnnAttention) runs on: checked once at
// creation, with the same messages for both.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "distca/core/cuda_status.h"
#include "distca/core/knobs.h"
#include "distca/core/status.h"

namespace distca::kernels::cuda {

struct DeviceInfo {
  int device = 0;
  std::string name;  // e.g. "NVIDIA H100 80GB HBM3 (sm_90)"
};

// `device` (-1: the current one) when it exists and has compute capability 8.0 or newer; `who`
// names what needs it in the refusal ("distca's CUDA kernels need").
inline Result<DeviceInfo> open_device(int device, const char* who) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    return not_found(fmt::format("no CUDA device: {}", e != cudaSuccess ? cudaGetErrorString(e) : "the driver sees none"));
  }
  if (device < 0) DISTCA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device >= count) return invalid_argument(fmt::format("CUDA device {} does not exist ({} found)", device, count));
  cudaDeviceProp prop{};
  DISTCA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 8) {
    return invalid_argument(fmt::format("{} has compute capability {}.{}; {} 8.0 or newer", prop.name, prop.major,
                                        prop.minor, who));
  }
  // The stream-ordered pool Scratch allocates from returns its memory to the driver at every
  // synchronisation by default (a release threshold of 0), so a large cuDNN workspace would be
  // allocated afresh on every call after one: keep up to DISTCA_CUDA_POOL_KEEP_MIB of it instead.
  // Not yet validated on a GPU (gpu-check times the cuDNN bench with 0 and the default).
  const char* keep_text = knob("DISTCA_CUDA_POOL_KEEP_MIB");
  char* end = nullptr;
  const unsigned long long keep_mib = keep_text ? std::strtoull(keep_text, &end, 10) : 2048;
  if (keep_text != nullptr && (end == keep_text || *end != '\0' || keep_mib > (1ull << 24))) {
    return invalid_argument(fmt::format("DISTCA_CUDA_POOL_KEEP_MIB must be a whole number of MiB in [0, 16777216], got '{}'",
                                        std::string_view(keep_text).substr(0, 40)));
  }
  cudaMemPool_t pool = nullptr;
  DISTCA_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t keep_bytes = static_cast<uint64_t>(keep_mib) << 20;
  DISTCA_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_bytes));
  return DeviceInfo{device, fmt::format("{} (sm_{}{})", prop.name, prop.major, prop.minor)};
}

}  // namespace distca::kernels::cuda
