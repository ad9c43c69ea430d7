// CudaAttention: core attention over a CA-task list on an NVIDIA GPU (src/kernels/cuda/).
//
// The same task lists and layout as the CPU kernels (attention.h): Q [Tq, Hq, D], K/V [Tkv, Hkv, D]
// packed THD, bottom-right causal and non-causal tasks, tasks sharing K/V rows, GQA. Storage is
// a CudaDType, accumulation fp32 (tensor-core mma.sync m16n8k16); the dtypes and head dims are the
// registry's CUDA entries' (registry.h). One launch per pass serves every task of the call: a tile
// schedule (one work item per 64-row query tile, or per 64-key tile in the backward, heaviest
// first) is built on the host and uploaded with the call.
//
// Every pointer in the argument structs is device memory of the current device; tasks are host
// memory. Calls are asynchronous on `stream` (a cudaStream_t; nullptr is the legacy default
// stream); outputs are ready when the stream reaches them. Host-side checks (dims, tasks, head
// dim, null pointers, alignment) fail with a Status before anything is launched.
//
// Backward: dQ, dK, dV are summed in fp32 (atomics, so the order of the sum is not fixed; results
// may differ in the last fp32 bits between runs) and rounded once. `d_lse` (optional) is the
// gradient of the loss with respect to LSE, for rows whose partial results were merged over key
// splits by a caller that differentiates through the merge; a caller that passes the merged O and
// LSE instead (distca.torch does) leaves it null.
//
// Built only when CMake finds nvcc (DISTCA_HAVE_CUDA), for every architecture DISTCA_CUDA_ARCHS
// lists; otherwise `create` says so. What has run on which GPU (scripts/gpu-check.sh): reports/gpu/.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "distca/core/status.h"
#include "distca/kernels/attention.h"

namespace distca::kernels {

enum class CudaDType { kBf16, kFp16 };
const char* cuda_dtype_name(CudaDType dtype);

// Which implementation a CudaAttention runs, behind the same contract: distca's own kernels
// (mma.sync, sm_80 and up: src/kernels/cuda/sm80/), cuDNN's fused attention (CudnnAttention,
// cudnn.h: src/kernels/cudnn/), or distca's sm_90a kernels (TMA, wgmma, warp specialisation:
// src/kernels/cuda/sm90/; built where DISTCA_CUDA_ARCHS lists 90a). Each is an entry of the
// kernel registry (registry.h) under its name. Which of them has run on a GPU: reports/gpu/.
enum class CudaKernel { kDistca, kCudnn, kHopper };
const char* cuda_kernel_name(CudaKernel kernel);  // "distca", "cudnn" or "hopper": its registry name
Result<CudaKernel> parse_cuda_kernel(std::string_view name);

// The cuDNN kernel's graph cache (CudnnAttention::graph_stats; all zero for distca's kernels).
struct CudnnGraphStats {
  int64_t graphs_built = 0;     // distinct bucketed shapes compiled so far
  double build_seconds = 0.0;   // wall time spent building them
  int64_t calls = 0;            // cuDNN graph executions
  // DISTCA_CUDNN_AUTOTUNE: time spent timing engine configurations, and each graph key's engine
  // (key text, cuDNN's engine name) in the order chosen; a cached choice costs no time.
  double autotune_seconds = 0.0;
  std::vector<std::pair<std::string, std::string>> engines;
};

struct CudaFwdArgs {
  AttnDims dims;
  CudaDType dtype = CudaDType::kBf16;
  const void* q = nullptr;  // [Tq, Hq, D]
  const void* k = nullptr;  // [Tkv, Hkv, D]
  const void* v = nullptr;  // [Tkv, Hkv, D]
  std::span<const AttnTask> tasks;  // host memory
  std::optional<float> scale;       // default 1 / sqrt(D)
  void* o = nullptr;        // [Tq, Hq, D] out
  float* lse = nullptr;     // [Tq, Hq] out, natural log; -inf where a row sees no key
};

struct CudaBwdArgs {
  AttnDims dims;
  CudaDType dtype = CudaDType::kBf16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;        // [Tq, Hq, D] the (merged) forward output
  const float* lse = nullptr;     // [Tq, Hq] the (merged) forward LSE
  const void* d_o = nullptr;      // [Tq, Hq, D]
  const float* d_lse = nullptr;   // [Tq, Hq] optional: dLoss/dLSE
  std::span<const AttnTask> tasks;
  std::optional<float> scale;
  void* dq = nullptr;   // [Tq, Hq, D] out, dtype
  void* dk = nullptr;   // [Tkv, Hkv, D] out: dtype, or float when dkv_fp32
  void* dv = nullptr;
  bool dkv_fp32 = false;  // dK/dV written as their fp32 sums (not rounded to dtype)
};

// The tile sizes the kernels run (exposed for tests and the cost model).
inline constexpr int kCudaFwdBlockM = 64;   // query rows per forward work item
inline constexpr int kCudaFwdBlockN = 64;   // keys per forward inner step
inline constexpr int kCudaBwdBlockN = 64;   // keys per backward work item
inline constexpr int kCudaBwdBlockM = 32;   // query rows per backward inner step
inline constexpr int kCudaThreads = 128;    // threads per block (4 warps)

// True when this build compiled the CUDA kernels.
bool cuda_kernels_built();
// The sm architectures the kernels were compiled for, e.g. "80;90a"; "" when not built.
std::string cuda_kernels_archs();

// Checks that the shapes can run: a head dim the registry's CUDA entries list, the dims and tasks
// (kernels::validate), at most 2^31-1 rows per task. Host only; what the registry's supports() asks
// of the CUDA kernels.
Status validate_cuda_tasks(const AttnDims& dims, std::span<const AttnTask> tasks, RangeScratch* ranges = nullptr);
// Checks that the arguments can run (validate_cuda_tasks, non-null pointers where rows exist,
// 16-byte aligned Q/K/V/O/dO/dQ/dK/dV). Host only: no CUDA call. The kernels trust what passed.
Status validate(const CudaFwdArgs& a);
Status validate(const CudaBwdArgs& a);

class CudaAttention {
 public:
  // On `device` (-1: the current one), running `kernel`. Fails when the build lacks that kernel
  // (no nvcc, or no cuDNN for kCudnn), when there is no such device, or when its compute capability
  // is below 8.0.
  static Result<std::unique_ptr<CudaAttention>> create(int device = -1, CudaKernel kernel = CudaKernel::kDistca);
  ~CudaAttention();
  CudaAttention(const CudaAttention&) = delete;
  CudaAttention& operator=(const CudaAttention&) = delete;

  Status forward(const CudaFwdArgs& a, void* stream);
  Status backward(const CudaBwdArgs& a, void* stream);

  int device() const;
  std::string device_name() const;  // e.g. "NVIDIA H100 80GB HBM3 (sm_90)"
  CudaKernel kernel() const;
  CudnnGraphStats graph_stats() const;

 private:
  struct State;
  explicit CudaAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Device-side conversions between fp32 and the storage dtype (the runtime's fp32 buffers staged
// for the kernels): n elements, asynchronous on `stream`.
Status cuda_convert_from_f32(const float* src, void* dst, CudaDType dtype, int64_t n, void* stream);
Status cuda_convert_to_f32(const void* src, CudaDType dtype, float* dst, int64_t n, void* stream);

}  // namespace distca::kernels
