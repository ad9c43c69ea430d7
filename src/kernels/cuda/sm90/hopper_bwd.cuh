// The sm_90a backward tile algorithm over a CA-task list, in hopper.cuh's primitives. It owns K/V
// tiles: one block of two warpgroups serves one schedule item (a 64-row tile of the K/V rows the
// tasks read, kv_tile_schedule(tasks, 64)) for one K/V head, and walks, for every query head of the
// head's group and every task that reads the tile (the item's entries), the task's query rows that
// see those keys, 64 at a time. The shards of one document read the same K/V tiles, so their dK
// and dV sum in the block's registers and are stored once: no atomics on dK/dV, and no dK/dV
// scratch per task.
//
//   - Warpgroup 0 is the producer: its first thread loads the tile's K and V once, then the query
//     tiles' Q and dO by TMA into a two-stage ring (128-byte swizzle), behind "full" and "empty"
//     mbarriers.
//   - Warpgroup 1 computes, per query tile:
//     - S = Q K^T and dP = dO V^T by wgmma from shared memory;
//     - P = exp2(S scale log2(e) - LSE log2(e)), masked (the entry's tile rows, and causal), and
//       dS = P (dP - delta) in registers;
//     - P^T and dS^T go to shared memory (K-major, swizzled), where they are the A operands of
//       dV += P^T dO and dK += dS^T Q (dO and Q read MN-major). dV and dK stay in fp32 registers
//       for the whole walk;
//     - dQ += dS K with dS straight from the registers, in 64-column halves of D, added to the fp32
//       sums (atomics: every K/V tile a query sees adds to its row); or not at all (kDq false:
//       hopper_bwd_dq.cuh computes dQ in a pass of its own).
//   - At the end, dK and dV of the tile's rows are stored into the fp32 sums (the tiles never
//     overlap, so each row has one writer).
//
// Inputs and outputs are the sm_80 kernel's (flash_bwd.cuh): lse (natural log), delta =
// rowsum(dO O) - dLSE, zeroed fp32 sums dq_acc, dk_acc and dv_acc (rows no task reads stay zero);
// the softmax scale of dQ and dK is applied when the sums are rounded.
//
// Shared memory, 1024-byte aligned: the barriers, K and V (64 keys), two stages of Q and dO
// (64 rows), then P^T and dS^T (64 keys x 64 queries, one 128-byte row a key). Every tile of D
// columns is D / 64 boxes of 64 rows x 128 bytes (8 KB), 8-row groups 1024 bytes apart.
#pragma once

#include <cstdint>

#include "hopper.cuh"
#include "../common/schedule.h"

namespace distca::kernels::cuda {

struct HopperBwdParams {
  TmaDesc q_desc, k_desc, v_desc, do_desc;  // 2-D views [rows, heads * D], boxes of 64 x 64 rows
  const float* lse = nullptr;               // [Tq, Hq]
  const float* delta = nullptr;             // [Tq, Hq]
  float* dq_acc = nullptr;                  // [Tq, Hq, D] (kDq only)
  float* dk_acc = nullptr;                  // [Tkv, Hkv, D]
  float* dv_acc = nullptr;
  const KvTileItem* items = nullptr;        // kv_tile_schedule(tasks, HopperBwdShape::kBlockN)
  const KvTileEntry* entries = nullptr;
  int64_t num_items = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  float scale_log2 = 0;
};

template <int D>
struct HopperBwdShape {
  static constexpr int kBlockN = 64;    // K/V rows an item
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


// A position in the walk over one K/V tile: query head g of the K/V head's group, the item's entry
// x, query tile `tile` of that entry (64 rows from its q_begin). The producer and the consumer walk
// in the same order: per walk (64 columns of dK/dV, or all of D), heads, then entries, then query
// tiles.
struct KvTileWalk {
  int g = 0, x = 0, tile = 0;
};
DISTCA_DEV int query_tiles(const KvTileEntry& e, int block_m) { return (e.q_len - e.q_begin + block_m - 1) / block_m; }
DISTCA_DEV void walk_next(KvTileWalk& at, const KvTileEntry* entries, int num_entries, int block_m) {
  if (++at.tile < query_tiles(entries[at.x], block_m)) return;
  at.tile = 0;
  if (++at.x < num_entries) return;
  at.x = 0;
  ++at.g;
}

// The step of a K-major 64-row tile of D columns (D / 64 boxes of 64 rows x 128 bytes) that holds
// columns 16 kk..: 32 bytes into a box row, or the next box.
DISTCA_DEV uint32_t k_major_step(uint32_t base, int kk) { return base + static_cast<uint32_t>(kk / 4 * 64 * 128 + kk % 4 * 32); }

// S = Q K^T and dP = dO V^T, 64 query rows x 64 keys each, by one wgmma group waited for: the
// backward's first two matrix products (hopper_bwd.cuh, hopper_bwd_dq.cuh). Q, dO, K and V are
// K-major 64-row tiles (128-byte swizzle).
template <int D, typename Elt>
DISTCA_DEV void s_and_dp(float (&s)[32], float (&dp)[32], uint32_t q_base, uint32_t do_base, uint32_t k_base,
                         uint32_t v_base) {
  wgmma_fence();
  for (int kk = 0; kk < D / 16; ++kk) {
    wgmma_ss<0, 64>(s, make_smem_desc(k_major_step(q_base, kk), Swizzle::k128B, 16, 1024),
                    make_smem_desc(k_major_step(k_base, kk), Swizzle::k128B, 16, 1024), kk > 0 ? 1 : 0, Elt{});
    wgmma_ss<0, 64>(dp, make_smem_desc(k_major_step(do_base, kk), Swizzle::k128B, 16, 1024),
                    make_smem_desc(k_major_step(v_base, kk), Swizzle::k128B, 16, 1024), kk > 0 ? 1 : 0, Elt{});
  }
  wgmma_commit();
  wgmma_wait<0>();
}

// The byte offset of element (row, col) of a 64 x 64 tile of 16-bit elements stored K-major with
// 128-byte rows under the 128-byte swizzle (the tile 1024-byte aligned).
DISTCA_DEV uint32_t swizzled_64x64(uint32_t tile, int row, int col) {
  return swizzle_address(tile + static_cast<uint32_t>(row / 8 * 1024 + row % 8 * 128 + col * 2), Swizzle::k128B) - tile;
}

// kDq: this pass adds dQ (atomics); without it, hopper_bwd_dq.cuh computes dQ. Holding all of D
// 128's dK and dV in one walk without dQ's registers still spills (52 bytes), so D 128 walks twice
// either way (kWalks below is where one walk would go).
template <int D, typename Elt, bool kDq = true>
DISTCA_DEV void hopper_bwd_block(const HopperBwdParams& p, char* smem, int64_t work) {
  using S = HopperBwdShape<D>;
  constexpr int kWalks = S::kBoxes;  // walks of the query tiles, each for kCols columns of dK/dV
  constexpr int kCols = D / kWalks;
  constexpr float kLog2e = 1.4426950408889634f;
  const KvTileItem item = p.items[work / p.num_kv_heads];
  const int hk = static_cast<int>(work % p.num_kv_heads);
  const int heads = p.num_q_heads / p.num_kv_heads;  // the query heads of K/V head hk: hk heads + g
  const KvTileEntry* entries = p.entries + item.first_entry;
  int64_t walk_steps = 0;  // query tiles of one walk
  for (int x = 0; x < item.num_entries; ++x) walk_steps += query_tiles(entries[x], S::kBlockM);
  walk_steps *= heads;
  auto* bars = reinterpret_cast<PairRingBarriers*>(smem);  // once: K and V; the ring: Q and dO
  char* sk = smem + S::kKOffset;
  char* sv = smem + S::kVOffset;
  auto sq = [&](int stage) { return smem + S::kQOffset + 2 * stage * S::kTileBytes; };
  auto sdo = [&](int stage) { return sq(stage) + S::kTileBytes; };
  char* spt = smem + S::kPtOffset;
  char* sdst = smem + S::kDstOffset;
  const int tid = thread_index(), group = warpgroup_index();

  init_pair_ring(bars);

  if (group == 0) {  // the producer
    if (tid == 0) {
      tma_load_pair(sk, &p.k_desc, sv, &p.v_desc, S::kBoxes, S::kBoxBytes, hk * D, static_cast<int>(item.kv_row),
                    &bars->once);
      // The walk, once per kCols columns of dK/dV.
      KvTileWalk at;
      for (int64_t step = 0; step < kWalks * walk_steps; ++step, walk_next(at, entries, item.num_entries, S::kBlockM)) {
        if (step % walk_steps == 0) at = KvTileWalk{};
        const int stage = static_cast<int>(step % 2);
        if (step >= 2) mbarrier_wait(&bars->empty[stage], static_cast<int>((step - 2) / 2) & 1);
        const KvTileEntry& e = entries[at.x];
        const int row = static_cast<int>(e.q_row) + e.q_begin + at.tile * S::kBlockM;
        tma_load_pair(sq(stage), &p.q_desc, sdo(stage), &p.do_desc, S::kBoxes, S::kBoxBytes, (hk * heads + at.g) * D, row,
                      &bars->full[stage]);
      }
    }
    return;
  }

  // The compute warpgroup. As every m64 accumulator: warp w's rows 16 w + lane_row and + 8, columns 8 j + 2 t
  // and + 1; for S and dP rows are queries and columns keys, for dK and dV rows are keys.
  const int local = tid % 128, w = local / 32, lane_row = (local % 32) / 4, t = local % 4;
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  mbarrier_wait(&bars->once, 0);
  const uint32_t k_base = smem_address(sk), v_base = smem_address(sv);
  const uint32_t pt_base = smem_address(spt), dst_base = smem_address(sdst);

  // dK and dV kCols (64) columns of D at a time (32 fp32 registers each, so that S, dP and dQ fit
  // beside them): the walk runs once per 64 columns, S and dP computed again; dQ in the first walk.
  for (int walk = 0; walk < kWalks; ++walk) {
    float dk[kCols / 2], dv[kCols / 2];
    for (int i = 0; i < kCols / 2; ++i) dk[i] = dv[i] = 0.f;
    KvTileWalk at;
    for (int64_t n = 0; n < walk_steps; ++n, walk_next(at, entries, item.num_entries, S::kBlockM)) {
      const int64_t step = walk * walk_steps + n;
      const KvTileEntry& e = entries[at.x];
      const int h = hk * heads + at.g, shift = e.kv_len - e.q_len;  // causal: query i sees task keys j <= i + shift
      const int stage = static_cast<int>(step % 2), m0 = e.q_begin + at.tile * S::kBlockM;
      mbarrier_wait(&bars->full[stage], static_cast<int>(step / 2) & 1);
      const uint32_t q_base = smem_address(sq(stage)), do_base = smem_address(sdo(stage));
      float s[32], dp[32];
      s_and_dp<D, Elt>(s, dp, q_base, do_base, k_base, v_base);
      // P and dS (in s), P^T and dS^T into shared memory.
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * w + lane_row + 8 * r, i = m0 + row;  // the task query
        const bool row_ok = i < e.q_len;
        const int64_t at = (e.q_row + (row_ok ? i : 0)) * p.num_q_heads + h;
        const float lse_log2 = row_ok ? p.lse[at] * kLog2e : 0.f, delta = row_ok ? p.delta[at] : 0.f;
        for (int j = 0; j < 8; ++j) {
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * j + 2 * t + c, key = e.key0 + col;
            const bool ok = row_ok && col >= e.col_begin && col < e.col_end && (!e.is_causal || key <= i + shift);
            float& sx = s[4 * j + 2 * r + c];
            const float pr = ok ? exp2_approx(sx * p.scale_log2 - lse_log2) : 0.f;
            sx = pr * (dp[4 * j + 2 * r + c] - delta);  // dS
            const uint32_t pair = pack2(pr, sx, Elt{});
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
        const uint32_t b_step = static_cast<uint32_t>(walk * S::kBoxBytes + kk * 16 * 128);  // this walk's boxes
        wgmma_ss<1, kCols>(dv, make_smem_desc(pt_base + a_step, Swizzle::k128B, 16, 1024),
                           make_smem_desc(do_base + b_step, Swizzle::k128B, S::kBoxBytes, 1024), 1, Elt{});
        wgmma_ss<1, kCols>(dk, make_smem_desc(dst_base + a_step, Swizzle::k128B, 16, 1024),
                           make_smem_desc(q_base + b_step, Swizzle::k128B, S::kBoxBytes, 1024), 1, Elt{});
      }
      wgmma_commit();
      wgmma_wait<0>();
      // dQ += dS K (in the first walk), 64 columns of D at a time: dS as A fragments (keys 16 a step),
      // K MN-major.
      wgmma_fence();
      for (int c = 0; c < (kDq && walk == 0 ? S::kBoxes : 0); ++c) {
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
          const int i = m0 + 16 * w + lane_row + 8 * r;
          if (i >= e.q_len) continue;
          float* out = p.dq_acc + (e.q_row + i) * q_stride + static_cast<int64_t>(h) * D + 64 * c;
          for (int j = 0; j < 8; ++j) {
            atomic_add(out + 8 * j + 2 * t, dq[4 * j + 2 * r]);
            atomic_add(out + 8 * j + 2 * t + 1, dq[4 * j + 2 * r + 1]);
          }
        }
      }
      // Every thread is done with the stage, P^T and dS^T: release the stage.
      warpgroup_sync();
      if (local == 0) mbarrier_arrive(&bars->empty[stage]);
    }

    // This walk's columns of dK and dV of the tile's rows into the fp32 sums: one writer a row.
    for (int r = 0; r < 2; ++r) {
      const int col = 16 * w + lane_row + 8 * r;
      if (col >= item.rows) continue;
      float* out_k = p.dk_acc + (item.kv_row + col) * kv_stride + static_cast<int64_t>(hk) * D + kCols * walk;
      float* out_v = p.dv_acc + (item.kv_row + col) * kv_stride + static_cast<int64_t>(hk) * D + kCols * walk;
      for (int j = 0; j < kCols / 8; ++j) {
        for (int c = 0; c < 2; ++c) {
          out_k[8 * j + 2 * t + c] = dk[4 * j + 2 * r + c];
          out_v[8 * j + 2 * t + c] = dv[4 * j + 2 * r + c];
        }
      }
    }
  }
}

}  // namespace distca::kernels::cuda
