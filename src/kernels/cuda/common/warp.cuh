// The warp-level primitives the attention kernels are written in: tensor-core mma.sync m16n8k16,
// ldmatrix (plain and transposed), cp.async, shuffles and barriers.
//
// Compiled by nvcc (device code) they are the PTX instructions themselves. Compiled as host C++
// (no __CUDACC__) they are the host warp emulator's (emu.h): each CUDA thread of a block is a
// fiber, and every warp-collective instruction moves data between lanes exactly as the PTX ISA's
// fragment layouts say. That is what lets the kernels' tile algorithms, fragment layouts and
// masking be tested on a machine without a GPU (tests/kernels/cuda_host_test.cc).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DISTCA_DEV __device__ __forceinline__
#else
#include "distca/core/bf16.h"
#define DISTCA_DEV inline
#endif

namespace distca::kernels::cuda {

// Storage element tags; elements are moved as raw 16-bit words.
struct Bf16 {};
struct Fp16 {};

#if !defined(__CUDACC__)
// The host emulator's side (tests/kernels/cuda_emu.cc): the running fiber's identity and barriers.
namespace emu {
int thread_index();
int64_t block_index();
void sync_block();
void sync_warp();
uint32_t* lane_slot(int lane);  // lane `lane` of the running thread's warp: 8 exchange words
struct Exchange {
  const uint32_t* lanes[32];
};
// Every lane deposits `in` (n <= 8 words); after all 32 have, fn reads the deposits (lanes[l] is
// lane l's); the next collective starts only after every lane has read.
template <typename Fn>
void warp_collective(const uint32_t* in, int n, Fn&& fn) {
  std::memcpy(lane_slot(thread_index() & 31), in, static_cast<size_t>(n) * 4);
  sync_warp();
  Exchange x;
  for (int l = 0; l < 32; ++l) x.lanes[l] = lane_slot(l);
  fn(x);
  sync_warp();
}
}  // namespace emu
#endif

DISTCA_DEV int thread_index() {
#if defined(__CUDACC__)
  return static_cast<int>(threadIdx.x);
#else
  return emu::thread_index();
#endif
}
DISTCA_DEV int64_t block_index() {
#if defined(__CUDACC__)
  return static_cast<int64_t>(blockIdx.x);
#else
  return emu::block_index();
#endif
}
DISTCA_DEV int lane_index() { return thread_index() & 31; }
DISTCA_DEV int warp_index() { return thread_index() >> 5; }

DISTCA_DEV void sync_block() {
#if defined(__CUDACC__)
  __syncthreads();
#else
  emu::sync_block();
#endif
}

// Two floats to a packed pair of 16-bit elements (lo in the low half), rounding to nearest even.
DISTCA_DEV uint32_t pack2(float lo, float hi, Bf16) {
#if defined(__CUDACC__)
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
#else
  return static_cast<uint32_t>(distca::bf16::round_bits(lo)) | (static_cast<uint32_t>(distca::bf16::round_bits(hi)) << 16);
#endif
}
DISTCA_DEV uint32_t pack2(float lo, float hi, Fp16) {
#if defined(__CUDACC__)
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
#else
  const _Float16 a = static_cast<_Float16>(lo), b = static_cast<_Float16>(hi);
  uint16_t ua, ub;
  std::memcpy(&ua, &a, 2);
  std::memcpy(&ub, &b, 2);
  return static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
#endif
}
DISTCA_DEV float to_float(uint16_t x, Bf16) {
#if defined(__CUDACC__)
  return __uint_as_float(static_cast<uint32_t>(x) << 16);
#else
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
DISTCA_DEV float to_float(uint16_t x, Fp16) {
#if defined(__CUDACC__)
  return __half2float(__ushort_as_half(x));
#else
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
#endif
}

DISTCA_DEV float exp2_approx(float x) {
#if defined(__CUDACC__)
  return exp2f(x);
#else
  return std::exp2(x);
#endif
}

DISTCA_DEV float shfl_xor(float v, int mask) {
#if defined(__CUDACC__)
  return __shfl_xor_sync(0xffffffffu, v, mask);
#else
  uint32_t in;
  std::memcpy(&in, &v, 4);
  float out = 0;
  const int lane = lane_index();
  emu::warp_collective(&in, 1, [&](const emu::Exchange& x) { std::memcpy(&out, x.lanes[lane ^ mask], 4); });
  return out;
#endif
}

// D = A B + C on a 16x16 (A, row-major) by 16x8 (B, column-major) tile, fp32 accumulators.
// Fragments (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// (two 16-bit elements per register, the lower index in the low half).
#if !defined(__CUDACC__)
namespace emu {
template <typename Elt>
inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], Elt) {
  uint32_t in[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const int lane = lane_index(), g = lane / 4, t = lane % 4;
  float out[4];
  warp_collective(in, 6, [&](const Exchange& x) {
    auto half = [](uint32_t word, int which) { return static_cast<uint16_t>(which ? word >> 16 : word & 0xffffu); };
    auto a_at = [&](int r, int k) {  // A[r][k]
      const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int l = (r % 8) * 4 + (k % 8) / 2;
      return to_float(half(x.lanes[l][reg], k % 2), Elt{});
    };
    auto b_at = [&](int k, int n) {  // B[k][n]
      const int reg = k >= 8 ? 1 : 0;
      const int l = n * 4 + (k % 8) / 2;
      return to_float(half(x.lanes[l][4 + reg], k % 2), Elt{});
    };
    for (int i = 0; i < 4; ++i) {
      const int r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i % 2);
      float sum = 0;
      for (int k = 0; k < 16; ++k) sum += a_at(r, k) * b_at(k, n);
      out[i] = c[i] + sum;
    }
  });
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}
}  // namespace emu
#endif

DISTCA_DEV void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], Bf16 tag) {
#if defined(__CUDACC__)
  (void)tag;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  emu::mma_16816(c, a, b, tag);
#endif
}
DISTCA_DEV void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], Fp16 tag) {
#if defined(__CUDACC__)
  (void)tag;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  emu::mma_16816(c, a, b, tag);
#endif
}

// ldmatrix .x4: four 8x8 matrices of 16-bit elements from shared memory. Lane l gives the address
// of row l % 8 of matrix l / 8 (16 contiguous bytes). Lane l receives, in r[i], row l / 4 of
// matrix i, elements 2 (l % 4) and 2 (l % 4) + 1; with `trans`, the transpose: elements
// [2 (l % 4)][l / 4] and [2 (l % 4) + 1][l / 4] of matrix i (rows as addressed).
#if !defined(__CUDACC__)
namespace emu {
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row, bool trans) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(smem_row);
  const uint32_t in[2] = {static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32)};
  const int lane = lane_index();
  warp_collective(in, 2, [&](const Exchange& x) {
    auto row_of = [&](int matrix, int row) {  // the address lane matrix * 8 + row gave
      const uint32_t* w = x.lanes[matrix * 8 + row];
      return reinterpret_cast<const char*>(static_cast<uintptr_t>(w[0]) | (static_cast<uintptr_t>(w[1]) << 32));
    };
    for (int i = 0; i < 4; ++i) {
      if (!trans) {
        std::memcpy(&r[i], row_of(i, lane / 4) + 4 * (lane % 4), 4);
        continue;
      }
      uint16_t e[2];
      for (int j = 0; j < 2; ++j) std::memcpy(&e[j], row_of(i, 2 * (lane % 4) + j) + 2 * (lane / 4), 2);
      r[i] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
    }
  });
}
}  // namespace emu
#endif

DISTCA_DEV void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDACC__)
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#else
  emu::ldmatrix_x4(r, smem_row, false);
#endif
}
DISTCA_DEV void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDACC__)
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#else
  emu::ldmatrix_x4(r, smem_row, true);
#endif
}

// cp.async of 16 bytes global -> shared; `valid` false writes 16 zero bytes and reads nothing.
DISTCA_DEV void cp_async_16(void* smem, const void* global, bool valid) {
#if defined(__CUDACC__)
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(bytes));
#else
  if (valid) {
    std::memcpy(smem, global, 16);
  } else {
    std::memset(smem, 0, 16);
  }
#endif
}
DISTCA_DEV void cp_async_commit() {
#if defined(__CUDACC__)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
DISTCA_DEV void cp_async_wait() {
#if defined(__CUDACC__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

DISTCA_DEV void atomic_add(float* address, float value) {
#if defined(__CUDACC__)
  atomicAdd(address, value);
#else
  *address += value;  // the emulator runs one fiber at a time
#endif
}

}  // namespace distca::kernels::cuda
