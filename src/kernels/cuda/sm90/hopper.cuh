// sm_90a (Hopper) primitives for the CA-task kernels: mbarriers, TMA box loads into swizzled shared
// memory, and wgmma (warpgroup matrix multiply-accumulate) with operands in shared memory named by
// matrix descriptors, or A in registers.
//
// Compiled by nvcc for sm_90a they are the PTX instructions. Compiled as host C++ they are the warp
// emulator's (tests/kernels/cuda_emu.cc), written from the PTX ISA's definitions so that tile
// algorithms built on them are checked against the reference without a GPU:
//   - swizzle: the 16-byte chunk bits [4, 4 + b) of a shared-memory byte address are XORed with its
//     bits [7, 7 + b), b = 1, 2, 3 for the 32, 64 and 128-byte modes (so a tile must start on a
//     multiple of 256, 512 or 1024 bytes for TMA and wgmma to agree on its layout);
//   - a TMA box load writes the box row after row (box_x elements a row) at the swizzled addresses,
//     zeros where the box leaves the tensor, and completes its bytes on an mbarrier. The emulator
//     applies the copy only when a thread waits on that mbarrier, so a read before the wait sees
//     stale shared memory, as it may on a GPU;
//   - an mbarrier counts arrivals and transaction bytes per phase; a phase completes when both reach
//     zero, and a wait on a phase that can never complete is reported (as a deadlock), not a hang;
//   - wgmma m64nNk16 (N = 64, 128): warp w of the warpgroup owns rows 16w..16w+15 of D; lane
//     (g = lane / 4, t = lane % 4) holds d[4j + i] = D[16w + g + 8 (i / 2)][8j + 2t + i % 2]. The
//     emulator computes a wgmma when its group is waited for (wgmma_wait), reading shared memory
//     then, so shared memory changed before the wait gives a wrong result, as on a GPU;
//   - shared-memory matrix descriptors: start address, leading and stride byte offsets (LBO, SBO)
//     and swizzle mode, laid out as CUTLASS's canonical GMMA layouts: for K-major operands (rows r
//     of M or N, k in [0, 16)), no swizzle: (r / 8) SBO + (k / 8) LBO + 16 (r % 8) + 2 (k % 8);
//     swizzle width W: (r / 8) SBO + W (r % 8) + 2 k. For MN-major ones (B transposed, x along N):
//     no swizzle: (x / 8) SBO + (k / 8) LBO + 2 (x % 8) + 16 (k % 8); swizzle width W:
//     (x / (W / 2)) LBO + (k / 8) SBO + 2 (x % (W / 2)) + W (k % 8).
#pragma once

#include <cstdint>

#include "../common/warp.cuh"

#if !defined(__CUDACC__)
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#endif

namespace distca::kernels::cuda {

enum class Swizzle : int { kNone = 0, k32B = 32, k64B = 64, k128B = 128 };

DISTCA_DEV uint32_t swizzle_bits(Swizzle s) {
  return s == Swizzle::k128B ? 3u : s == Swizzle::k64B ? 2u : s == Swizzle::k32B ? 1u : 0u;
}

// The physical byte address of logical shared-memory byte address `addr` under the swizzle.
DISTCA_DEV uint32_t swizzle_address(uint32_t addr, Swizzle s) {
  const uint32_t mask = (1u << swizzle_bits(s)) - 1u;
  return addr ^ (((addr >> 7) & mask) << 4);
}

// A TMA descriptor: on a GPU a CUtensorMap (128 bytes, 128-byte aligned, built on the host by the
// driver); in the emulator, TmaBox below in the same bytes.
struct alignas(128) TmaDesc {
  unsigned char bytes[128];
};

#if !defined(__CUDACC__)
// The emulator's reading of a TmaDesc: a 2-D tensor of 16-bit elements, row-major.
struct TmaBox {
  const void* global = nullptr;
  int64_t dim_x = 0, dim_y = 0;   // elements a row, rows
  int64_t row_stride_bytes = 0;   // a multiple of 16
  int box_x = 0, box_y = 0;       // the box: elements a row (box_x * 2 <= the swizzle width), rows
  Swizzle swizzle = Swizzle::kNone;
};
static_assert(sizeof(TmaBox) <= sizeof(TmaDesc));
TmaDesc make_tma_desc(const TmaBox& box);  // the emulator's descriptor

namespace emu {
// When the emulator performs a TMA copy: as late as a GPU may (when a thread waits on its
// mbarrier: a read before the wait sees stale bytes) or as early (at issue: a stage the producer
// overwrites while a consumer still reads it shows). A correct kernel gives the same under both.
enum class TmaTiming { kLatest, kEarliest };
void set_tma_timing(TmaTiming timing);  // for the following run_block calls (default kLatest)
// Which thread runs next: in turn (round robin), or the lowest-numbered one that can, after any
// progress (so one warp runs as far ahead of the others as it may: a missing barrier between
// threads that write shared memory and a wgmma that reads it shows).
enum class Schedule { kRoundRobin, kLowestFirst };
void set_schedule(Schedule schedule);   // for the following run_block calls (default kRoundRobin)
char* shared_base();             // the block's shared memory (run_block's `shared`)
void yield_spinning();           // a spin-wait's turn: lets the other threads run
void mbar_init(uint64_t* bar, int arrivals);
void mbar_arrive(uint64_t* bar, uint32_t expect_tx_bytes);
void mbar_wait(uint64_t* bar, int parity);
void tma_load_2d(void* smem, const TmaDesc& desc, int x, int y, uint64_t* bar);
void sync_warpgroup();
void named_barrier(int id, int count, bool wait);
void wgmma_issue(std::function<void()> apply);  // queued in this thread's open group
void wgmma_commit();
void wgmma_wait(int pending);
}  // namespace emu
#endif

// A shared-memory pointer as the 32-bit shared-window address PTX instructions take.
DISTCA_DEV uint32_t smem_address(const void* p) {
#if defined(__CUDACC__)
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  return static_cast<uint32_t>(static_cast<const char*>(p) - emu::shared_base());
#endif
}

// This thread's warpgroup, as a value the compiler knows is the same across the warp (so code
// branching on it is not divergent, and wgmma inside needs no serialisation).
DISTCA_DEV int warpgroup_index() {
#if defined(__CUDACC__)
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
#else
  return thread_index() / 128;
#endif
}

// The 128 threads of this thread's warpgroup wait for each other (named barrier 1 + warpgroup).
DISTCA_DEV void warpgroup_sync() {
#if defined(__CUDACC__)
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + static_cast<int>(threadIdx.x / 128)) : "memory");
#else
  emu::sync_warpgroup();
#endif
}

// Named barrier `id` among `count` threads (a multiple of 32; ids 1-3 are warpgroup_sync's):
// named_barrier_sync arrives and waits until `count` threads have arrived, named_barrier_arrive
// arrives and goes on (PTX bar.sync / bar.arrive). Two warpgroups take turns on the tensor cores
// with them (FlashAttention-3's ping-pong): each waits on its own barrier and arrives on the
// other's. The emulator reports a barrier left with arrivals when the block ends.
DISTCA_DEV void named_barrier_sync(int id, int count) {
#if defined(__CUDACC__)
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#else
  emu::named_barrier(id, count, true);
#endif
}
DISTCA_DEV void named_barrier_arrive(int id, int count) {
#if defined(__CUDACC__)
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#else
  emu::named_barrier(id, count, false);
#endif
}

// ---------------------------------------------------------------------------------------------
// mbarrier (a 64-bit object in shared memory).

DISTCA_DEV void mbarrier_init(uint64_t* bar, int arrivals) {
#if defined(__CUDACC__)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals));
#else
  emu::mbar_init(bar, arrivals);
#endif
}

// Makes the barriers' initialisation visible to the async proxy (TMA); then a block barrier.
DISTCA_DEV void fence_barrier_init() {
#if defined(__CUDACC__)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

DISTCA_DEV void mbarrier_arrive(uint64_t* bar) {
#if defined(__CUDACC__)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
#else
  emu::mbar_arrive(bar, 0);
#endif
}

// Arrives and expects `bytes` more transaction bytes (a TMA load's) in the current phase.
DISTCA_DEV void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDACC__)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#else
  emu::mbar_arrive(bar, bytes);
#endif
}

// Waits until the phase of parity `parity` has completed.
DISTCA_DEV void mbarrier_wait(uint64_t* bar, int parity) {
#if defined(__CUDACC__)
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
#else
  emu::mbar_wait(bar, parity);
#endif
}

// Makes this thread's ordinary shared-memory stores visible to the async proxy (wgmma and TMA read
// through it); then a barrier among the threads that wrote.
DISTCA_DEV void fence_proxy_async() {
#if defined(__CUDACC__)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// TMA: a 2-D box at element (x, y) of the descriptor's tensor into shared memory, completing its
// bytes on `bar` (the issuing thread arrives with mbarrier_arrive_expect_tx for them).
DISTCA_DEV void tma_load_2d(void* smem, const TmaDesc* desc, int x, int y, uint64_t* bar) {
#if defined(__CUDACC__)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_address(smem)),
      "l"(desc), "r"(smem_address(bar)), "r"(x), "r"(y)
      : "memory");
#else
  emu::tma_load_2d(smem, *desc, x, y, bar);
#endif
}

// Two tiles (say K and V) of `boxes` 64-column boxes each, box_bytes apart in shared memory: the
// views' rows from `row`, columns from `col`, all completing on `bar` (which expects their bytes).
DISTCA_DEV void tma_load_pair(char* a, const TmaDesc* a_desc, char* b, const TmaDesc* b_desc, int boxes, int box_bytes,
                              int col, int row, uint64_t* bar) {
  mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(2 * boxes * box_bytes));
  for (int c = 0; c < boxes; ++c) {
    tma_load_2d(a + c * box_bytes, a_desc, col + 64 * c, row, bar);
    tma_load_2d(b + c * box_bytes, b_desc, col + 64 * c, row, bar);
  }
}

// The barriers of a block that loads one pair of tiles once and streams pairs through a two-stage
// ring (the backward passes): `once` completes on the first pair's bytes, full[s] on stage s's,
// and empty[s] when the consumer releases stage s (one arrival). init_pair_ring: thread 0 sets
// them up, then the block syncs.
struct PairRingBarriers {
  uint64_t once;
  uint64_t full[2], empty[2];
};
DISTCA_DEV void init_pair_ring(PairRingBarriers* b) {
  if (thread_index() == 0) {
    mbarrier_init(&b->once, 1);
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&b->full[s], 1);
      mbarrier_init(&b->empty[s], 1);
    }
    fence_barrier_init();
  }
  sync_block();
}

// ---------------------------------------------------------------------------------------------
// wgmma.

// The shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride dimension byte offsets (each >> 4, 14 bits), swizzle mode in bits 62-63
// (0 none, 1 128 B, 2 64 B, 3 32 B); the base offset (bits 49-51) is 0: tiles start aligned.
DISTCA_DEV uint64_t make_smem_desc(uint32_t smem_addr, Swizzle s, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint64_t mode = s == Swizzle::k128B ? 1 : s == Swizzle::k64B ? 2 : s == Swizzle::k32B ? 3 : 0;
  return static_cast<uint64_t>((smem_addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>((lbo_bytes & 0x3ffffu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3ffffu) >> 4) << 32) | (mode << 62);
}

#if !defined(__CUDACC__)
namespace emu {
struct SmemDesc {
  uint32_t start = 0, lbo = 0, sbo = 0;
  Swizzle swizzle = Swizzle::kNone;
};
inline SmemDesc decode_smem_desc(uint64_t d) {
  SmemDesc s;
  s.start = static_cast<uint32_t>(d & 0x3fff) << 4;
  s.lbo = static_cast<uint32_t>((d >> 16) & 0x3fff) << 4;
  s.sbo = static_cast<uint32_t>((d >> 32) & 0x3fff) << 4;
  const int mode = static_cast<int>(d >> 62);
  s.swizzle = mode == 1 ? Swizzle::k128B : mode == 2 ? Swizzle::k64B : mode == 3 ? Swizzle::k32B : Swizzle::kNone;
  return s;
}
// The byte address of element (row or x, k) of an operand, as the header comment lays them out.
inline uint32_t operand_address(const SmemDesc& s, int x, int k, bool mn_major) {
  const uint32_t w = static_cast<uint32_t>(s.swizzle);
  uint32_t a;
  if (!mn_major) {
    a = s.swizzle == Swizzle::kNone ? (x / 8) * s.sbo + (k / 8) * s.lbo + 16 * (x % 8) + 2 * (k % 8)
                                    : (x / 8) * s.sbo + w * (x % 8) + 2 * k;
  } else {
    a = s.swizzle == Swizzle::kNone ? (x / 8) * s.sbo + (k / 8) * s.lbo + 2 * (x % 8) + 16 * (k % 8)
                                    : (x / (w / 2)) * s.lbo + (k / 8) * s.sbo + 2 * (x % (w / 2)) + w * (k % 8);
  }
  return swizzle_address(s.start + a, s.swizzle);
}
template <typename Elt>
inline float operand_at(const SmemDesc& s, int x, int k, bool mn_major) {
  uint16_t e;
  std::memcpy(&e, shared_base() + operand_address(s, x, k, mn_major), 2);
  return to_float(e, Elt{});
}
// Queues D (+)= A B for this thread's fragment; A(m, k) gives the A operand at apply time.
template <int N, typename Elt, typename AFn>
inline void wgmma_queue(float* d, AFn a_at, uint64_t desc_b, bool trans_b, bool scale_d) {
  const int tid = thread_index() % 128, w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  const SmemDesc b = decode_smem_desc(desc_b);
  wgmma_issue([=] {
    for (int j = 0; j < N / 8; ++j) {
      for (int i = 0; i < 4; ++i) {
        const int m = 16 * w + g + 8 * (i / 2), n = 8 * j + 2 * t + i % 2;
        float sum = 0;
        for (int k = 0; k < 16; ++k) sum += a_at(m, k) * operand_at<Elt>(b, n, k, trans_b);
        d[4 * j + i] = (scale_d ? d[4 * j + i] : 0.f) + sum;
      }
    }
  });
}
}  // namespace emu
#endif

#if defined(__CUDACC__)
#define DISTCA_WGMMA_SS_N64(TAG, TY)                                                             \
  template <int TransB>                                                                            \
  DISTCA_DEV void wgmma_ss_dev(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d, TAG) { \
    asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 " \
      "}, %32, %33, p, 1, 1, 0, %35;\n}\n"                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TransB));                                      \
  }
#define DISTCA_WGMMA_RS_N64(TAG, TY)                                                             \
  template <int TransB>                                                                            \
  DISTCA_DEV void wgmma_rs_dev(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d, TAG) { \
    asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 " \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TransB));      \
  }
#define DISTCA_WGMMA_SS_N128(TAG, TY)                                                             \
  template <int TransB>                                                                            \
  DISTCA_DEV void wgmma_ss_dev(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d, TAG) { \
    asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 " \
      "}, %64, %65, p, 1, 1, 0, %67;\n}\n"                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TransB));                                      \
  }
#define DISTCA_WGMMA_RS_N128(TAG, TY)                                                             \
  template <int TransB>                                                                            \
  DISTCA_DEV void wgmma_rs_dev(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d, TAG) { \
    asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 " \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TransB));      \
  }
// The accumulator registers of m64nNk16 (N / 2 floats a thread) are spelled out for N 64 and 128;
// bf16 and fp16 differ only in the PTX type name.
DISTCA_WGMMA_SS_N64(Bf16, "bf16")
DISTCA_WGMMA_SS_N64(Fp16, "f16")
DISTCA_WGMMA_RS_N64(Bf16, "bf16")
DISTCA_WGMMA_RS_N64(Fp16, "f16")
DISTCA_WGMMA_SS_N128(Bf16, "bf16")
DISTCA_WGMMA_SS_N128(Fp16, "f16")
DISTCA_WGMMA_RS_N128(Bf16, "bf16")
DISTCA_WGMMA_RS_N128(Fp16, "f16")
#undef DISTCA_WGMMA_SS_N64
#undef DISTCA_WGMMA_RS_N64
#undef DISTCA_WGMMA_SS_N128
#undef DISTCA_WGMMA_RS_N128

#endif

// Orders this thread's earlier register and shared-memory accesses before its next wgmma (not a
// barrier among threads: shared memory other threads wrote needs warpgroup_sync as well).
DISTCA_DEV void wgmma_fence() {
#if defined(__CUDACC__)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
DISTCA_DEV void wgmma_commit() {
#if defined(__CUDACC__)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  emu::wgmma_commit();
#endif
}
// Waits until at most N of this thread's committed wgmma groups are pending.
template <int N>
DISTCA_DEV void wgmma_wait() {
#if defined(__CUDACC__)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  emu::wgmma_wait(N);
#endif
}

// D[64 x N] (+)= A[64 x 16] B[16 x N], A and B in shared memory (A K-major; B K-major, or MN-major
// with TransB = 1). scale_d 0 overwrites D. One per warpgroup (all 128 threads).
template <int TransB, int N, typename Elt>
DISTCA_DEV void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d, Elt tag) {
#if defined(__CUDACC__)
  wgmma_ss_dev<TransB>(d, desc_a, desc_b, scale_d, tag);
#else
  (void)tag;
  const emu::SmemDesc a = emu::decode_smem_desc(desc_a);
  emu::wgmma_queue<N, Elt>(d, [a](int m, int k) { return emu::operand_at<Elt>(a, m, k, false); }, desc_b,
                           TransB != 0, scale_d != 0);
#endif
}

// The same with A in registers: each warp's 16 rows as the mma.m16n8k16 A fragment (warp.cuh):
// a[0] = A[g][2t..], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..], rows of warp w
// offset by 16w.
template <int TransB, int N, typename Elt>
DISTCA_DEV void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d, Elt tag) {
#if defined(__CUDACC__)
  wgmma_rs_dev<TransB>(d, a, desc_b, scale_d, tag);
#else
  (void)tag;
  // The warp's A tile, read from the lanes' registers now (they must not change before the wait).
  auto tile = std::make_shared<std::array<float, 256>>();
  const int w = (thread_index() % 128) / 32;
  emu::warp_collective(a, 4, [&](const emu::Exchange& x) {
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 16; ++k) {
        const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), lane = (r % 8) * 4 + (k % 8) / 2;
        const uint32_t word = x.lanes[lane][reg];
        (*tile)[r * 16 + k] = to_float(static_cast<uint16_t>(k % 2 ? word >> 16 : word & 0xffffu), Elt{});
      }
    }
  });
  emu::wgmma_queue<N, Elt>(d, [tile, w](int m, int k) { return (*tile)[(m - 16 * w) * 16 + k]; }, desc_b, TransB != 0,
                           scale_d != 0);
#endif
}

}  // namespace distca::kernels::cuda
