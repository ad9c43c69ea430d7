// The CUDA kernels' host-side checks (distca/kernels/cuda.h): plain C++, built with or without
// nvcc, so what the kernels accept is the same in every build and testable anywhere.
#include <fmt/format.h>

#include <cstdint>
#include <utility>

#include "distca/kernels/cuda.h"
#include "distca/kernels/registry.h"

namespace distca::kernels {
namespace {

Status check_aligned(const char* name, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    return invalid_argument(fmt::format("{} must be 16-byte aligned for the CUDA kernels, got address {}", name, p));
  }
  return Status::ok();
}

}  // namespace

// The three implementations share one contract (cuda.h), so the head dims are the registry's
// "distca" entry's, which are "hopper"'s and "cudnn"'s (registry_test checks that they are).
Status validate_cuda_tasks(const AttnDims& dims, std::span<const AttnTask> tasks, RangeScratch* ranges) {
  DISTCA_RETURN_IF_ERROR(check_head_dim(kernel_info("distca"), dims.head_dim));
  DISTCA_RETURN_IF_ERROR(validate(dims, tasks, ranges));
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].q_len > INT32_MAX || tasks[i].kv_len > INT32_MAX) {
      return invalid_argument(fmt::format("task {}: the CUDA kernels take at most 2^31-1 rows per task", i));
    }
  }
  return Status::ok();
}

const char* cuda_dtype_name(CudaDType dtype) { return dtype == CudaDType::kBf16 ? "bfloat16" : "float16"; }

const char* cuda_kernel_name(CudaKernel kernel) {
  return kernel == CudaKernel::kCudnn ? "cudnn" : kernel == CudaKernel::kHopper ? "hopper" : "distca";
}

Result<CudaKernel> parse_cuda_kernel(std::string_view name) {
  if (name == "distca") return CudaKernel::kDistca;
  if (name == "cudnn") return CudaKernel::kCudnn;
  if (name == "hopper") return CudaKernel::kHopper;
  return invalid_argument(fmt::format("unknown CUDA kernel '{}': expected distca, cudnn or hopper", name));
}

Status validate(const CudaFwdArgs& a) {
  if (Status st = validate_cuda_tasks(a.dims, a.tasks); !st.is_ok()) return st;
  if (a.dims.num_q_rows > 0 && (!a.q || !a.o || !a.lse)) return invalid_argument("q, o and lse must be non-null");
  if (a.dims.num_kv_rows > 0 && (!a.k || !a.v)) return invalid_argument("k and v must be non-null");
  for (auto [name, p] : {std::pair<const char*, const void*>{"q", a.q}, {"k", a.k}, {"v", a.v}, {"o", a.o}}) {
    if (Status st = check_aligned(name, p); !st.is_ok()) return st;
  }
  return Status::ok();
}

Status validate(const CudaBwdArgs& a) {
  if (Status st = validate_cuda_tasks(a.dims, a.tasks); !st.is_ok()) return st;
  if (a.dims.num_q_rows > 0 && (!a.q || !a.o || !a.lse || !a.d_o || !a.dq)) {
    return invalid_argument("q, o, lse, do and dq must be non-null");
  }
  if (a.dims.num_kv_rows > 0 && (!a.k || !a.v || !a.dk || !a.dv)) return invalid_argument("k, v, dk and dv must be non-null");
  for (auto [name, p] : {std::pair<const char*, const void*>{"q", a.q}, {"k", a.k}, {"v", a.v}, {"o", a.o},
                         {"do", a.d_o}, {"dq", a.dq}, {"dk", a.dk}, {"dv", a.dv}}) {
    if (Status st = check_aligned(name, p); !st.is_ok()) return st;
  }
  return Status::ok();
}

}  // namespace distca::kernels
