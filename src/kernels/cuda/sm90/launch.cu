// The sm_90a forward and backward kernels (hopper_fwd.cuh, hopper_bwd.cuh) and their launchers.
// The TMA descriptors are built here on the host by the driver's cuTensorMapEncodeTiled, reached
// through cudaGetDriverEntryPointByVersion so that the static CUDA runtime stays the only CUDA
// library linked. The grid is persistent: one block per SM walks the (item, head) pairs in the
// schedule's heaviest-first order. Compiled for every architecture of the build; the kernels'
// bodies exist only in the sm_90a one.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "hopper_bwd.cuh"
#include "hopper_bwd_dq.cuh"
#include "hopper_fwd.cuh"
#include "launch.h"

namespace distca::kernels::cuda {
namespace {

static_assert(sizeof(CUtensorMap) == sizeof(TmaDesc) && alignof(CUtensorMap) <= alignof(TmaDesc));
static_assert(HopperFwdShape<64>::kBlockM == kHopperFwdBlockM && HopperFwdShape<128>::kBlockM == kHopperFwdBlockM);
static_assert(HopperBwdShape<64>::kBlockN == kHopperBwdBlockN && HopperBwdShape<128>::kBlockN == kHopperBwdBlockN);
static_assert(HopperBwdShape<64>::kBlockM == HopperBwdShape<128>::kBlockM);
static_assert(HopperBwdDqShape<64>::kBlockM == kHopperBwdDqBlockM && HopperBwdDqShape<128>::kBlockM == kHopperBwdDqBlockM);

// What a persistent kernel runs: the block function of one pass, its parameters and shape.
template <int D, typename Elt>
struct FwdPass {
  using Params = HopperFwdParams;
  using Shape = HopperFwdShape<D>;
  static DISTCA_HOST_DEVICE int64_t work_items(const Params& p) { return p.num_items * p.num_q_heads; }
  static DISTCA_DEV void block(const Params& p, char* smem, int64_t work) { hopper_fwd_block<D, Elt>(p, smem, work); }
};
template <int D, typename Elt>
struct BwdPass {
  using Params = HopperBwdParams;
  using Shape = HopperBwdShape<D>;
  static DISTCA_HOST_DEVICE int64_t work_items(const Params& p) { return p.num_items * p.num_kv_heads; }
  static DISTCA_DEV void block(const Params& p, char* smem, int64_t work) { hopper_bwd_block<D, Elt>(p, smem, work); }
};

template <int D, typename Elt>
struct BwdNoDqPass {  // the K/V blocks when dQ has a pass of its own
  using Params = HopperBwdParams;
  using Shape = HopperBwdShape<D>;
  static DISTCA_HOST_DEVICE int64_t work_items(const Params& p) { return p.num_items * p.num_kv_heads; }
  static DISTCA_DEV void block(const Params& p, char* smem, int64_t work) { hopper_bwd_block<D, Elt, false>(p, smem, work); }
};
template <int D, typename Elt>
struct BwdDqPass {
  using Params = HopperBwdDqParams;
  using Shape = HopperBwdDqShape<D>;
  static DISTCA_HOST_DEVICE int64_t work_items(const Params& p) { return p.num_items * p.num_q_heads; }
  static DISTCA_DEV void block(const Params& p, char* smem, int64_t work) { hopper_bwd_dq_block<D, Elt>(p, smem, work); }
};

// One block per SM walks the (item, head) pairs (a forward item per query head, a backward K/V tile
// per K/V head); the next item initialises the barriers again.
template <typename Pass>
__global__ void __launch_bounds__(Pass::Shape::kThreads, 1)
    hopper_kernel(const __grid_constant__ typename Pass::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  // The 128-byte swizzle's pattern repeats every 1024 bytes: tiles start on such a boundary.
  const uint32_t base = smem_address(smem_raw);
  char* smem = smem_raw + ((1024 - base % 1024) % 1024);
  const int64_t work_items = Pass::work_items(p);
  for (int64_t work = blockIdx.x; work < work_items; work += gridDim.x) {
    Pass::block(p, smem, work);
    __syncthreads();
  }
#endif
}

template <typename Pass>
cudaError_t launch_pass(const typename Pass::Params& p, int sms, cudaStream_t stream) {
  constexpr int kSmem = Pass::Shape::kSmemBytes + 1024;
  static const cudaError_t allowed =
      cudaFuncSetAttribute(hopper_kernel<Pass>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (allowed != cudaSuccess) return allowed;
  const int64_t work_items = Pass::work_items(p);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(work_items, std::max(sms, 1)));
  hopper_kernel<Pass><<<blocks, Pass::Shape::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <template <int, typename> class Pass>
cudaError_t launch_for(const typename Pass<64, Bf16>::Params& p, int head_dim, bool is_bf16, int sms,
                       cudaStream_t stream) {
  if (head_dim == 64) {
    return is_bf16 ? launch_pass<Pass<64, Bf16>>(p, sms, stream) : launch_pass<Pass<64, Fp16>>(p, sms, stream);
  }
  return is_bf16 ? launch_pass<Pass<128, Bf16>>(p, sms, stream) : launch_pass<Pass<128, Fp16>>(p, sms, stream);
}

// A 2-D view [rows, heads x D] of a packed tensor, boxes of 64 elements (128 bytes, the swizzle
// width) by box_rows rows, zeros past the end.
cudaError_t encode_view(TmaDesc& out, const void* base, int64_t rows, int64_t heads, int head_dim, bool is_bf16,
                        uint32_t box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                                           12000, cudaEnableDefault, &found);
    if (e != cudaSuccess) return e;
    if (found != cudaDriverEntryPointSuccess || !encode) return cudaErrorNotSupported;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(heads * head_dim),
                              static_cast<cuuint64_t>(std::max<int64_t>(rows, 1))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(heads * head_dim * 2)};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  CUtensorMap map;
  const CUresult r = encode(&map, is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                            const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  std::memcpy(out.bytes, &map, sizeof map);
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_hopper_fwd(const HopperFwdLaunch& l, cudaStream_t stream) {
  HopperFwdParams p;
  for (cudaError_t e : {encode_view(p.q_desc, l.q, l.num_q_rows, l.num_q_heads, l.head_dim, l.is_bf16, 128),
                        encode_view(p.k_desc, l.k, l.num_kv_rows, l.num_kv_heads, l.head_dim, l.is_bf16, 128),
                        encode_view(p.v_desc, l.v, l.num_kv_rows, l.num_kv_heads, l.head_dim, l.is_bf16, 128)}) {
    if (e != cudaSuccess) return e;
  }
  p.o = l.o;
  p.lse = l.lse;
  p.items = l.items;
  p.num_items = l.num_items;
  p.num_q_heads = l.num_q_heads;
  p.num_kv_heads = l.num_kv_heads;
  p.scale_log2 = l.scale_log2;
  return launch_for<FwdPass>(p, l.head_dim, l.is_bf16, l.num_sms, stream);
}

cudaError_t launch_hopper_bwd(const HopperBwdLaunch& l, cudaStream_t stream) {
  HopperBwdParams p;
  for (cudaError_t e : {encode_view(p.q_desc, l.q, l.num_q_rows, l.num_q_heads, l.head_dim, l.is_bf16, 64),
                        encode_view(p.do_desc, l.d_o, l.num_q_rows, l.num_q_heads, l.head_dim, l.is_bf16, 64),
                        encode_view(p.k_desc, l.k, l.num_kv_rows, l.num_kv_heads, l.head_dim, l.is_bf16, 64),
                        encode_view(p.v_desc, l.v, l.num_kv_rows, l.num_kv_heads, l.head_dim, l.is_bf16, 64)}) {
    if (e != cudaSuccess) return e;
  }
  p.lse = l.lse;
  p.delta = l.delta;
  p.dq_acc = l.dq_items ? nullptr : l.dq_acc;
  p.dk_acc = l.dk_acc;
  p.dv_acc = l.dv_acc;
  p.items = l.items;
  p.entries = l.entries;
  p.num_items = l.num_items;
  p.num_q_heads = l.num_q_heads;
  p.num_kv_heads = l.num_kv_heads;
  p.scale_log2 = l.scale_log2;
  if (p.num_items > 0) {
    const cudaError_t e = l.dq_items ? launch_for<BwdNoDqPass>(p, l.head_dim, l.is_bf16, l.num_sms, stream)
                                     : launch_for<BwdPass>(p, l.head_dim, l.is_bf16, l.num_sms, stream);
    if (e != cudaSuccess) return e;
  }
  if (!l.dq_items || l.num_dq_items == 0) return cudaSuccess;
  // dQ's own pass: the same views (64-row boxes), query tiles instead of K/V tiles.
  HopperBwdDqParams dq;
  dq.q_desc = p.q_desc;
  dq.do_desc = p.do_desc;
  dq.k_desc = p.k_desc;
  dq.v_desc = p.v_desc;
  dq.lse = l.lse;
  dq.delta = l.delta;
  dq.dq_acc = l.dq_acc;
  dq.items = l.dq_items;
  dq.num_items = l.num_dq_items;
  dq.num_q_heads = l.num_q_heads;
  dq.num_kv_heads = l.num_kv_heads;
  dq.scale_log2 = l.scale_log2;
  return launch_for<BwdDqPass>(dq, l.head_dim, l.is_bf16, l.num_sms, stream);
}

}  // namespace distca::kernels::cuda
