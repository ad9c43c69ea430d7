#include "distca/kernels/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "distca/core/check.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"

namespace distca::kernels {
namespace {

std::string names_text() {
  std::vector<std::string_view> names;
  for (const KernelInfo& k : kKernels) names.push_back(k.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string dtypes_text(const KernelInfo& info) {
  std::vector<const char*> names;
  for (DType d : info.dtypes) names.push_back(dtype_name(d));
  return fmt::format("{}", fmt::join(names, " or "));
}

}  // namespace

const char* device_name(KernelDevice device) { return device == KernelDevice::kCpu ? "cpu" : "cuda"; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBfloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "?";
}

Result<DType> parse_dtype(std::string_view name) {
  for (DType d : {DType::kFloat32, DType::kBfloat16, DType::kFloat16}) {
    if (name == dtype_name(d)) return d;
  }
  return invalid_argument(fmt::format("unknown dtype '{}': expected float32, bfloat16 or float16", name));
}

Result<const KernelInfo*> find_kernel(std::string_view name) {
  for (const KernelInfo& k : kKernels) {
    if (k.name == name) return &k;
  }
  return invalid_argument(fmt::format("unknown attention kernel '{}': expected one of {}", name, names_text()));
}

const KernelInfo& kernel_info(std::string_view name) {
  Result<const KernelInfo*> found = find_kernel(name);
  DISTCA_CHECK(found.is_ok()) << found.status().message();
  return *found.value();
}

std::string head_dims_text(const KernelInfo& info) {
  const std::span<const int64_t> dims = info.head_dims;
  if (dims.empty()) return "any";
  if (dims.size() == 1) return fmt::format("{}", dims[0]);
  return fmt::format("{} and {}", fmt::join(dims.first(dims.size() - 1), ", "), dims.back());
}

Status check_head_dim(const KernelInfo& info, int64_t head_dim) {
  if (info.takes_head_dim(head_dim)) return Status::ok();
  return invalid_argument(fmt::format("the {} kernels are built for head dims {}, got D = {}",
                                      info.device == KernelDevice::kCpu ? "CPU attention" : "CUDA",
                                      head_dims_text(info), head_dim));
}

Status built(const KernelInfo& info) {
  if (info.device == KernelDevice::kCpu) return Status::ok();
  if (info.name == "cudnn" && !cudnn_built()) {
    return not_found(
        "this build of distca has no cuDNN kernel (cuDNN or cudnn-frontend's headers were not found at configure "
        "time, or DISTCA_WITH_CUDNN=OFF); scripts/cudnn-frontend.sh fetches the headers, then reconfigure");
  }
  if (!cuda_kernels_built()) {
    return not_found(
        "this build of distca has no CUDA kernels (nvcc was not found at configure time, or DISTCA_WITH_CUDA=OFF); "
        "reconfigure where the CUDA toolkit is installed");
  }
  if (info.name == "hopper" && cuda_kernels_archs().find("90a") == std::string::npos) {
    return not_found(fmt::format("this build of distca has no sm_90a kernels (DISTCA_CUDA_ARCHS is {}, without 90a)",
                                 cuda_kernels_archs()));
  }
  return Status::ok();
}

Status supports(const KernelInfo& info, const AttnDims& dims, std::span<const AttnTask> tasks, DType dtype, Pass pass,
                RangeScratch* ranges) {
  DISTCA_RETURN_IF_ERROR(built(info));
  if (!info.takes(dtype)) {
    return invalid_argument(fmt::format("the {} kernel takes {} on {}, not {}", info.name, dtypes_text(info),
                                        device_name(info.device), dtype_name(dtype)));
  }
  if (pass == Pass::kBackward && !info.has_backward) {
    return invalid_argument(fmt::format("the {} kernel has no backward (forward only)", info.name));
  }
  if (info.device == KernelDevice::kCuda) return validate_cuda_tasks(dims, tasks, ranges);
  // In CpuAttention's order: the task list, then the head dim.
  DISTCA_RETURN_IF_ERROR(validate(dims, tasks, ranges));
  return check_head_dim(info, dims.head_dim);
}

}  // namespace distca::kernels
