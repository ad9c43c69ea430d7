// The forward attention tile algorithm (FlashAttention-2 style): one block of 4 warps serves one
// schedule item (a 64-row query tile of a task) for one query head. Each warp owns 16 query rows;
// Q stays in registers, K and V tiles of 64 keys stream through shared memory by cp.async (K of
// the next tile loads while this tile's P V runs, V of the next while its S is computed), scores
// and the online softmax stay in fp32 registers, P V runs on tensor cores.
//
// Written in warp.cuh's primitives, so the same source is the device kernel and, compiled as host
// C++, the emulated block of the host tests.
#pragma once

#include <cstdint>

#include "../common/schedule.h"
#include "../common/warp.cuh"

namespace distca::kernels::cuda {

struct FwdKernelParams {
  const uint16_t* q = nullptr;  // [Tq, Hq, D]
  const uint16_t* k = nullptr;  // [Tkv, Hkv, D]
  const uint16_t* v = nullptr;
  uint16_t* o = nullptr;        // [Tq, Hq, D]
  float* lse = nullptr;         // [Tq, Hq]
  const FwdItem* items = nullptr;
  int64_t num_items = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  float scale_log2 = 0;         // softmax scale * log2(e): scores are kept in base 2
};

template <int D>
struct FwdShape {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kThreads = 128;
  static constexpr int kStride = D + 8;  // shared row stride in elements: 16 bytes of padding keep ldmatrix conflict-free
  static constexpr int kSmemBytes = 3 * 64 * kStride * 2;  // Q, K, V tiles
};

// Loads ROWS rows of a [*, heads, D] tensor (row stride `row_stride` elements) into a shared tile
// with row stride D + 8; rows from `valid` on are zero-filled and read nothing.
template <int D, int ROWS>
DISTCA_DEV void load_rows(uint16_t* smem, const uint16_t* global, int64_t row_stride, int valid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = thread_index(); c < ROWS * kChunks; c += 128) {
    const int row = c / kChunks, chunk = c % kChunks;
    const bool ok = row < valid;
    cp_async_16(smem + row * (D + 8) + chunk * 8, ok ? global + row * row_stride + chunk * 8 : global, ok);
  }
}

template <int D, typename Elt>
DISTCA_DEV void fwd_block(const FwdKernelParams& p, char* smem_raw) {
  using S = FwdShape<D>;
  const int64_t block = block_index();
  const FwdItem item = p.items[block / p.num_q_heads];
  const int h = static_cast<int>(block % p.num_q_heads);
  const int hk = h / (p.num_q_heads / p.num_kv_heads);
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const uint16_t* q = p.q + item.q_row * q_stride + static_cast<int64_t>(h) * D;
  const uint16_t* k = p.k + item.kv_row * kv_stride + static_cast<int64_t>(hk) * D;
  const uint16_t* v = p.v + item.kv_row * kv_stride + static_cast<int64_t>(hk) * D;

  uint16_t* sq = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sk = sq + 64 * S::kStride;
  uint16_t* sv = sk + 64 * S::kStride;

  const int lane = lane_index(), warp = warp_index();
  const int g = lane / 4, t = lane % 4;
  const int num_keys = static_cast<int>(fwd_item_keys(item));
  const int num_tiles = (num_keys + S::kBlockN - 1) / S::kBlockN;

  // Group 1: Q and K of tile 0; group 2: V of tile 0.
  load_rows<D, 64>(sq, q, q_stride, item.rows);
  if (num_tiles > 0) load_rows<D, 64>(sk, k, kv_stride, num_keys);
  cp_async_commit();
  if (num_tiles > 0) load_rows<D, 64>(sv, v, kv_stride, num_keys);
  cp_async_commit();
  cp_async_wait<1>();
  sync_block();

  // This warp's 16 rows of Q as A fragments, one per 16 columns of D.
  uint32_t qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    const int row = warp * 16 + (lane % 16), col = kk * 16 + (lane / 16) * 8;
    ldmatrix_x4(qf[kk], sq + row * S::kStride + col);
  }

  float acc[D / 8][4];
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this lane's part; the 4 lanes of a row are summed at the end
  const int r0 = warp * 16 + g;   // tile rows of this lane: r0 and r0 + 8

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int n0 = tile * S::kBlockN;
    // S = Q K^T: 16 x 64 per warp, 8 column blocks of 8 keys.
    float s[8][4];
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    for (int kk = 0; kk < D / 16; ++kk) {
      for (int np = 0; np < 4; ++np) {
        const int key = np * 16 + (lane & 7) + ((lane >> 4) << 3), col = kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldmatrix_x4(b, sk + key * S::kStride + col);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816(s[2 * np], qf[kk], b0, Elt{});
        mma_16816(s[2 * np + 1], qf[kk], b1, Elt{});
      }
    }
    // Mask keys past the task's end and, causal, past each row's diagonal.
    const bool needs_mask = n0 + S::kBlockN > item.kv_len ||
                            (item.is_causal && n0 + S::kBlockN - 1 > warp * 16 + item.shift);
    if (needs_mask) {
      for (int j = 0; j < 8; ++j) {
        for (int e = 0; e < 4; ++e) {
          const int row = r0 + (e >= 2 ? 8 : 0), key = n0 + j * 8 + 2 * t + (e & 1);
          const bool ok = key < item.kv_len && (!item.is_causal || key <= row + item.shift);
          if (!ok) s[j][e] = -INFINITY;
        }
      }
    }
    // Online softmax, in base 2 with the scale folded in.
    float scale_old[2];
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
      for (int j = 0; j < 8; ++j) m = fmaxf(m, fmaxf(s[j][2 * r], s[j][2 * r + 1]) * p.scale_log2);
      m = fmaxf(m, shfl_xor(m, 1));
      m = fmaxf(m, shfl_xor(m, 2));
      const float base = m == -INFINITY ? 0.f : m;  // a row with no key yet: every p is 0
      scale_old[r] = exp2_approx(row_max[r] - base);
      row_max[r] = m;
      float sum = 0.f;
      for (int j = 0; j < 8; ++j) {
        s[j][2 * r] = exp2_approx(s[j][2 * r] * p.scale_log2 - base);
        s[j][2 * r + 1] = exp2_approx(s[j][2 * r + 1] * p.scale_log2 - base);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * scale_old[r] + sum;
    }
    for (int i = 0; i < D / 8; ++i) {
      acc[i][0] *= scale_old[0];
      acc[i][1] *= scale_old[0];
      acc[i][2] *= scale_old[1];
      acc[i][3] *= scale_old[1];
    }
    // V of this tile is in; K's buffer is free for the next tile.
    cp_async_wait<0>();
    sync_block();
    if (tile + 1 < num_tiles) load_rows<D, 64>(sk, k + static_cast<int64_t>(n0 + S::kBlockN) * kv_stride, kv_stride,
                                           num_keys - n0 - S::kBlockN);
    cp_async_commit();
    // O += P V: P (16 x 64) as A fragments straight from the score registers.
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t a[4] = {pack2(s[2 * kk][0], s[2 * kk][1], Elt{}), pack2(s[2 * kk][2], s[2 * kk][3], Elt{}),
                             pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], Elt{}),
                             pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], Elt{})};
      for (int dp = 0; dp < D / 16; ++dp) {
        const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = dp * 16 + (lane >> 4) * 8;
        uint32_t b[4];
        ldmatrix_x4_trans(b, sv + key * S::kStride + col);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816(acc[2 * dp], a, b0, Elt{});
        mma_16816(acc[2 * dp + 1], a, b1, Elt{});
      }
    }
    // The next K is in; V's buffer is free for the next tile.
    cp_async_wait<0>();
    sync_block();
    if (tile + 1 < num_tiles) load_rows<D, 64>(sv, v + static_cast<int64_t>(n0 + S::kBlockN) * kv_stride, kv_stride,
                                           num_keys - n0 - S::kBlockN);
    cp_async_commit();
  }
  cp_async_wait<0>();

  // O = acc / l and LSE = ln(l) + max (natural log); a row that saw no key gets O = 0, LSE = -inf.
  constexpr float kLn2 = 0.6931471805599453f;
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = r0 + 8 * r;
    if (row < item.rows) {
      uint16_t* out = p.o + (item.q_row + row) * q_stride + static_cast<int64_t>(h) * D;
      for (int i = 0; i < D / 8; ++i) {
        const uint32_t pair = pack2(acc[i][2 * r] * inv, acc[i][2 * r + 1] * inv, Elt{});
        *reinterpret_cast<uint32_t*>(out + i * 8 + 2 * t) = pair;
      }
      if (t == 0) {
        p.lse[(item.q_row + row) * p.num_q_heads + h] = l > 0.f ? (row_max[r] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
}

}  // namespace distca::kernels::cuda
