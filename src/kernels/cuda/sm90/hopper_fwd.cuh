// The sm_90a forward tile algorithm over a CA-task list (FlashAttention-3 style), in hopper.cuh's
// primitives: one block of three warpgroups serves one schedule item (a 128-row query tile of a
// task, fwd_schedule(tasks, 128)) for one query head.
//
//   - Warpgroup 0 is the producer: its first thread loads the item's Q tile and then, tile after
//     tile, the task's K and V tiles of 128 keys by TMA into a two-stage ring of 128-byte-swizzled
//     shared memory, each stage behind "full" mbarriers (K and V apart, so S can start before V
//     lands) and an "empty" one the consumers release it by.
//   - Warpgroups 1 and 2 are the consumers, 64 query rows each: S = Q K^T by wgmma from shared
//     memory (Q and K both K-major), the mask and the online softmax on S's registers (base 2,
//     scale folded in), then O += P V by wgmma with P straight from the registers (the accumulator
//     layout of S is the A-fragment layout of the next wgmma) and V read MN-major.
//   - The consumers take turns issuing their wgmmas (named barriers 4 and 5, FlashAttention-3's
//     ping-pong), so that one's softmax overlaps the other's matrix products.
//
// Shared memory, 1024-byte aligned (the 128-byte swizzle atom): the barriers, Q (128 rows), then
// two stages of K and V (128 keys each). Every tile is D / 64 boxes of 64 columns (128-byte rows):
// a box of R rows is R x 128 bytes, 8-row groups 1024 bytes apart (the descriptors' SBO); the
// boxes of one tile follow each other (the MN-major descriptors' LBO for V).
//
// Global tensors are read through 2-D TMA views of [rows, heads x D]: head h's columns of a box
// start at h D + 64 c. Rows past a task's end are loaded (the tensor's next rows, or zeros past
// its end) and masked or not stored.
#pragma once

#include <cstdint>

#include "hopper.cuh"
#include "../common/schedule.h"

namespace distca::kernels::cuda {

struct HopperFwdParams {
  TmaDesc q_desc, k_desc, v_desc;  // 2-D views [rows, heads * D], boxes of 64 x 128 rows (Q: x 128 rows)
  uint16_t* o = nullptr;           // [Tq, Hq, D]
  float* lse = nullptr;            // [Tq, Hq]
  const FwdItem* items = nullptr;  // fwd_schedule(tasks, HopperFwdShape::kBlockM)
  int64_t num_items = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  float scale_log2 = 0;
};

template <int D>
struct HopperFwdShape {
  static constexpr int kBlockM = 128;   // query rows a block serves (64 per consumer warpgroup)
  static constexpr int kBlockN = 128;   // keys a tile
  static constexpr int kThreads = 384;  // producer + two consumer warpgroups
  static constexpr int kBoxes = D / 64; // 64-column boxes a row
  static constexpr int kTileBytes = kBlockN * D * 2;  // a K or V tile (Q: the same, 128 rows)
  static constexpr int kBarrierBytes = 1024;
  static constexpr int kQOffset = kBarrierBytes;
  static constexpr int kKOffset = kQOffset + kTileBytes;          // stage s: + 2 s kTileBytes
  static constexpr int kSmemBytes = kKOffset + 4 * kTileBytes;    // + 1024 for aligning the base
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
};

// Barriers, at the start of shared memory.
struct HopperFwdBarriers {
  uint64_t q_full;
  uint64_t k_full[2], v_full[2], empty[2];
};

template <int D, typename Elt>
DISTCA_DEV void hopper_fwd_block(const HopperFwdParams& p, char* smem, int64_t work) {
  using S = HopperFwdShape<D>;
  const FwdItem item = p.items[work / p.num_q_heads];
  const int h = static_cast<int>(work % p.num_q_heads);
  const int hk = h / (p.num_q_heads / p.num_kv_heads);
  auto* bars = reinterpret_cast<HopperFwdBarriers*>(smem);
  char* sq = smem + S::kQOffset;
  auto sk = [&](int stage) { return smem + S::kKOffset + 2 * stage * S::kTileBytes; };
  auto sv = [&](int stage) { return sk(stage) + S::kTileBytes; };
  const int num_keys = static_cast<int>(fwd_item_keys(item));
  const int num_tiles = (num_keys + S::kBlockN - 1) / S::kBlockN;
  const int tid = thread_index(), group = warpgroup_index();

  if (tid == 0) {
    mbarrier_init(&bars->q_full, 1);
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&bars->k_full[s], 1);
      mbarrier_init(&bars->v_full[s], 1);
      mbarrier_init(&bars->empty[s], 2);  // one elected thread of each consumer warpgroup
    }
    fence_barrier_init();
  }
  sync_block();

  if (group == 0) {  // the producer
    if (tid == 0) {
      const int q_col = h * D, kv_col = hk * D;
      mbarrier_arrive_expect_tx(&bars->q_full, S::kTileBytes);
      for (int c = 0; c < S::kBoxes; ++c) {
        tma_load_2d(sq + c * S::kBlockM * 128, &p.q_desc, q_col + 64 * c, static_cast<int>(item.q_row), &bars->q_full);
      }
      for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile % 2;
        if (tile >= 2) mbarrier_wait(&bars->empty[stage], ((tile - 2) / 2) & 1);
        const int row = static_cast<int>(item.kv_row) + tile * S::kBlockN;
        mbarrier_arrive_expect_tx(&bars->k_full[stage], S::kTileBytes);
        for (int c = 0; c < S::kBoxes; ++c) {
          tma_load_2d(sk(stage) + c * S::kBlockN * 128, &p.k_desc, kv_col + 64 * c, row, &bars->k_full[stage]);
        }
        mbarrier_arrive_expect_tx(&bars->v_full[stage], S::kTileBytes);
        for (int c = 0; c < S::kBoxes; ++c) {
          tma_load_2d(sv(stage) + c * S::kBlockN * 128, &p.v_desc, kv_col + 64 * c, row, &bars->v_full[stage]);
        }
      }
    }
    return;
  }

  // A consumer: rows 64 (group - 1) .. + 63 of the item; within them, as every wgmma accumulator,
  // warp w's rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t and + 1.
  const int c = group - 1, local = tid % 128, w = local / 32, g = (local % 32) / 4, t = local % 4;
  const int r0 = 64 * c + 16 * w + g;  // this thread's item rows: r0 and r0 + 8
  float acc[D / 2];
  for (float& x : acc) x = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  mbarrier_wait(&bars->q_full, 0);
  const uint32_t q_base = smem_address(sq) + static_cast<uint32_t>(c) * 8 * 1024;  // row 64 c: 8 groups in
  // Ping-pong (FlashAttention-3): the two consumers take turns issuing their wgmmas, so one's
  // softmax runs while the other's matrix products hold the tensor cores. Consumer c waits on named
  // barrier kTurn + c and passes the turn by arriving on the other's; consumer 0 starts, and takes
  // consumer 1's last pass at the end, so every item leaves both barriers empty.
  constexpr int kTurn = 4, kBoth = 256;
  auto wait_turn = [&] { named_barrier_sync(kTurn + c, kBoth); };
  auto pass_turn = [&] { named_barrier_arrive(kTurn + 1 - c, kBoth); };
  if (c == 0) named_barrier_arrive(kTurn, kBoth);

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % 2, parity = (tile / 2) & 1, n0 = tile * S::kBlockN;
    // S = Q K^T: 64 x 128, D / 16 steps of 16 columns of D (32 bytes into a box row, or the next box).
    mbarrier_wait(&bars->k_full[stage], parity);
    float s[S::kBlockN / 2];
    const uint32_t k_base = smem_address(sk(stage));
    wait_turn();
    wgmma_fence();
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t step = static_cast<uint32_t>(kk / 4) * S::kBlockN * 128 + static_cast<uint32_t>(kk % 4) * 32;
      wgmma_ss<0, S::kBlockN>(s, make_smem_desc(q_base + step, Swizzle::k128B, 16, 1024),
                              make_smem_desc(k_base + step, Swizzle::k128B, 16, 1024), kk > 0 ? 1 : 0, Elt{});
    }
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    // Mask keys past the task's end and, causal, past each row's diagonal.
    for (int j = 0; j < S::kBlockN / 8; ++j) {
      for (int e = 0; e < 4; ++e) {
        const int row = r0 + (e >= 2 ? 8 : 0), key = n0 + 8 * j + 2 * t + (e & 1);
        const bool ok = key < item.kv_len && (!item.is_causal || key <= row + item.shift);
        if (!ok) s[4 * j + e] = -INFINITY;
      }
    }
    // Online softmax, base 2 with the scale folded in; a row's 4 lanes (t) share its max and sum.
    float scale_old[2];
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
      for (int j = 0; j < S::kBlockN / 8; ++j) m = fmaxf(m, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]) * p.scale_log2);
      m = fmaxf(m, shfl_xor(m, 1));
      m = fmaxf(m, shfl_xor(m, 2));
      const float base = m == -INFINITY ? 0.f : m;  // a row with no key yet: every p is 0
      scale_old[r] = exp2_approx(row_max[r] - base);
      row_max[r] = m;
      float sum = 0.f;
      for (int j = 0; j < S::kBlockN / 8; ++j) {
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * r + e];
          x = exp2_approx(x * p.scale_log2 - base);
          sum += x;
        }
      }
      row_sum[r] = row_sum[r] * scale_old[r] + sum;
    }
    for (int j = 0; j < D / 8; ++j) {
      acc[4 * j] *= scale_old[0];
      acc[4 * j + 1] *= scale_old[0];
      acc[4 * j + 2] *= scale_old[1];
      acc[4 * j + 3] *= scale_old[1];
    }
    // O += P V: k-step kk covers keys 16 kk..: P's columns 8 (2 kk) and 8 (2 kk + 1) as A; V MN-major,
    // 16 key rows (2 groups of 1024 bytes) a step, its D / 64 column boxes LBO apart.
    mbarrier_wait(&bars->v_full[stage], parity);
    const uint32_t v_base = smem_address(sv(stage));
    wait_turn();
    wgmma_fence();
    for (int kk = 0; kk < S::kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack2(s[8 * kk], s[8 * kk + 1], Elt{}), pack2(s[8 * kk + 2], s[8 * kk + 3], Elt{}),
                             pack2(s[8 * kk + 4], s[8 * kk + 5], Elt{}), pack2(s[8 * kk + 6], s[8 * kk + 7], Elt{})};
      wgmma_rs<1, D>(acc, a, make_smem_desc(v_base + static_cast<uint32_t>(kk) * 16 * 128, Swizzle::k128B,
                                            S::kBlockN * 128, 1024),
                     1, Elt{});
    }
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    // Every thread of this warpgroup is done with the stage: one of them releases it.
    warpgroup_sync();
    if (local == 0) mbarrier_arrive(&bars->empty[stage]);
  }

  if (c == 0) wait_turn();  // consumer 1's last pass

  // O = acc / l and LSE = ln(l) + max (natural log); a row that saw no key gets O = 0, LSE = -inf.
  constexpr float kLn2 = 0.6931471805599453f;
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = r0 + 8 * r;
    if (row < item.rows) {
      uint16_t* out = p.o + (item.q_row + row) * q_stride + static_cast<int64_t>(h) * D;
      for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<uint32_t*>(out + 8 * j + 2 * t) = pack2(acc[4 * j + 2 * r] * inv, acc[4 * j + 2 * r + 1] * inv, Elt{});
      }
      if (t == 0) {
        p.lse[(item.q_row + row) * p.num_q_heads + h] = l > 0.f ? (row_max[r] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
}

}  // namespace distca::kernels::cuda
