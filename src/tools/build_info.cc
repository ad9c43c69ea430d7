#include "build_info.h"

#include <fmt/format.h>

#include <sstream>

namespace distca::tools {

namespace {

constexpr const char* kWhatRanWhere = "what has run on which GPU: reports/gpu/";

// Whether `archs` ("80-real,90a-real", as DISTCA_CUDA_ARCHS lists them) has `arch`, real or virtual.
bool lists(const std::string& archs, const std::string& arch) {
  std::istringstream in(archs);
  for (std::string a; std::getline(in, a, ',');) {
    if (a == arch || a == arch + "-real" || a == arch + "-virtual") return true;
  }
  return false;
}

}  // namespace

std::string cuda_kernels_text(bool is_cuda_built, const std::string& archs, bool is_cudnn_built) {
  if (!is_cuda_built) return "not built (no nvcc at configure time)";
  return fmt::format("built for {}: distca's kernels (mma.sync, sm_80 and up) for each; {}; {}; {}", archs,
                     lists(archs, "90a") ? "the sm_90a kernels (TMA, wgmma) for 90a"
                                         : "the sm_90a kernels (TMA, wgmma) not built (no 90a listed)",
                     is_cudnn_built ? "cuDNN's fused attention" : "cuDNN's fused attention not built (no cuDNN found)",
                     kWhatRanWhere);
}

std::string nccl_text(bool is_nccl_built) {
  return is_nccl_built ? fmt::format("built; {}", kWhatRanWhere)
                       : std::string("not built (no nvcc or libnccl at configure time)");
}

}  // namespace distca::tools
