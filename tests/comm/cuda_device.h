// Whether this machine has a CUDA device, for the tests that need one: they skip, with the
// reason, where there is none (a CPU-only machine, or no driver).
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace distca::testing {

// "" when a CUDA device is present; otherwise why not.
inline std::string no_cuda_device_reason() {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(e);
  }
  return count == 0 ? std::string("no CUDA device: the driver sees none") : std::string();
}

inline int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace distca::testing

// In a gtest body: skips the test, saying why, on a machine without a CUDA device.
#define DISTCA_SKIP_WITHOUT_CUDA_DEVICE()                                             \
  do {                                                                                \
    if (const std::string reason = ::distca::testing::no_cuda_device_reason(); !reason.empty()) { \
      GTEST_SKIP() << reason;                                                         \
    }                                                                                 \
  } while (0)
