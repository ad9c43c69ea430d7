// CudnnAttention's entry points in a build without cuDNN (no nvcc, or cudnn.h, libcudnn or
// cudnn-frontend's headers not found at configure time): each says so.
#include "distca/kernels/cudnn.h"
#include "distca/kernels/registry.h"

namespace distca::kernels {

bool cudnn_built() { return false; }
std::string cudnn_version() { return ""; }

struct CudnnAttention::State {};
CudnnAttention::CudnnAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudnnAttention::~CudnnAttention() = default;
Result<std::unique_ptr<CudnnAttention>> CudnnAttention::create(int) { return built(kernel_info("cudnn")); }
Status CudnnAttention::forward(const CudaFwdArgs&, void*) { return create(-1).status(); }
Status CudnnAttention::backward(const CudaBwdArgs&, void*) { return create(-1).status(); }
int CudnnAttention::device() const { return -1; }
std::string CudnnAttention::device_name() const { return ""; }
CudnnGraphStats CudnnAttention::graph_stats() const { return {}; }

}  // namespace distca::kernels
