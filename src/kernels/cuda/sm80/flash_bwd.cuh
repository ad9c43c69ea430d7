// The backward attention tile algorithm (FlashAttention-2 style): one block of 4 warps serves one
// schedule item (a 64-key tile of a task) for one query head and walks the task's query rows that
// see those keys, 32 at a time. Each warp owns 16 keys and computes S^T = K Q^T and dP^T = V dO^T
// for them, so P^T and dS^T are already the A operands of dV += P^T dO and dK += dS^T Q, which
// stay in fp32 registers for the whole walk. dQ += dS K needs every warp's keys: dS^T goes
// through shared memory and each warp adds a 16-row by D/2 part of dQ to the fp32 sums (atomics).
//
// Inputs the launcher prepares: lse (natural log, as the forward wrote it) and delta =
// rowsum(dO * O) - dLSE per (row, head), fp32. Outputs: fp32 sums dq_acc [Tq, Hq, D], dk_acc and
// dv_acc [Tkv, Hkv, D], zeroed before the launch; the softmax scale of dQ and dK is applied when
// the sums are rounded (finalize), not here.
#pragma once

#include <cstdint>

#include "flash_fwd.cuh"
#include "../common/schedule.h"
#include "../common/warp.cuh"

namespace distca::kernels::cuda {

struct BwdKernelParams {
  const uint16_t* q = nullptr;    // [Tq, Hq, D]
  const uint16_t* k = nullptr;    // [Tkv, Hkv, D]
  const uint16_t* v = nullptr;
  const uint16_t* d_o = nullptr;  // [Tq, Hq, D]
  const float* lse = nullptr;     // [Tq, Hq]
  const float* delta = nullptr;   // [Tq, Hq]
  float* dq_acc = nullptr;        // [Tq, Hq, D]
  float* dk_acc = nullptr;        // [Tkv, Hkv, D]
  float* dv_acc = nullptr;
  const BwdItem* items = nullptr;
  int64_t num_items = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  float scale_log2 = 0;
};

template <int D>
struct BwdShape {
  static constexpr int kBlockN = 64;  // keys per item
  static constexpr int kBlockM = 32;  // queries per step
  static constexpr int kStride = D + 8;
  static constexpr int kDsStride = kBlockM + 8;
  static constexpr int kSmemBytes = (2 * kBlockN + 2 * kBlockM) * kStride * 2 + kBlockN * kDsStride * 2 + 2 * kBlockM * 4;
};

template <int D, typename Elt>
DISTCA_DEV void bwd_block(const BwdKernelParams& p, char* smem_raw) {
  using S = BwdShape<D>;
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t block = block_index();
  const BwdItem item = p.items[block / p.num_q_heads];
  const int h = static_cast<int>(block % p.num_q_heads);
  const int hk = h / (p.num_q_heads / p.num_kv_heads);
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * D;
  const int64_t q_head = static_cast<int64_t>(h) * D;
  const uint16_t* q = p.q + item.q_row * q_stride + q_head;
  const uint16_t* d_o = p.d_o + item.q_row * q_stride + q_head;
  const uint16_t* k = p.k + item.kv_row * kv_stride + static_cast<int64_t>(hk) * D;
  const uint16_t* v = p.v + item.kv_row * kv_stride + static_cast<int64_t>(hk) * D;

  uint16_t* sk = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sv = sk + S::kBlockN * S::kStride;
  uint16_t* sq = sv + S::kBlockN * S::kStride;
  uint16_t* sdo = sq + S::kBlockM * S::kStride;
  uint16_t* sds = sdo + S::kBlockM * S::kStride;  // dS^T [64 keys][32 queries]
  float* slse = reinterpret_cast<float*>(sds + S::kBlockN * S::kDsStride);
  float* sdelta = slse + S::kBlockM;

  const int lane = lane_index(), warp = warp_index();
  const int g = lane / 4, t = lane % 4;
  const int kw = warp * 16;                  // this warp's first key in the tile
  const int shift = item.kv_len - item.q_len;  // causal: query i sees task keys j <= i + shift

  load_rows<D, 64>(sk, k, kv_stride, item.cols);
  load_rows<D, 64>(sv, v, kv_stride, item.cols);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
  for (int i = 0; i < D / 8; ++i) {
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
  }

  for (int qi = item.q_begin; qi < item.q_len; qi += S::kBlockM) {
    const int valid = item.q_len - qi < S::kBlockM ? item.q_len - qi : S::kBlockM;
    load_rows<D, S::kBlockM>(sq, q + qi * q_stride, q_stride, valid);
    load_rows<D, S::kBlockM>(sdo, d_o + qi * q_stride, q_stride, valid);
    cp_async_commit();
    const int tid = thread_index();
    if (tid < S::kBlockM) {
      const int64_t at = (item.q_row + qi + tid) * p.num_q_heads + h;
      slse[tid] = tid < valid ? p.lse[at] * kLog2e : INFINITY;  // a padding row's P is 0
    } else if (tid < 2 * S::kBlockM) {
      const int r = tid - S::kBlockM;
      sdelta[r] = r < valid ? p.delta[(item.q_row + qi + r) * p.num_q_heads + h] : 0.f;
    }
    cp_async_wait<0>();
    sync_block();

    // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys by 32 queries, 4 blocks of 8 queries.
    float st[4][4], dpt[4][4];
    for (int j = 0; j < 4; ++j) {
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
    }
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      const int row = kw + (lane % 16), col = kk * 16 + (lane / 16) * 8;
      ldmatrix_x4(ka, sk + row * S::kStride + col);
      ldmatrix_x4(va, sv + row * S::kStride + col);
      for (int np = 0; np < 2; ++np) {
        const int query = np * 16 + (lane & 7) + ((lane >> 4) << 3), qcol = kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldmatrix_x4(b, sq + query * S::kStride + qcol);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816(st[2 * np], ka, b0, Elt{});
        mma_16816(st[2 * np + 1], ka, b1, Elt{});
        ldmatrix_x4(b, sdo + query * S::kStride + qcol);
        const uint32_t c0[2] = {b[0], b[1]}, c1[2] = {b[2], b[3]};
        mma_16816(dpt[2 * np], va, c0, Elt{});
        mma_16816(dpt[2 * np + 1], va, c1, Elt{});
      }
    }
    // P^T = exp(S^T scale - LSE) where the key is visible to the query, else 0;
    // dS^T = P^T (dP^T - delta).
    for (int j = 0; j < 4; ++j) {
      for (int e = 0; e < 4; ++e) {
        const int key_local = kw + g + (e >= 2 ? 8 : 0), query_local = j * 8 + 2 * t + (e & 1);
        const int key = item.key0 + key_local, query = qi + query_local;
        const bool ok = key_local < item.cols && query < item.q_len && (!item.is_causal || key <= query + shift);
        const float prob = ok ? exp2_approx(st[j][e] * p.scale_log2 - slse[query_local]) : 0.f;
        st[j][e] = prob;
        dpt[j][e] = prob * (dpt[j][e] - sdelta[query_local]);
      }
    }
    // dV += P^T dO and dK += dS^T Q over the 32 queries (two k-steps of 16).
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t pa[4] = {pack2(st[2 * kk][0], st[2 * kk][1], Elt{}), pack2(st[2 * kk][2], st[2 * kk][3], Elt{}),
                              pack2(st[2 * kk + 1][0], st[2 * kk + 1][1], Elt{}),
                              pack2(st[2 * kk + 1][2], st[2 * kk + 1][3], Elt{})};
      const uint32_t da[4] = {pack2(dpt[2 * kk][0], dpt[2 * kk][1], Elt{}),
                              pack2(dpt[2 * kk][2], dpt[2 * kk][3], Elt{}),
                              pack2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1], Elt{}),
                              pack2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3], Elt{})};
      for (int dp = 0; dp < D / 16; ++dp) {
        const int query = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = dp * 16 + (lane >> 4) * 8;
        uint32_t b[4];
        ldmatrix_x4_trans(b, sdo + query * S::kStride + col);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816(dv[2 * dp], pa, b0, Elt{});
        mma_16816(dv[2 * dp + 1], pa, b1, Elt{});
        ldmatrix_x4_trans(b, sq + query * S::kStride + col);
        const uint32_t c0[2] = {b[0], b[1]}, c1[2] = {b[2], b[3]};
        mma_16816(dk[2 * dp], da, c0, Elt{});
        mma_16816(dk[2 * dp + 1], da, c1, Elt{});
      }
    }
    // dS^T to shared memory (rounded to the storage type, as the dQ product reads it).
    for (int j = 0; j < 4; ++j) {
      for (int r = 0; r < 2; ++r) {
        uint16_t* at = sds + (kw + g + 8 * r) * S::kDsStride + j * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(at) = pack2(dpt[j][2 * r], dpt[j][2 * r + 1], Elt{});
      }
    }
    sync_block();
    // dQ (32 x D) += dS (32 x 64) K (64 x D): warp w adds rows (w % 2) * 16 .. +16, columns
    // (w / 2) * D / 2 .. + D / 2, 32 columns at a time.
    const int qr0 = (warp & 1) * 16;
    for (int c0 = (warp >> 1) * (D / 2); c0 < (warp >> 1) * (D / 2) + D / 2; c0 += 32) {
      float acc[4][4];
      for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t a[4];
        const int m = lane >> 3;
        ldmatrix_x4_trans(a, sds + (kk * 16 + (lane & 7) + (m >> 1) * 8) * S::kDsStride + qr0 + (m & 1) * 8);
        for (int dp = 0; dp < 2; ++dp) {
          const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = c0 + dp * 16 + (lane >> 4) * 8;
          uint32_t b[4];
          ldmatrix_x4_trans(b, sk + key * S::kStride + col);
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_16816(acc[2 * dp], a, b0, Elt{});
          mma_16816(acc[2 * dp + 1], a, b1, Elt{});
        }
      }
      for (int r = 0; r < 2; ++r) {
        const int query = qi + qr0 + g + 8 * r;
        if (query >= item.q_len) continue;
        float* out = p.dq_acc + (item.q_row + query) * q_stride + q_head + c0;
        for (int j = 0; j < 4; ++j) {
          atomic_add(out + j * 8 + 2 * t, acc[j][2 * r]);
          atomic_add(out + j * 8 + 2 * t + 1, acc[j][2 * r + 1]);
        }
      }
    }
    sync_block();  // Q, dO, dS^T and the row stats are overwritten by the next step
  }
  cp_async_wait<0>();  // an item whose queries all start past its keys loaded K and V for nothing

  // dK and dV of this warp's keys into the fp32 sums shared by every task and head that reads them.
  for (int r = 0; r < 2; ++r) {
    const int key_local = kw + g + 8 * r;
    if (key_local >= item.cols) continue;
    const int64_t at = (item.kv_row + key_local) * kv_stride + static_cast<int64_t>(hk) * D;
    for (int i = 0; i < D / 8; ++i) {
      atomic_add(p.dk_acc + at + i * 8 + 2 * t, dk[i][2 * r]);
      atomic_add(p.dk_acc + at + i * 8 + 2 * t + 1, dk[i][2 * r + 1]);
      atomic_add(p.dv_acc + at + i * 8 + 2 * t, dv[i][2 * r]);
      atomic_add(p.dv_acc + at + i * 8 + 2 * t + 1, dv[i][2 * r + 1]);
    }
  }
}

}  // namespace distca::kernels::cuda
