// What `distca --version` says about the GPU parts a build holds: what each kernel family is and
// what it was built for, never what ran where or when (that is in reports/gpu/, from the runs
// themselves; a claim compiled into the binary outlives the code it was about).
#pragma once

#include <string>

namespace distca::tools {

// The CUDA kernels' line: "not built (...)", or the architectures and the three families: distca's
// kernels (mma.sync, sm_80 and up) built for each listed architecture, the sm_90a kernels (TMA,
// wgmma) where 90a is listed, cuDNN's fused attention where it was found.
std::string cuda_kernels_text(bool is_cuda_built, const std::string& archs, bool is_cudnn_built);
// NcclComm's line.
std::string nccl_text(bool is_nccl_built);

}  // namespace distca::tools
