// The attention kernels of this library, in one table: for each its name, the device it runs on,
// the storage dtypes and head dims it is built for, and whether it has a backward. This is the
// one statement of those facts: the kernels' own checks (CpuAttention's, the CUDA kernels'
// validate), the runtime's server kernels and distca.torch (through _distca.kernels()) read it.
//
// The CUDA kernels are CudaAttention's three implementations (CudaKernel) behind one contract.
// Whether a kernel is in this binary (built()) depends on what CMake found; whether a GPU can run
// it (a device, its compute capability) is known only when a CudaAttention is created.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "distca/core/status.h"
#include "distca/kernels/attention.h"

namespace distca::kernels {

enum class KernelDevice { kCpu, kCuda };
const char* device_name(KernelDevice device);  // "cpu" or "cuda"

// Storage dtypes, named as PyTorch names them (torch.float32 ...).
enum class DType { kFloat32, kBfloat16, kFloat16 };
const char* dtype_name(DType dtype);  // "float32", "bfloat16" or "float16"
Result<DType> parse_dtype(std::string_view name);

enum class Pass { kForward, kBackward };

struct KernelInfo {
  std::string_view name;
  KernelDevice device = KernelDevice::kCpu;
  std::span<const DType> dtypes;
  std::span<const int64_t> head_dims;  // empty: any head dim
  bool has_backward = true;
  std::string_view summary;            // what it is, in a few words

  constexpr bool takes(DType dtype) const {
    for (DType d : dtypes) {
      if (d == dtype) return true;
    }
    return false;
  }
  constexpr bool takes_head_dim(int64_t head_dim) const {
    if (head_dims.empty()) return head_dim > 0;
    for (int64_t d : head_dims) {
      if (d == head_dim) return true;
    }
    return false;
  }
};

// The lists the entries below share. The CPU kernels' head dims are what cpu/blocks.h
// instantiates, the CUDA kernels' what their tile kernels do (registry_test runs each).
inline constexpr std::array<DType, 2> kCpuDTypes{DType::kFloat32, DType::kBfloat16};
inline constexpr std::array<DType, 1> kGemmDTypes{DType::kFloat32};
inline constexpr std::array<DType, 2> kCudaDTypes{DType::kBfloat16, DType::kFloat16};
inline constexpr std::array<int64_t, 4> kCpuHeadDims{32, 64, 128, 256};
inline constexpr std::array<int64_t, 2> kCudaHeadDims{64, 128};

// In CudaKernel's order after the CPU kernels (the order names are listed in).
inline constexpr std::array<KernelInfo, 6> kKernels{{
    {"reference", KernelDevice::kCpu, kCpuDTypes, {}, true,
     "plain loops in double: the specification the others are tested against"},
    {"cpu", KernelDevice::kCpu, kCpuDTypes, kCpuHeadDims, true,
     "distca's flash-style CPU kernels (AVX-512, AVX2, baseline builds)"},
    {"gemm", KernelDevice::kCpu, kGemmDTypes, {}, false,
     "OpenBLAS sgemm with the scores materialized: the benchmarks' baseline"},
    {"distca", KernelDevice::kCuda, kCudaDTypes, kCudaHeadDims, true,
     "distca's CUDA kernels (mma.sync, sm_80 and up)"},
    {"cudnn", KernelDevice::kCuda, kCudaDTypes, kCudaHeadDims, true,
     "cuDNN's fused attention on the task list"},
    {"hopper", KernelDevice::kCuda, kCudaDTypes, kCudaHeadDims, true,
     "distca's sm_90a kernels (TMA, wgmma)"},
}};

// The entry named `name`; an error that lists the names when there is none.
Result<const KernelInfo*> find_kernel(std::string_view name);
// The entry named `name`. REQUIRES: `name` is registered (a name the code itself spells).
const KernelInfo& kernel_info(std::string_view name);
// "32, 64, 128 and 256": an entry's head dims as messages say them ("any" when it takes any).
std::string head_dims_text(const KernelInfo& info);

// Ok when `info` is built for `head_dim`; else "the CPU attention kernels are built for head dims
// 32, 64, 128 and 256, got D = 16" (the CUDA kernels: "the CUDA kernels are ...").
Status check_head_dim(const KernelInfo& info, int64_t head_dim);

// Ok when this binary has the kernel; else why not (no nvcc at configure time, no 90a in
// DISTCA_CUDA_ARCHS, no cuDNN found).
Status built(const KernelInfo& info);

// Ok when the kernel, in this binary, runs `pass` over `tasks` with `dims` stored as `dtype`; else
// the reason, as the kernel itself would give it: not built, a dtype or head dim it is not built
// for, no backward, a task list that fails kernels::validate, more than the CUDA kernels' 2^31-1
// rows in a task. Host only, from the shapes: what only a call shows (its pointers, the device,
// a grid past 2^31-1 blocks, cuDNN's int32 ragged offsets past their range) the kernel checks at
// the call. `ranges` is validate's scratch (attention.h).
Status supports(const KernelInfo& info, const AttnDims& dims, std::span<const AttnTask> tasks, DType dtype,
                Pass pass = Pass::kForward, RangeScratch* ranges = nullptr);

}  // namespace distca::kernels
