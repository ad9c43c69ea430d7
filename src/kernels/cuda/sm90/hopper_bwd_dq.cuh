// dQ of the sm_90a backward as a pass of its own, the alternative to hopper_bwd.cuh's fp32 atomic
// adds (CudaAttention runs it with DISTCA_HOPPER_DQ=pass, for timing the two against each other on
// a GPU). The K/V-owning blocks add dQ's share of every K/V tile to each query row: a query of a
// long document takes one atomic add per K/V tile it sees. This pass owns query tiles instead, as
// the forward does: one block of two warpgroups serves one 64-row query tile of a task
// (fwd_schedule(tasks, 64)) for one query head, walks the K/V tiles its rows see, recomputes S, P,
// dP and dS there, and stores dQ once, at the cost of two more matrix products per tile.
//
//   - Warpgroup 0 is the producer: its first thread loads Q and dO once, then the K and V tiles of
//     64 keys by TMA into a two-stage ring (128-byte swizzle), behind "full" and "empty" mbarriers.
//   - Warpgroup 1 computes, per K/V tile: S = Q K^T and dP = dO V^T by wgmma from shared memory;
//     P = exp2(S scale log2(e) - LSE log2(e)), masked, and dS = P (dP - delta) in registers; then
//     dQ += dS K with dS straight from the registers and K read MN-major. dQ (D fp32 registers
//     a thread over the warpgroup) is stored into the fp32 sums at the end.
//
// Inputs and outputs as hopper_bwd.cuh's; the softmax scale of dQ is applied when the sums are
// rounded. Shared memory, 1024-byte aligned: the barriers, Q and dO (64 rows), two stages of K and
// V (64 keys); every tile is D / 64 boxes of 64 rows x 128 bytes (8 KB).
#pragma once

#include <cstdint>

#include "hopper.cuh"
#include "hopper_bwd.cuh"  // s_and_dp
#include "../common/schedule.h"

namespace distca::kernels::cuda {

struct HopperBwdDqParams {
  TmaDesc q_desc, k_desc, v_desc, do_desc;  // 2-D views [rows, heads * D], boxes of 64 x 64 rows
  const float* lse = nullptr;               // [Tq, Hq]
  const float* delta = nullptr;             // [Tq, Hq]
  float* dq_acc = nullptr;                  // [Tq, Hq, D]: each covered row written once
  const FwdItem* items = nullptr;           // fwd_schedule(tasks, HopperBwdDqShape::kBlockM)
  int64_t num_items = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  float scale_log2 = 0;
};

template <int D>
struct HopperBwdDqShape {
  static constexpr int kBlockM = 64;    // query rows an item
  static constexpr int kBlockN = 64;    // keys a tile
  static constexpr int kThreads = 256;  // producer + one compute warpgroup
  static constexpr int kBoxes = D / 64;
  static constexpr int kBoxBytes = 64 * 128;             // 64 rows of one 64-column box
  static constexpr int kTileBytes = kBoxes * kBoxBytes;  // 64 rows x D
  static constexpr int kQOffset = 1024;
  static constexpr int kDoOffset = kQOffset + kTileBytes;
  static constexpr int kKOffset = kDoOffset + kTileBytes;  // stage s: + 2 s kTileBytes (K), + kTileBytes (V)
  static constexpr int kSmemBytes = kKOffset + 4 * kTileBytes;  // + 1024 for aligning the base
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
};


template <int D, typename Elt>
DISTCA_DEV void hopper_bwd_dq_block(const HopperBwdDqParams& p, char* smem, int64_t work) {
  using S = HopperBwdDqShape<D>;
  constexpr float kLog2e = 1.4426950408889634f;
  const FwdItem item = p.items[work / p.num_q_heads];
  const int h = static_cast<int>(work % p.num_q_heads);
  const int hk = h / (p.num_q_heads / p.num_kv_heads);
  auto* bars = reinterpret_cast<PairRingBarriers*>(smem);  // once: Q and dO; the ring: K and V
  char* sq = smem + S::kQOffset;
  char* sdo = smem + S::kDoOffset;
  auto sk = [&](int stage) { return smem + S::kKOffset + 2 * stage * S::kTileBytes; };
  auto sv = [&](int stage) { return sk(stage) + S::kTileBytes; };
  const int num_tiles = static_cast<int>((fwd_item_keys(item) + S::kBlockN - 1) / S::kBlockN);
  const int tid = thread_index(), group = warpgroup_index();

  init_pair_ring(bars);

  if (group == 0) {  // the producer
    if (tid == 0) {
      tma_load_pair(sq, &p.q_desc, sdo, &p.do_desc, S::kBoxes, S::kBoxBytes, h * D, static_cast<int>(item.q_row),
                    &bars->once);
      for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile % 2;
        if (tile >= 2) mbarrier_wait(&bars->empty[stage], ((tile - 2) / 2) & 1);
        tma_load_pair(sk(stage), &p.k_desc, sv(stage), &p.v_desc, S::kBoxes, S::kBoxBytes, hk * D,
                      static_cast<int>(item.kv_row) + tile * S::kBlockN, &bars->full[stage]);
      }
    }
    return;
  }

  // The compute warpgroup. As every m64 accumulator: warp w's rows 16 w + lane_row and + 8, columns
  // 8 j + 2 t and + 1; rows are the item's queries, columns keys (S, dP) or D (dQ).
  const int local = tid % 128, w = local / 32, lane_row = (local % 32) / 4, t = local % 4;
  float lse_log2[2], delta[2];
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * w + lane_row + 8 * r;
    const int64_t at = (item.q_row + (row < item.rows ? row : 0)) * p.num_q_heads + h;
    lse_log2[r] = row < item.rows ? p.lse[at] * kLog2e : 0.f;
    delta[r] = row < item.rows ? p.delta[at] : 0.f;
  }
  float dq[D / 2];
  for (float& x : dq) x = 0.f;
  mbarrier_wait(&bars->once, 0);
  const uint32_t q_base = smem_address(sq), do_base = smem_address(sdo);
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % 2, n0 = tile * S::kBlockN;
    mbarrier_wait(&bars->full[stage], (tile / 2) & 1);
    const uint32_t k_base = smem_address(sk(stage)), v_base = smem_address(sv(stage));
    float s[32], dp[32];
    s_and_dp<D, Elt>(s, dp, q_base, do_base, k_base, v_base);
    // P and dS (in s): keys past the task's end and, causal, past each row's diagonal are 0.
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * w + lane_row + 8 * r;
      for (int j = 0; j < 8; ++j) {
        for (int c = 0; c < 2; ++c) {
          const int key = n0 + 8 * j + 2 * t + c;
          const bool ok = row < item.rows && key < item.kv_len && (!item.is_causal || key <= row + item.shift);
          float& x = s[4 * j + 2 * r + c];
          const float pr = ok ? exp2_approx(x * p.scale_log2 - lse_log2[r]) : 0.f;
          x = pr * (dp[4 * j + 2 * r + c] - delta[r]);
        }
      }
    }
    // dQ += dS K: dS as A fragments (keys 16 a step), K MN-major (16 key rows a step, its D / 64
    // column boxes LBO apart).
    wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
      const float* x = s + 8 * kk;
      const uint32_t a[4] = {pack2(x[0], x[1], Elt{}), pack2(x[2], x[3], Elt{}), pack2(x[4], x[5], Elt{}),
                             pack2(x[6], x[7], Elt{})};
      wgmma_rs<1, D>(dq, a, make_smem_desc(k_base + static_cast<uint32_t>(kk) * 16 * 128, Swizzle::k128B, S::kBoxBytes, 1024),
                     1, Elt{});
    }
    wgmma_commit();
    wgmma_wait<0>();
    // Every thread is done with the stage: release it.
    warpgroup_sync();
    if (local == 0) mbarrier_arrive(&bars->empty[stage]);
  }

  // dQ of the item's rows into the fp32 sums: one writer a row and head.
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * w + lane_row + 8 * r;
    if (row >= item.rows) continue;
    float* out = p.dq_acc + (item.q_row + row) * q_stride + static_cast<int64_t>(h) * D;
    for (int j = 0; j < D / 8; ++j) {
      out[8 * j + 2 * t] = dq[4 * j + 2 * r];
      out[8 * j + 2 * t + 1] = dq[4 * j + 2 * r + 1];
    }
  }
}

}  // namespace distca::kernels::cuda
