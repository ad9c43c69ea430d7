// The CUDA kernels' entry points in a build without nvcc: they exist, so that every caller
// compiles the same way, and each says that this build has no CUDA kernels.
#include "distca/kernels/cuda.h"
#include "distca/kernels/registry.h"

namespace distca::kernels {
namespace {
Status not_built() { return built(kernel_info("distca")); }
}  // namespace

bool cuda_kernels_built() { return false; }
std::string cuda_kernels_archs() { return ""; }

struct CudaAttention::State {};
CudaAttention::CudaAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaAttention::~CudaAttention() = default;
Result<std::unique_ptr<CudaAttention>> CudaAttention::create(int, CudaKernel) { return not_built(); }
Status CudaAttention::forward(const CudaFwdArgs&, void*) { return not_built(); }
Status CudaAttention::backward(const CudaBwdArgs&, void*) { return not_built(); }
int CudaAttention::device() const { return -1; }
std::string CudaAttention::device_name() const { return ""; }
CudaKernel CudaAttention::kernel() const { return CudaKernel::kDistca; }
CudnnGraphStats CudaAttention::graph_stats() const { return {}; }
Status cuda_convert_from_f32(const float*, void*, CudaDType, int64_t, void*) { return not_built(); }
Status cuda_convert_to_f32(const void*, CudaDType, float*, int64_t, void*) { return not_built(); }

}  // namespace distca::kernels
