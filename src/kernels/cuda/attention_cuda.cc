// CudaAttention (distca/kernels/cuda.h), host side: checks, the tile schedule uploaded per call,
// per-call device memory from the stream-ordered allocator (so calls on different streams never
// share a buffer), and the launches (sm80/launch.h, sm90/launch.h,
// common/elementwise.h) in order on the caller's stream.
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "distca/core/cuda_status.h"
#include "distca/core/knobs.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"
#include "common/device.h"
#include "common/elementwise.h"
#include "common/schedule.h"
#include "common/scratch.h"
#include "sm80/launch.h"
#include "sm90/launch.h"

namespace distca::kernels {
namespace {

using cuda::BwdItem;
using cuda::BwdKernelParams;
using cuda::FwdItem;
using cuda::KvTileEntry;
using cuda::KvTileItem;
using cuda::FwdKernelParams;
using cuda::Scratch;

static_assert(cuda::FwdShape<128>::kBlockM == kCudaFwdBlockM && cuda::FwdShape<128>::kBlockN == kCudaFwdBlockN);
static_assert(cuda::BwdShape<128>::kBlockN == kCudaBwdBlockN && cuda::BwdShape<128>::kBlockM == kCudaBwdBlockM);

constexpr float kLog2e = 1.4426950408889634f;


Status check_grid(int64_t items, int64_t heads) {
  if (items > 0 && items * heads > INT32_MAX) {
    return invalid_argument(fmt::format("{} tiles x {} heads exceed the 2^31-1 blocks of a grid", items, heads));
  }
  return Status::ok();
}

}  // namespace

bool cuda_kernels_built() { return true; }
std::string cuda_kernels_archs() { return DISTCA_CUDA_ARCHS_STRING; }

struct CudaAttention::State {
  int device = 0;
  std::string name;
  std::unique_ptr<CudnnAttention> cudnn;  // set when the kernel is cuDNN's: every call goes there
  bool hopper = false;                    // the sm_90a kernels (hopper_fwd.cuh, hopper_bwd.cuh)
  bool hopper_dq_pass = false;            // DISTCA_HOPPER_DQ=pass: dQ in its own pass (hopper_bwd_dq.cuh)
  int num_sms = 0;
};

CudaAttention::CudaAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaAttention::~CudaAttention() = default;

Result<std::unique_ptr<CudaAttention>> CudaAttention::create(int device, CudaKernel kernel) {
  Result<cuda::DeviceInfo> opened = cuda::open_device(device, "distca's CUDA kernels need");
  if (!opened.is_ok()) return opened.status();
  device = opened.value().device;
  CudaDeviceScope scope(device);
  if (!scope.status().is_ok()) return scope.status();
  DISTCA_CUDA_RETURN_IF_ERROR(cuda::allow_tile_smem());
  auto state = std::make_unique<State>();
  state->device = device;
  state->name = opened.value().name;
  if (kernel == CudaKernel::kCudnn) {
    Result<std::unique_ptr<CudnnAttention>> cudnn = CudnnAttention::create(device);
    if (!cudnn.is_ok()) return cudnn.status();
    state->cudnn = std::move(cudnn).value();
  }
  if (kernel == CudaKernel::kHopper) {
    cudaDeviceProp prop{};
    DISTCA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
    const std::string archs = cuda_kernels_archs();
    if (prop.major != 9 || prop.minor != 0 || archs.find("90a") == std::string::npos) {
      return not_found(fmt::format(
          "the hopper kernel runs on compute capability 9.0 (H100, H200) in a build with sm_90a; this is {} and the "
          "build has {}",
          state->name, archs));
    }
    state->hopper = true;
    state->num_sms = prop.multiProcessorCount;
    // How the backward sums dQ, for timing the two against each other on a GPU: fp32 atomic adds
    // from the K/V blocks (atomic, the default) or a pass over query tiles of its own (pass).
    const char* dq = knob("DISTCA_HOPPER_DQ");
    const std::string_view dq_mode = dq ? dq : "atomic";
    if (dq_mode != "atomic" && dq_mode != "pass") {
      return invalid_argument(fmt::format("DISTCA_HOPPER_DQ={}: expected atomic (the default) or pass", dq_mode));
    }
    state->hopper_dq_pass = dq_mode == "pass";
  }
  return std::unique_ptr<CudaAttention>(new CudaAttention(std::move(state)));
}

int CudaAttention::device() const { return state_->device; }
std::string CudaAttention::device_name() const { return state_->name; }
CudaKernel CudaAttention::kernel() const {
  return state_->cudnn ? CudaKernel::kCudnn : state_->hopper ? CudaKernel::kHopper : CudaKernel::kDistca;
}
CudnnGraphStats CudaAttention::graph_stats() const { return state_->cudnn ? state_->cudnn->graph_stats() : CudnnGraphStats{}; }

Status CudaAttention::forward(const CudaFwdArgs& a, void* stream_ptr) {
  if (state_->cudnn) return state_->cudnn->forward(a, stream_ptr);
  if (Status st = validate(a); !st.is_ok()) return st;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const AttnDims& d = a.dims;
  const std::vector<FwdItem> items =
      cuda::fwd_schedule(a.tasks, state_->hopper ? cuda::kHopperFwdBlockM : kCudaFwdBlockM);
  if (Status st = check_grid(static_cast<int64_t>(items.size()), d.num_q_heads); !st.is_ok()) return st;
  CudaDeviceScope scope(state_->device);
  if (!scope.status().is_ok()) return scope.status();
  auto* o = static_cast<uint16_t*>(a.o);
  for (const auto& [begin, end] : cuda::uncovered_rows(d.num_q_rows, a.tasks)) {
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_fill_rows(o, a.lse, begin, end, d.num_q_heads * d.head_dim,
                                           static_cast<int>(d.num_q_heads), stream));
  }
  if (items.empty()) return Status::ok();
  Scratch scratch(stream);
  Result<const FwdItem*> device_items = scratch.upload(items);
  if (!device_items.is_ok()) return device_items.status();
  if (state_->hopper) {
    cuda::HopperFwdLaunch l;
    l.q = a.q;
    l.k = a.k;
    l.v = a.v;
    l.o = o;
    l.lse = a.lse;
    l.items = device_items.value();
    l.num_items = static_cast<int64_t>(items.size());
    l.num_q_rows = d.num_q_rows;
    l.num_kv_rows = d.num_kv_rows;
    l.num_q_heads = static_cast<int>(d.num_q_heads);
    l.num_kv_heads = static_cast<int>(d.num_kv_heads);
    l.head_dim = static_cast<int>(d.head_dim);
    l.is_bf16 = a.dtype == CudaDType::kBf16;
    l.scale_log2 = softmax_scale(d, a.scale) * kLog2e;
    l.num_sms = state_->num_sms;
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_hopper_fwd(l, stream));
    return Status::ok();
  }
  FwdKernelParams p;
  p.q = static_cast<const uint16_t*>(a.q);
  p.k = static_cast<const uint16_t*>(a.k);
  p.v = static_cast<const uint16_t*>(a.v);
  p.o = o;
  p.lse = a.lse;
  p.items = device_items.value();
  p.num_items = static_cast<int64_t>(items.size());
  p.num_q_heads = static_cast<int>(d.num_q_heads);
  p.num_kv_heads = static_cast<int>(d.num_kv_heads);
  p.scale_log2 = softmax_scale(d, a.scale) * kLog2e;
  DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_fwd(p, static_cast<int>(d.head_dim), a.dtype == CudaDType::kBf16,
                                   p.num_items * d.num_q_heads, stream));
  return Status::ok();
}

Status CudaAttention::backward(const CudaBwdArgs& a, void* stream_ptr) {
  if (state_->cudnn) return state_->cudnn->backward(a, stream_ptr);
  if (Status st = validate(a); !st.is_ok()) return st;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const AttnDims& d = a.dims;
  const bool is_bf16 = a.dtype == CudaDType::kBf16;
  const float scale = softmax_scale(d, a.scale);
  const int64_t q_elems = d.num_q_rows * d.num_q_heads * d.head_dim;
  const int64_t kv_elems = d.num_kv_rows * d.num_kv_heads * d.head_dim;
  const int64_t rows_heads = d.num_q_rows * d.num_q_heads;
  // sm_90a: K/V tiles that own their dK/dV rows; sm_80: a task's key tiles, one block a query head.
  const std::vector<BwdItem> items = state_->hopper ? std::vector<BwdItem>{} : cuda::bwd_schedule(a.tasks, kCudaBwdBlockN);
  const cuda::KvTileSchedule kv_tiles =
      state_->hopper ? cuda::kv_tile_schedule(a.tasks, cuda::kHopperBwdBlockN) : cuda::KvTileSchedule{};
  const std::vector<FwdItem> dq_items =
      state_->hopper && state_->hopper_dq_pass ? cuda::fwd_schedule(a.tasks, cuda::kHopperBwdDqBlockM) : std::vector<FwdItem>{};
  if (Status st = check_grid(static_cast<int64_t>(items.size()), d.num_q_heads); !st.is_ok()) return st;
  CudaDeviceScope scope(state_->device);
  if (!scope.status().is_ok()) return scope.status();

  // fp32 sums: dQ and delta in scratch; dK/dV in the outputs themselves when those are fp32.
  Scratch scratch(stream);
  Result<float*> dq_acc = scratch.alloc<float>(q_elems), delta = scratch.alloc<float>(rows_heads);
  if (!dq_acc.is_ok()) return dq_acc.status();
  if (!delta.is_ok()) return delta.status();
  float* dk_acc = a.dkv_fp32 ? static_cast<float*>(a.dk) : nullptr;
  float* dv_acc = a.dkv_fp32 ? static_cast<float*>(a.dv) : nullptr;
  if (!a.dkv_fp32) {
    Result<float*> k_acc = scratch.alloc<float>(kv_elems), v_acc = scratch.alloc<float>(kv_elems);
    if (!k_acc.is_ok()) return k_acc.status();
    if (!v_acc.is_ok()) return v_acc.status();
    dk_acc = k_acc.value();
    dv_acc = v_acc.value();
  }
  if (q_elems > 0) DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dq_acc.value(), 0, static_cast<size_t>(q_elems) * 4, stream));
  if (kv_elems > 0) {
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dk_acc, 0, static_cast<size_t>(kv_elems) * 4, stream));
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dv_acc, 0, static_cast<size_t>(kv_elems) * 4, stream));
  }
  if (rows_heads > 0) {
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_delta(static_cast<const uint16_t*>(a.d_o), static_cast<const uint16_t*>(a.o), a.d_lse,
                                       delta.value(), rows_heads, static_cast<int>(d.head_dim), is_bf16, stream));
  }
  if (!kv_tiles.items.empty() || !dq_items.empty()) {
    Result<const KvTileItem*> device_items = scratch.upload(kv_tiles.items);
    if (!device_items.is_ok()) return device_items.status();
    Result<const KvTileEntry*> device_entries = scratch.upload(kv_tiles.entries);
    if (!device_entries.is_ok()) return device_entries.status();
    cuda::HopperBwdLaunch l;
    if (!dq_items.empty()) {  // DISTCA_HOPPER_DQ=pass
      Result<const FwdItem*> device_dq_items = scratch.upload(dq_items);
      if (!device_dq_items.is_ok()) return device_dq_items.status();
      l.dq_items = device_dq_items.value();
      l.num_dq_items = static_cast<int64_t>(dq_items.size());
    }
    l.q = a.q;
    l.k = a.k;
    l.v = a.v;
    l.d_o = a.d_o;
    l.lse = a.lse;
    l.delta = delta.value();
    l.dq_acc = dq_acc.value();
    l.dk_acc = dk_acc;
    l.dv_acc = dv_acc;
    l.items = device_items.value();
    l.entries = device_entries.value();
    l.num_items = static_cast<int64_t>(kv_tiles.items.size());
    l.num_q_rows = d.num_q_rows;
    l.num_kv_rows = d.num_kv_rows;
    l.num_q_heads = static_cast<int>(d.num_q_heads);
    l.num_kv_heads = static_cast<int>(d.num_kv_heads);
    l.head_dim = static_cast<int>(d.head_dim);
    l.is_bf16 = is_bf16;
    l.scale_log2 = scale * kLog2e;
    l.num_sms = state_->num_sms;
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_hopper_bwd(l, stream));
  }
  if (!items.empty()) {
    Result<const BwdItem*> device_items = scratch.upload(items);
    if (!device_items.is_ok()) return device_items.status();
    BwdKernelParams p;
    p.q = static_cast<const uint16_t*>(a.q);
    p.k = static_cast<const uint16_t*>(a.k);
    p.v = static_cast<const uint16_t*>(a.v);
    p.d_o = static_cast<const uint16_t*>(a.d_o);
    p.lse = a.lse;
    p.delta = delta.value();
    p.dq_acc = dq_acc.value();
    p.dk_acc = dk_acc;
    p.dv_acc = dv_acc;
    p.items = device_items.value();
    p.num_items = static_cast<int64_t>(items.size());
    p.num_q_heads = static_cast<int>(d.num_q_heads);
    p.num_kv_heads = static_cast<int>(d.num_kv_heads);
    p.scale_log2 = scale * kLog2e;
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_bwd(p, static_cast<int>(d.head_dim), is_bf16, p.num_items * d.num_q_heads, stream));
  }
  // Round the sums once: dQ and dK carry the softmax scale, dV none.
  if (q_elems > 0) {
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_finalize(dq_acc.value(), static_cast<uint16_t*>(a.dq), scale, q_elems, is_bf16, stream));
  }
  if (kv_elems > 0) {
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_finalize(dk_acc, a.dkv_fp32 ? nullptr : static_cast<uint16_t*>(a.dk), scale, kv_elems,
                                          is_bf16, stream));
    if (!a.dkv_fp32) {
      DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_finalize(dv_acc, static_cast<uint16_t*>(a.dv), 1.f, kv_elems, is_bf16, stream));
    }
  }
  return Status::ok();
}

Status cuda_convert_from_f32(const float* src, void* dst, CudaDType dtype, int64_t n, void* stream) {
  if (n <= 0) return Status::ok();
  return cuda_status(cuda::launch_from_f32(src, static_cast<uint16_t*>(dst), n, dtype == CudaDType::kBf16,
                                           static_cast<cudaStream_t>(stream)),
                     "the fp32 to 16-bit conversion kernel");
}

Status cuda_convert_to_f32(const void* src, CudaDType dtype, float* dst, int64_t n, void* stream) {
  if (n <= 0) return Status::ok();
  return cuda_status(cuda::launch_to_f32(static_cast<const uint16_t*>(src), dst, n, dtype == CudaDType::kBf16,
                                         static_cast<cudaStream_t>(stream)),
                     "the 16-bit to fp32 conversion kernel");
}

}  // namespace distca::kernels
