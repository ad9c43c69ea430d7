// The sm_90a backward tile algorithm over a CA-task list, in hopper.cuh's primitives: one block of
// two warpgroups serves one schedule item (a 64-key tile of a task, bwd_schedule(tasks, 64), as the
// sm_80 kernel's) for one query head, and walks the task's query rows that see those keys, 64 at a
// time.
//
//   - Warpgroup 0 is the producer: its first thread loads the item's K and V tiles once, then the
//     query tiles' Q and dO by TMA into a two-stage ring (128-byte swizzle), behind "full" and
//     "empty" mbarriers.
//   - Warpgroup 1 computes, per query tile:
//     - S = Q K^T and dP = dO V^T by wgmma from shared memory;
//     - P = exp2(S scale log2(e) - LSE log2(e)), masked, and dS = P (dP - delta) in registers;
//     - P^T and dS^T go to shared memory (K-major, swizzled), where they are the A operands of
//       dV += P^T dO and dK += dS^T Q (dO and Q read MN-major). dV and dK stay in fp32 registers
//       for the whole walk;
//     - dQ += dS K with dS straight from the registers, in 64-column halves of D, added to the fp32
//       sums (atomics).
//   - At the end, dK and dV are added to their fp32 sums (atomics: tasks sharing K/V rows add into
//     the same rows).
//
// Inputs and outputs are the sm_80 kernel's (flash_bwd.cuh): lse (natural log), delta =
// rowsum(dO O) - dLSE, zeroed fp32 sums dq_acc, dk_acc and dv_acc; the softmax scale of dQ and dK is
// applied when the sums are rounded.
//
// Shared memory, 1024-byte aligned: the barriers, K and V (64 keys), two stages of Q and dO
// (64 rows), then P^T and dS^T (64 keys x 64 queries, one 128-byte row a key). Every tile of D
// columns is D / 64 boxes of 64 rows x 128 bytes (8 KB), 8-row groups 1024 bytes apart.
#pragma once

#include <cstdint>

#include "hopper.cuh"
#include "schedule.h"

namespace distca::kernels::cuda {

struct HopperBwdParams {
  TmaDesc q_desc, k_desc, v_desc, do_desc;  // 2-D views [rows, heads * D], boxes of 64 x 64 rows
  const float* lse = nullptr;               // [Tq, Hq]
  const float* delta = nullptr;             // [Tq, Hq]
  float* dq_acc = nullptr;                  // [Tq, Hq, D]
  float* dk_acc = nullptr;                  // [Tkv, Hkv, D]
  float* dv_acc = nullptr;
  const BwdItem* items = nullptr;           // bwd_schedule(tasks, HopperBwdShape::kBlockN)
  int64_t num_items = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  float scale_log2 = 0;
};

template <int D>
struct HopperBwdShape {
  static constexpr int kBlockN = 64;    // keys an item
  static constexpr int kBlockM = 64;    // query rows a step
  static constexpr int kThreads = 256;  // producer + one compute warpgroup
  static constexpr int kBoxes = D / 64;
  static constexpr int kBoxBytes = 64 * 128;           // 64 rows of one 64-column box
  static constexpr int kTileBytes = kBoxes * kBoxBytes;  // 64 rows x D
  static constexpr int kKOffset = 1024;
  static constexpr int kVOffset = kKOffset + kTileBytes;
  static constexpr int kQOffset = kVOffset + kTileBytes;    // stage s: + 2 s kTileBytes (Q), + kTileBytes (dO)
  static constexpr int kPtOffset = kQOffset + 4 * kTileBytes;
  static constexpr int kDstOffset = kPtOffset + kBoxBytes;
  static constexpr int kSmemBytes = kDstOffset + kBoxBytes;  // + 1024 for aligning the base
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
};

struct HopperBwdBarriers {
  uint64_t kv_full;
  uint64_t q_full[2], q_empty[2];
};

// The byte offset of element (row, col) of a 64 x 64 tile of 16-bit elements stored K-major with
// 128-byte rows under the 128-byte swizzle (the tile 1024-byte aligned).
DISTCA_DEV uint32_t swizzled_64x64(uint32_t tile, int row, int col) {
  return swizzle_address(tile + static_cast<uint32_t>(row / 8 * 1024 + row % 8 * 128 + col * 2), Swizzle::k128B) - tile;
}

template <int D, typename Elt>
DISTCA_DEV void hopper_bwd_block(const HopperBwdParams& p, char* smem, int64_t work) {
  using S = HopperBwdShape<D>;
  constexpr float kLog2e = 1.4426950408889634f;
  const BwdItem item = p.items[work / p.num_q_heads];
  const int h = static_cast<int>(work % p.num_q_heads);
  const int hk = h / (p.num_q_heads / p.num_kv_heads);
  auto* bars = reinterpret_cast<HopperBwdBarriers*>(smem);
  char* sk = smem + S::kKOffset;
  char* sv = smem + S::kVOffset;
  auto sq = [&](int stage) { return smem + S::kQOffset + 2 * stage * S::kTileBytes; };
  auto sdo = [&](int stage) { return sq(stage) + S::kTileBytes; };
  char* spt = smem + S::kPtOffset;
  char* sdst = smem + S::kDstOffset;
  const int num_tiles = (item.q_len - item.q_begin + S::kBlockM - 1) / S::kBlockM;
  const int tid = thread_index(), group = warpgroup_index();

  if (tid == 0) {
    mbarrier_init(&bars->kv_full, 1);
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&bars->q_full[s], 1);
      mbarrier_init(&bars->q_empty[s], 1);
    }
    fence_barrier_init();
  }
  sync_block();

  if (group == 0) {  // the producer
    if (tid == 0) {
      const int q_col = h * D, kv_col = hk * D;
      mbarrier_arrive_expect_tx(&bars->kv_full, 2 * S::kTileBytes);
      for (int c = 0; c < S::kBoxes; ++c) {
        tma_load_2d(sk + c * S::kBoxBytes, &p.k_desc, kv_col + 64 * c, static_cast<int>(item.kv_row), &bars->kv_full);
        tma_load_2d(sv + c * S::kBoxBytes, &p.v_desc, kv_col + 64 * c, static_cast<int>(item.kv_row), &bars->kv_full);
      }
      for (int step = 0; step < S::kBoxes * num_tiles; ++step) {  // each query tile once per half of dK/dV
        const int stage = step % 2, tile = step % num_tiles;
        if (step >= 2) mbarrier_wait(&bars->q_empty[stage], ((step - 2) / 2) & 1);
        const int row = static_cast<int>(item.q_row) + item.q_begin + tile * S::kBlockM;
        mbarrier_arrive_expect_tx(&bars->q_full[stage], 2 * S::kTileBytes);
        for (int c = 0; c < S::kBoxes; ++c) {
          tma_load_2d(sq(stage) + c * S::kBoxBytes, &p.q_desc, q_col + 64 * c, row, &bars->q_full[stage]);
          tma_load_2d(sdo(stage) + c * S::kBoxBytes, &p.do_desc, q_col + 64 * c, row, &bars->q_full[stage]);
        }
      }
    }
    return;
  }

  // The compute warpgroup. As every m64 accumulator: warp w's rows 16 w + g and + 8, columns 8 j + 2 t
  // and + 1; for S and dP rows are queries and columns keys, for dK and dV rows are keys.
  const int local = tid % 128, w = local / 32, g = (local % 32) / 4, t = local % 4;
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int shift = item.kv_len - item.q_len;  // causal: query i sees task keys j <= i + shift
  mbarrier_wait(&bars->kv_full, 0);
  const uint32_t k_base = smem_address(sk), v_base = smem_address(sv);
  const uint32_t pt_base = smem_address(spt), dst_base = smem_address(sdst);
  auto k_major_step = [](uint32_t base, int kk) {  // 16 columns of D: 32 bytes into a box row, or the next box
    return base + static_cast<uint32_t>(kk / 4 * S::kBoxBytes + kk % 4 * 32);
  };

  // dK and dV 64 columns of D at a time (32 fp32 registers each, so that S and dP fit beside them):
  // the query tiles are walked once per half, S and dP computed again; dQ in the first walk.
  for (int half = 0; half < S::kBoxes; ++half) {
    float dk[32], dv[32];
    for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int step = half * num_tiles + tile, stage = step % 2, m0 = item.q_begin + tile * S::kBlockM;
      mbarrier_wait(&bars->q_full[stage], (step / 2) & 1);
      const uint32_t q_base = smem_address(sq(stage)), do_base = smem_address(sdo(stage));
      // S = Q K^T and dP = dO V^T: 64 queries x 64 keys each.
      float s[32], dp[32];
      wgmma_fence();
      for (int kk = 0; kk < D / 16; ++kk) {
        wgmma_ss<0, 64>(s, make_smem_desc(k_major_step(q_base, kk), Swizzle::k128B, 16, 1024),
                        make_smem_desc(k_major_step(k_base, kk), Swizzle::k128B, 16, 1024), kk > 0 ? 1 : 0, Elt{});
        wgmma_ss<0, 64>(dp, make_smem_desc(k_major_step(do_base, kk), Swizzle::k128B, 16, 1024),
                        make_smem_desc(k_major_step(v_base, kk), Swizzle::k128B, 16, 1024), kk > 0 ? 1 : 0, Elt{});
      }
      wgmma_commit();
      wgmma_wait<0>();
      // P and dS (in s), P^T and dS^T into shared memory.
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * w + g + 8 * r, i = m0 + row;  // the task query
        const bool row_ok = i < item.q_len;
        const int64_t at = (item.q_row + (row_ok ? i : 0)) * p.num_q_heads + h;
        const float lse_log2 = row_ok ? p.lse[at] * kLog2e : 0.f, delta = row_ok ? p.delta[at] : 0.f;
        for (int j = 0; j < 8; ++j) {
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * j + 2 * t + e, key = item.key0 + col;
            const bool ok = row_ok && col < item.cols && (!item.is_causal || key <= i + shift);
            float& x = s[4 * j + 2 * r + e];
            const float pr = ok ? exp2_approx(x * p.scale_log2 - lse_log2) : 0.f;
            x = pr * (dp[4 * j + 2 * r + e] - delta);  // dS
            const uint32_t pair = pack2(pr, x, Elt{});
            const uint32_t at = swizzled_64x64(pt_base, col, row);  // P^T and dS^T share the layout (both 1024-aligned)
            *reinterpret_cast<uint16_t*>(spt + at) = static_cast<uint16_t>(pair & 0xffffu);
            *reinterpret_cast<uint16_t*>(sdst + at) = static_cast<uint16_t>(pair >> 16);
          }
        }
      }
      fence_proxy_async();
      warpgroup_sync();
      // dV += P^T dO and dK += dS^T Q: M = keys, K = queries (16 a step: 32 bytes into P^T's rows), N = D
      // (Q and dO MN-major: 16 query rows a step, D / 64 boxes LBO apart).
      wgmma_fence();
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a_step = static_cast<uint32_t>(kk) * 32;
        const uint32_t b_step = static_cast<uint32_t>(half * S::kBoxBytes + kk * 16 * 128);  // this half's box
        wgmma_ss<1, 64>(dv, make_smem_desc(pt_base + a_step, Swizzle::k128B, 16, 1024),
                        make_smem_desc(do_base + b_step, Swizzle::k128B, S::kBoxBytes, 1024), 1, Elt{});
        wgmma_ss<1, 64>(dk, make_smem_desc(dst_base + a_step, Swizzle::k128B, 16, 1024),
                        make_smem_desc(q_base + b_step, Swizzle::k128B, S::kBoxBytes, 1024), 1, Elt{});
      }
      wgmma_commit();
      wgmma_wait<0>();
      // dQ += dS K (in the first walk), 64 columns of D at a time: dS as A fragments (keys 16 a step),
      // K MN-major.
      wgmma_fence();
      for (int c = 0; c < (half == 0 ? S::kBoxes : 0); ++c) {
        float dq[32];
        for (int kk = 0; kk < 4; ++kk) {
          const float* x = s + 8 * kk;
          const uint32_t a[4] = {pack2(x[0], x[1], Elt{}), pack2(x[2], x[3], Elt{}), pack2(x[4], x[5], Elt{}),
                                 pack2(x[6], x[7], Elt{})};
          const uint32_t b = k_base + static_cast<uint32_t>(c * S::kBoxBytes + kk * 16 * 128);
          wgmma_rs<1, 64>(dq, a, make_smem_desc(b, Swizzle::k128B, S::kBoxBytes, 1024), kk > 0 ? 1 : 0, Elt{});
        }
        wgmma_commit();
        wgmma_wait<0>();
        for (int r = 0; r < 2; ++r) {
          const int i = m0 + 16 * w + g + 8 * r;
          if (i >= item.q_len) continue;
          float* out = p.dq_acc + (item.q_row + i) * q_stride + static_cast<int64_t>(h) * D + 64 * c;
          for (int j = 0; j < 8; ++j) {
            atomic_add(out + 8 * j + 2 * t, dq[4 * j + 2 * r]);
            atomic_add(out + 8 * j + 2 * t + 1, dq[4 * j + 2 * r + 1]);
          }
        }
      }
      // Every thread is done with the stage, P^T and dS^T: release the stage.
      warpgroup_sync();
      if (local == 0) mbarrier_arrive(&bars->q_empty[stage]);
    }

    // This half of dK and dV of the tile's keys into the fp32 sums.
    for (int r = 0; r < 2; ++r) {
      const int col = 16 * w + g + 8 * r;
      if (col >= item.cols) continue;
      float* out_k = p.dk_acc + (item.kv_row + col) * kv_stride + static_cast<int64_t>(hk) * D + 64 * half;
      float* out_v = p.dv_acc + (item.kv_row + col) * kv_stride + static_cast<int64_t>(hk) * D + 64 * half;
      for (int j = 0; j < 8; ++j) {
        for (int e = 0; e < 2; ++e) {
          atomic_add(out_k + 8 * j + 2 * t + e, dk[4 * j + 2 * r + e]);
          atomic_add(out_v + 8 * j + 2 * t + e, dv[4 * j + 2 * r + e]);
        }
      }
    }
  }
}

}  // namespace distca::kernels::cuda
