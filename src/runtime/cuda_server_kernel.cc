#include "distca/runtime/cuda_server_kernel.h"
#include "distca/core/cuda_status.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstddef>

#include "distca/kernels/registry.h"

namespace distca::runtime {
namespace {

Status cuda_status(cudaError_t e, const char* what) { return distca::cuda_status(e, what, "CudaServerKernel: "); }

// Device memory that grows to the largest size asked for and is kept.
struct DeviceBuffer {
  void* ptr = nullptr;
  int64_t bytes = 0;

  Status reserve(int64_t need, const char* name) {
    if (need <= bytes) return Status::ok();
    if (ptr != nullptr) DISTCA_CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    ptr = nullptr;
    bytes = 0;
    if (const cudaError_t e = cudaMalloc(&ptr, static_cast<size_t>(need)); e != cudaSuccess) {
      ptr = nullptr;
      return internal_error(fmt::format("CudaServerKernel: cudaMalloc of {} bytes for {} failed: {} ({})", need, name,
                                        cudaGetErrorString(e), cudaGetErrorName(e)));
    }
    bytes = need;
    return Status::ok();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

constexpr int64_t kStorageBytes = 2;  // bf16 and fp16

}  // namespace

struct CudaServerKernel::State {
  ~State() {
    CudaDeviceScope scope(device);
    if (stream != nullptr) (void)cudaStreamSynchronize(stream);
    for (DeviceBuffer* b : {&staging, &q, &k, &v, &o, &d_o, &dq, &lse, &dk, &dv}) {
      if (b->ptr != nullptr) (void)cudaFree(b->ptr);
    }
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  // Host fp32 [n] -> `dst` in the storage dtype, through the fp32 staging buffer. The staging
  // buffer is reused by the next tensor; the stream orders the conversion before that copy.
  Status upload(const float* host, int64_t n, DeviceBuffer& dst, const char* name) {
    if (n == 0) return Status::ok();
    DISTCA_RETURN_IF_ERROR(staging.reserve(n * 4, "the fp32 staging buffer"));
    DISTCA_RETURN_IF_ERROR(dst.reserve(n * kStorageBytes, name));
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.ptr, host, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice, stream));
    return kernels::cuda_convert_from_f32(staging.as<float>(), dst.ptr, dtype, n, stream);
  }
  // `src` in the storage dtype [n] -> host fp32, through the staging buffer.
  Status download(const DeviceBuffer& src, int64_t n, float* host) {
    if (n == 0) return Status::ok();
    DISTCA_RETURN_IF_ERROR(staging.reserve(n * 4, "the fp32 staging buffer"));
    DISTCA_RETURN_IF_ERROR(kernels::cuda_convert_to_f32(src.ptr, dtype, staging.as<float>(), n, stream));
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, staging.ptr, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, stream));
    return Status::ok();
  }
  // fp32 both sides.
  Status copy_in(const float* host, int64_t n, DeviceBuffer& dst, const char* name) {
    if (n == 0) return Status::ok();
    DISTCA_RETURN_IF_ERROR(dst.reserve(n * 4, name));
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.ptr, host, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice, stream));
    return Status::ok();
  }
  Status copy_out(const DeviceBuffer& src, int64_t n, float* host) {
    if (n == 0) return Status::ok();
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, src.ptr, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, stream));
    return Status::ok();
  }

  std::unique_ptr<kernels::CudaAttention> attention;
  const kernels::KernelInfo* info = nullptr;  // the kernel's registry entry
  kernels::CudaDType dtype = kernels::CudaDType::kBf16;
  int device = 0;
  cudaStream_t stream = nullptr;
  DeviceBuffer staging;              // fp32, the largest tensor staged so far
  DeviceBuffer q, o, d_o, dq;        // [Tq, Hq, D] storage dtype
  DeviceBuffer k, v;                 // [Tkv, Hkv, D] storage dtype
  DeviceBuffer lse;                  // [Tq, Hq] fp32
  DeviceBuffer dk, dv;               // [Tkv, Hkv, D] fp32
  kernels::RangeScratch ranges;      // validate's scratch, reused

  kernels::DType storage() const {
    return dtype == kernels::CudaDType::kBf16 ? kernels::DType::kBfloat16 : kernels::DType::kFloat16;
  }
  // What the registry says of this call, before anything is copied.
  Status check(const kernels::AttnDims& dims, std::span<const kernels::AttnTask> tasks, kernels::Pass pass) {
    if (Status st = kernels::supports(*info, dims, tasks, storage(), pass, &ranges); !st.is_ok()) {
      return Status(st.code(), fmt::format("CudaServerKernel {}: {}", pass == kernels::Pass::kForward ? "forward" : "backward",
                                           st.message()));
    }
    return Status::ok();
  }
};

CudaServerKernel::CudaServerKernel(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaServerKernel::~CudaServerKernel() = default;

Result<std::unique_ptr<CudaServerKernel>> CudaServerKernel::create(int device, kernels::CudaDType dtype,
                                                                    kernels::CudaKernel kernel) {
  auto attention = kernels::CudaAttention::create(device, kernel);
  if (!attention.is_ok()) {
    return Status(attention.status().code(), fmt::format("CudaServerKernel: {}", attention.status().message()));
  }
  auto state = std::make_unique<State>();
  state->attention = std::move(attention).value();
  state->info = &kernels::kernel_info(kernels::cuda_kernel_name(kernel));
  state->dtype = dtype;
  state->device = state->attention->device();
  CudaDeviceScope scope(state->device);
  DISTCA_RETURN_IF_ERROR(scope.status());
  DISTCA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking));
  return std::unique_ptr<CudaServerKernel>(new CudaServerKernel(std::move(state)));
}

int CudaServerKernel::device() const { return state_->device; }
std::string CudaServerKernel::device_name() const { return state_->attention->device_name(); }
kernels::CudaDType CudaServerKernel::dtype() const { return state_->dtype; }
kernels::CudaKernel CudaServerKernel::kernel() const { return state_->attention->kernel(); }
const kernels::KernelInfo& CudaServerKernel::info() const { return *state_->info; }
Status CudaServerKernel::supports(const kernels::AttnDims& dims) const {
  return kernels::supports(*state_->info, dims, {}, state_->storage());
}
int64_t CudaServerKernel::device_bytes() const {
  int64_t total = 0;
  for (const DeviceBuffer* b : {&state_->staging, &state_->q, &state_->k, &state_->v, &state_->o, &state_->d_o,
                                &state_->dq, &state_->lse, &state_->dk, &state_->dv}) {
    total += b->bytes;
  }
  return total;
}

Status CudaServerKernel::forward(const kernels::AttnFwdParams<float>& p) {
  State& s = *state_;
  DISTCA_RETURN_IF_ERROR(kernels::validate(p, &s.ranges));
  DISTCA_RETURN_IF_ERROR(s.check(p.dims, p.tasks, kernels::Pass::kForward));
  const kernels::AttnDims& d = p.dims;
  const int64_t q_elems = d.num_q_rows * d.num_q_heads * d.head_dim;
  const int64_t kv_elems = d.num_kv_rows * d.num_kv_heads * d.head_dim;
  const int64_t rows_heads = d.num_q_rows * d.num_q_heads;
  CudaDeviceScope scope(s.device);
  DISTCA_RETURN_IF_ERROR(scope.status());

  // 1. Inputs to the device, in the storage dtype; room for the outputs.
  DISTCA_RETURN_IF_ERROR(s.upload(p.q, q_elems, s.q, "Q"));
  DISTCA_RETURN_IF_ERROR(s.upload(p.k, kv_elems, s.k, "K"));
  DISTCA_RETURN_IF_ERROR(s.upload(p.v, kv_elems, s.v, "V"));
  DISTCA_RETURN_IF_ERROR(s.o.reserve(q_elems * kStorageBytes, "O"));
  DISTCA_RETURN_IF_ERROR(s.lse.reserve(rows_heads * 4, "LSE"));

  // 2. The kernel.
  kernels::CudaFwdArgs a;
  a.dims = d;
  a.dtype = s.dtype;
  a.q = s.q.ptr;
  a.k = s.k.ptr;
  a.v = s.v.ptr;
  a.tasks = p.tasks;
  a.scale = p.scale;
  a.o = s.o.ptr;
  a.lse = s.lse.as<float>();
  if (Status st = s.attention->forward(a, s.stream); !st.is_ok()) {
    return Status(st.code(), fmt::format("CudaServerKernel forward: {}", st.message()));
  }

  // 3. Outputs to the host: O through fp32, LSE as it is.
  DISTCA_RETURN_IF_ERROR(s.download(s.o, q_elems, p.o));
  DISTCA_RETURN_IF_ERROR(s.copy_out(s.lse, rows_heads, p.lse));
  DISTCA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.stream));
  return Status::ok();
}

Status CudaServerKernel::backward(const kernels::AttnBwdParams<float>& p) {
  State& s = *state_;
  DISTCA_RETURN_IF_ERROR(kernels::validate(p, &s.ranges));
  DISTCA_RETURN_IF_ERROR(s.check(p.dims, p.tasks, kernels::Pass::kBackward));
  const kernels::AttnDims& d = p.dims;
  const int64_t q_elems = d.num_q_rows * d.num_q_heads * d.head_dim;
  const int64_t kv_elems = d.num_kv_rows * d.num_kv_heads * d.head_dim;
  const int64_t rows_heads = d.num_q_rows * d.num_q_heads;
  CudaDeviceScope scope(s.device);
  DISTCA_RETURN_IF_ERROR(scope.status());

  // 1. Inputs: Q, K, V, O, dO in the storage dtype, LSE in fp32; room for dQ and the fp32 dK/dV.
  DISTCA_RETURN_IF_ERROR(s.upload(p.q, q_elems, s.q, "Q"));
  DISTCA_RETURN_IF_ERROR(s.upload(p.k, kv_elems, s.k, "K"));
  DISTCA_RETURN_IF_ERROR(s.upload(p.v, kv_elems, s.v, "V"));
  DISTCA_RETURN_IF_ERROR(s.upload(p.o, q_elems, s.o, "O"));
  DISTCA_RETURN_IF_ERROR(s.upload(p.d_o, q_elems, s.d_o, "dO"));
  DISTCA_RETURN_IF_ERROR(s.copy_in(p.lse, rows_heads, s.lse, "LSE"));
  DISTCA_RETURN_IF_ERROR(s.dq.reserve(q_elems * kStorageBytes, "dQ"));
  DISTCA_RETURN_IF_ERROR(s.dk.reserve(kv_elems * 4, "dK"));
  DISTCA_RETURN_IF_ERROR(s.dv.reserve(kv_elems * 4, "dV"));

  // 2. The kernel; dK/dV stay fp32 sums (the Dispatcher sums them again, in fp32, at the owner).
  kernels::CudaBwdArgs a;
  a.dims = d;
  a.dtype = s.dtype;
  a.q = s.q.ptr;
  a.k = s.k.ptr;
  a.v = s.v.ptr;
  a.o = s.o.ptr;
  a.lse = s.lse.as<float>();
  a.d_o = s.d_o.ptr;
  a.tasks = p.tasks;
  a.scale = p.scale;
  a.dq = s.dq.ptr;
  a.dk = s.dk.ptr;
  a.dv = s.dv.ptr;
  a.dkv_fp32 = true;
  if (Status st = s.attention->backward(a, s.stream); !st.is_ok()) {
    return Status(st.code(), fmt::format("CudaServerKernel backward: {}", st.message()));
  }

  // 3. Outputs to the host: dQ through fp32, dK/dV as they are.
  DISTCA_RETURN_IF_ERROR(s.download(s.dq, q_elems, p.dq));
  DISTCA_RETURN_IF_ERROR(s.copy_out(s.dk, kv_elems, p.dk));
  DISTCA_RETURN_IF_ERROR(s.copy_out(s.dv, kv_elems, p.dv));
  DISTCA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.stream));
  return Status::ok();
}

}  // namespace distca::runtime
