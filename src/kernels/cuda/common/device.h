// The device a CUDA attention object (CudaAttention, CudnnAttention) runs on: checked once at
// creation, with the same messages for both.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <string>

#include "distca/core/cuda_status.h"
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
  return DeviceInfo{device, fmt::format("{} (sm_{}{})", prop.name, prop.major, prop.minor)};
}

}  // namespace distca::kernels::cuda
