// Flash-style attention blocks, written once with GCC vector extensions and compiled per
// instruction set: isa_avx512.cc builds it with AVX-512 (one 16-lane vector is one zmm register,
// 32 of them), isa_avx2.cc with AVX2 and FMA (8 lanes, 16 ymm registers), isa_portable.cc with the
// compiler's baseline (4 lanes: SSE2's 16 xmm registers on x86-64, NEON's 32 on aarch64). Include
// only from those files, inside their own namespace, with DISTCA_VECTOR_BYTES and
// DISTCA_VECTOR_REGISTERS defined.
//
// The layout is transposed so that no reduction is horizontal: a block holds kBlockQ queries in
// the vector lanes. Scores are S^T [keys, queries]: the row max, sum and mask of the softmax are
// lane-wise, and O^T [D, queries] accumulates V[j][d] (broadcast) times P^T[j] (a vector).
//   S^T = K Q^T        (st_rows: broadcast K[j][d], vector Q^T[d])
//   O^T += V^T P^T     (acc_t:   broadcast V[j][d], vector P^T[j])
//   dV  += P^T dO      (rows_acc: broadcast P^T[j][i], vector dO[i])
// Scores are kept in log2 units (Q^T is pre-scaled by scale * log2(e)) so softmax uses exp2.
//
// Each product runs as register tiles (accumulators that stay in registers over the reduction):
// rows of broadcasts times vectors of columns. The data layout (kBlockQ = 64 queries a block) is
// the same for every instruction set; the tiles are sized per set (Tiles below), so that a tile's
// accumulators, its column vectors and one broadcast fit the register file. With 32 registers a
// tile spans all 64 queries (one column tile); with 16, a quarter of them.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "isa.h"

#if !defined(DISTCA_VECTOR_BYTES) || !defined(DISTCA_VECTOR_REGISTERS)
#error "define DISTCA_VECTOR_BYTES and DISTCA_VECTOR_REGISTERS before including blocks.h"
#endif

namespace distca::kernels::cpu_detail {
namespace DISTCA_ISA_NAMESPACE {

typedef float vf __attribute__((vector_size(DISTCA_VECTOR_BYTES)));
typedef int32_t vi __attribute__((vector_size(DISTCA_VECTOR_BYTES)));
constexpr int kLanes = DISTCA_VECTOR_BYTES / 4;
constexpr int kQVecs = kBlockQ / kLanes;
static_assert(kBlockQ % kLanes == 0);

// Register tiles (rows x column vectors of accumulators), per product:
//   st:      kStRows key rows x kStVecs query vectors (+ kStVecs loads + 1 broadcast)
//   acc_t:   kAccRows head-dim rows x kAccVecs query vectors
//   rows_acc: up to kRowsAccTile accumulators, in D-column vectors of at most kRowsAccVecs
// 32 registers: 24 / 16 / 24 accumulators (AVX-512's tiles as tuned before AVX2 came: rows_acc
// spans all of D there, 6 x 4 vectors at D 64, 3 x 8 at D 128); 16 registers: 12 / 12 / 12 (acc_t
// as 4 x 3 vectors, the block's last tile 4 x 2: on AVX2 2-5 % more forward than 4 x 2, 0-3 % less
// backward, where it computes dQ^T).
constexpr bool kWideFile = DISTCA_VECTOR_REGISTERS >= 32;
constexpr bool kIsAvx512Tiles = kLanes == 16;
constexpr int kStRows = 6;
constexpr int kStVecs = std::min(kQVecs, kWideFile ? 4 : 2);
constexpr int kAccRows = 4;
constexpr int kAccVecs = std::min(kQVecs, kWideFile ? 4 : 3);
constexpr int kRowsAccTile = kWideFile ? 24 : 12;
constexpr int kRowsAccVecs = kIsAvx512Tiles ? 16 : (kWideFile ? 4 : 2);
static_assert(kQVecs % kStVecs == 0);

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// 2^x, relative error ~2e-7; 0 for x <= -127 (and -inf), saturates at 2^127; NaN stays NaN (the
// clamps keep x where a comparison with NaN is false, so a NaN score is never read as 2^-127).
inline vf exp2v(vf x) {
  x = x < splat(-127.0f) ? splat(-127.0f) : x;
  x = x > splat(127.0f) ? splat(127.0f) : x;
  const vf r = (x + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const vf f = x - r;                            // [-0.5, 0.5]
  vf p = splat(1.525273380405984e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.0f;
  const vi n = __builtin_convertvector(r, vi);
  const vi bits = (n + 127) << 23;  // n = -127 gives 0.0
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  return p * pow2;
}

inline vi lane_index(int v) {
  vi idx;
  for (int i = 0; i < kLanes; ++i) idx[i] = v * kLanes + i;
  return idx;
}

// out[r][:NV * kLanes] = sum_d a[r][d] * bt[d][:NV * kLanes] for MR rows of a (row stride
// a_stride); bt and out rows are kBlockQ apart.
template <int D, int MR, int NV>
inline void st_rows(const float* a, int64_t a_stride, const float* bt, float* out) {
  vf acc[MR][NV] = {};
#pragma GCC unroll 2
  for (int d = 0; d < D; ++d) {
    vf b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load(bt + d * kBlockQ + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float x = a[r * a_stride + d];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store(out + r * kBlockQ + v * kLanes, acc[r][v]);
}

// out[j][:] = sum_d a[j][d] * bt[d][:] for j in [0, num_rows), a column tile at a time.
template <int D>
void st_block(const float* a, int64_t a_stride, const float* bt, int64_t num_rows, float* out) {
  constexpr int kMR = kStRows, kNV = kStVecs;
  for (int c = 0; c < kQVecs; c += kNV) {
    const float* btc = bt + c * kLanes;
    float* outc = out + c * kLanes;
    int64_t j = 0;
    for (; j + kMR <= num_rows; j += kMR) st_rows<D, kMR, kNV>(a + j * a_stride, a_stride, btc, outc + j * kBlockQ);
    const float* aj = a + j * a_stride;
    float* oj = outc + j * kBlockQ;
    switch (num_rows - j) {
      case 5: st_rows<D, 5, kNV>(aj, a_stride, btc, oj); break;
      case 4: st_rows<D, 4, kNV>(aj, a_stride, btc, oj); break;
      case 3: st_rows<D, 3, kNV>(aj, a_stride, btc, oj); break;
      case 2: st_rows<D, 2, kNV>(aj, a_stride, btc, oj); break;
      case 1: st_rows<D, 1, kNV>(aj, a_stride, btc, oj); break;
      default: break;
    }
  }
}

// acc_t[d][:NV * kLanes] = acc_t[d][:NV * kLanes] * alpha + sum_j a[j][d] * pt[j][:NV * kLanes]
// (alpha == nullptr: no rescale); acc_t and pt rows are kBlockQ apart.
template <int D, int NV>
inline void acc_t_tile(float* acc_t, const vf* alpha, const float* a, int64_t a_stride, const float* pt,
                       int64_t num_rows) {
  constexpr int kMD = kAccRows;
  static_assert(D % kMD == 0);
  for (int d0 = 0; d0 < D; d0 += kMD) {
    vf acc[kMD][NV];
    for (int r = 0; r < kMD; ++r)
      for (int v = 0; v < NV; ++v) {
        acc[r][v] = load(acc_t + (d0 + r) * kBlockQ + v * kLanes);
        if (alpha != nullptr) acc[r][v] *= alpha[v];
      }
#pragma GCC unroll 2
    for (int64_t j = 0; j < num_rows; ++j) {
      vf p[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) p[v] = load(pt + j * kBlockQ + v * kLanes);
      const float* arow = a + j * a_stride + d0;
#pragma GCC unroll 4
      for (int r = 0; r < kMD; ++r) {
        const float x = arow[r];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] += x * p[v];
      }
    }
    for (int r = 0; r < kMD; ++r)
      for (int v = 0; v < NV; ++v) store(acc_t + (d0 + r) * kBlockQ + v * kLanes, acc[r][v]);
  }
}

// acc_t[d][:] = acc_t[d][:] * alpha + sum_j a[j][d] * pt[j][:], a column tile at a time (the last
// one narrower where kAccVecs does not divide the block's vectors).
template <int D>
void acc_t_block(float* acc_t, const vf* alpha, const float* a, int64_t a_stride, const float* pt,
                 int64_t num_rows) {
  constexpr int kNV = kAccVecs, kFull = kQVecs / kNV * kNV, kRest = kQVecs - kFull;
  for (int c = 0; c < kFull; c += kNV) {
    acc_t_tile<D, kNV>(acc_t + c * kLanes, alpha == nullptr ? nullptr : alpha + c, a, a_stride, pt + c * kLanes,
                       num_rows);
  }
  if constexpr (kRest > 0) {
    acc_t_tile<D, kRest>(acc_t + kFull * kLanes, alpha == nullptr ? nullptr : alpha + kFull, a, a_stride,
                         pt + kFull * kLanes, num_rows);
  }
}

// acc[r][:NV * kLanes] += sum_i pt[r][i] * b[i][:NV * kLanes] for MR rows, i in [0, num_cols);
// acc rows are D long.
template <int D, int MR, int NV>
inline void rows_acc(float* acc_rows, const float* pt, const float* b, int64_t b_stride,
                     int64_t num_cols) {
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load(acc_rows + r * D + v * kLanes);
#pragma GCC unroll 2
  for (int64_t i = 0; i < num_cols; ++i) {
    vf bv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) bv[v] = load(b + i * b_stride + v * kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const float x = pt[r * kBlockQ + i];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store(acc_rows + r * D + v * kLanes, acc[r][v]);
}

template <int D>
void rows_acc_block(float* acc_rows, const float* pt, int64_t num_rows, const float* b,
                    int64_t b_stride, int64_t num_cols) {
  constexpr int kNV = std::min(D / kLanes, kRowsAccVecs);
  constexpr int kMR = std::max(1, kRowsAccTile / kNV);
  for (int c = 0; c < D / kLanes; c += kNV) {
    float* acc_c = acc_rows + c * kLanes;
    const float* b_c = b + c * kLanes;
    int64_t r = 0;
    for (; r + kMR <= num_rows; r += kMR) {
      rows_acc<D, kMR, kNV>(acc_c + r * D, pt + r * kBlockQ, b_c, b_stride, num_cols);
    }
    if constexpr (kIsAvx512Tiles || kMR != 6) {
      for (; r < num_rows; ++r) rows_acc<D, 1, kNV>(acc_c + r * D, pt + r * kBlockQ, b_c, b_stride, num_cols);
    } else {
      // The leftover rows (64 = 10 x 6 + 4) as one tile, not one by one.
      float* ar = acc_c + r * D;
      const float* pr = pt + r * kBlockQ;
      switch (num_rows - r) {
        case 5: rows_acc<D, 5, kNV>(ar, pr, b_c, b_stride, num_cols); break;
        case 4: rows_acc<D, 4, kNV>(ar, pr, b_c, b_stride, num_cols); break;
        case 3: rows_acc<D, 3, kNV>(ar, pr, b_c, b_stride, num_cols); break;
        case 2: rows_acc<D, 2, kNV>(ar, pr, b_c, b_stride, num_cols); break;
        case 1: rows_acc<D, 1, kNV>(ar, pr, b_c, b_stride, num_cols); break;
        default: break;
      }
    }
  }
}

// Sets s[j][i] = -inf where query q0 + i (task-relative) cannot see key k0 + j: k0 + j > off + q0 + i.
inline void mask_causal(float* s, int64_t num_rows, int64_t k0, int64_t off, int64_t q0) {
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < num_rows; ++j) {
    const int64_t first_visible = k0 + j - off - q0;  // lanes below this are masked
    if (first_visible <= 0) continue;
    const int32_t thr = static_cast<int32_t>(std::min<int64_t>(first_visible, kBlockQ));
    for (int v = 0; v < kQVecs; ++v) {
      const vi hide = lane_index(v) < thr;
      float* row = s + j * kBlockQ + v * kLanes;
      store(row, hide ? neg_inf : load(row));
    }
  }
}

// Problem::is_careful: a block the causal mask cuts, with the masked (key, query) pairs left out
// of every product rather than multiplied by a zero probability, so that a non-finite value of a
// pair no query sees (0 * inf = NaN) reaches no output, as in the reference, which loops over
// visible pairs only. Lane i of key row j is visible when i >= visible_from(j).
inline int64_t visible_from(int64_t j, int64_t k0, int64_t off, int64_t q0) {
  return std::clamp<int64_t>(k0 + j - off - q0, 0, kBlockQ);
}

// Zeroes the masked entries of s ([num_rows, kBlockQ]).
[[gnu::noinline, gnu::cold]] inline void zero_masked(float* s, int64_t num_rows, int64_t k0, int64_t off, int64_t q0) {
  for (int64_t j = 0; j < num_rows; ++j) {
    const int32_t from = static_cast<int32_t>(visible_from(j, k0, off, q0));
    for (int v = 0; v < kQVecs; ++v) {
      float* row = s + j * kBlockQ + v * kLanes;
      store(row, lane_index(v) < from ? splat(0.0f) : load(row));
    }
  }
}

// acc_t[d][i] = acc_t[d][i] * alpha[i] + sum over visible j of a[j][d] * pt[j][i] (alpha ==
// nullptr: no rescale): acc_t_block over a masked block, the careful way.
template <int D>
[[gnu::noinline, gnu::cold]] void acc_t_block_masked(float* acc_t, const vf* alpha, const float* a, int64_t a_stride, const float* pt,
                        int64_t num_rows, int64_t k0, int64_t off, int64_t q0) {
  for (int d = 0; d < D; ++d) {
    vf acc[kQVecs];
    for (int w = 0; w < kQVecs; ++w) {
      acc[w] = load(acc_t + d * kBlockQ + w * kLanes);
      if (alpha != nullptr) acc[w] *= alpha[w];
    }
    for (int64_t j = 0; j < num_rows; ++j) {
      const int32_t from = static_cast<int32_t>(visible_from(j, k0, off, q0));
      const vf x = splat(a[j * a_stride + d]);
      for (int w = 0; w < kQVecs; ++w) {
        const vi seen = lane_index(w) >= from;
        acc[w] += (seen ? x : splat(0.0f)) * (seen ? load(pt + j * kBlockQ + w * kLanes) : splat(0.0f));
      }
    }
    for (int w = 0; w < kQVecs; ++w) store(acc_t + d * kBlockQ + w * kLanes, acc[w]);
  }
}

// acc[j][:] += sum over the queries i < num_cols that see key j of pt[j][i] * b[i][:]:
// rows_acc_block over a masked block, the careful way (acc rows are D long).
template <int D>
[[gnu::noinline, gnu::cold]] void rows_acc_block_masked(float* acc_rows, const float* pt, int64_t num_rows, const float* b, int64_t b_stride,
                           int64_t num_cols, int64_t k0, int64_t off, int64_t q0) {
  for (int64_t j = 0; j < num_rows; ++j) {
    vf acc[D / kLanes];
    for (int c = 0; c < D / kLanes; ++c) acc[c] = load(acc_rows + j * D + c * kLanes);
    for (int64_t i = visible_from(j, k0, off, q0); i < num_cols; ++i) {
      const float x = pt[j * kBlockQ + i];
      for (int c = 0; c < D / kLanes; ++c) acc[c] += x * load(b + i * b_stride + c * kLanes);
    }
    for (int c = 0; c < D / kLanes; ++c) store(acc_rows + j * D + c * kLanes, acc[c]);
  }
}

// Keys of the task a query block can see: [0, key_end).
inline int64_t key_end(const AttnTask& t, int64_t q0, int64_t rows) {
  return t.is_causal ? t.kv_len - t.q_len + q0 + rows : t.kv_len;
}

template <int D>
void forward_block(const Problem& p, const QueryBlock& b, float* o, float* lse, const Scratch& s) {
  const AttnTask& t = p.tasks[b.task];
  const int64_t hk = b.head / (p.num_q_heads / p.num_kv_heads);
  const int64_t q_stride = p.num_q_heads * D;
  const int64_t kv_stride = p.num_kv_heads * D;
  const float c = p.scale * static_cast<float>(M_LOG2E);
  constexpr int64_t kHeadFloats = D * kBlockQ;
  constexpr int64_t kMaxHeads = kFwdScratchFloats / kHeadFloats;
  // b.heads query heads of one KV head: each K/V block is loaded once for all of them.
  DISTCA_CHECK(b.heads >= 1 && b.heads <= kMaxHeads) << b.heads << " heads, at most " << kMaxHeads;
  // 1. Q^T of the block, scaled, zero-padded, per head.
  for (int64_t j = 0; j < b.heads; ++j) {
    const float* q = p.q + (t.q_offset + b.q0) * q_stride + (b.head + j) * D;
    for (int64_t d = 0; d < D; ++d) {
      float* dst = s.qt + j * kHeadFloats + d * kBlockQ;
      for (int64_t i = 0; i < b.rows; ++i) dst[i] = q[i * q_stride + d] * c;
      std::fill(dst + b.rows, dst + kBlockQ, 0.0f);
    }
  }
  std::fill(s.acc, s.acc + b.heads * kHeadFloats, 0.0f);
  vf m[kMaxHeads][kQVecs], l[kMaxHeads][kQVecs];
  for (int64_t j = 0; j < b.heads; ++j) {
    for (int v = 0; v < kQVecs; ++v) {
      m[j][v] = splat(-std::numeric_limits<float>::max());
      l[j][v] = splat(0.0f);
    }
  }
  // 2. Key blocks, online softmax, head by head.
  const int64_t end = key_end(t, b.q0, b.rows);
  const int64_t off = t.kv_len - t.q_len;
  const float* k = p.k + t.kv_offset * kv_stride + hk * D;
  const float* v = p.v + t.kv_offset * kv_stride + hk * D;
  for (int64_t k0 = 0; k0 < end; k0 += kBlockK) {
    const int64_t nk = std::min(kBlockK, end - k0);
    for (int64_t j = 0; j < b.heads; ++j) {
      st_block<D>(k + k0 * kv_stride, kv_stride, s.qt + j * kHeadFloats, nk, s.s);
      if (t.is_causal && k0 + nk - 1 > off + b.q0) mask_causal(s.s, nk, k0, off, b.q0);
      vf m_new[kQVecs], alpha[kQVecs], sum[kQVecs];
      for (int w = 0; w < kQVecs; ++w) m_new[w] = m[j][w];
      for (int64_t r = 0; r < nk; ++r)
        for (int w = 0; w < kQVecs; ++w) m_new[w] = vmax(m_new[w], load(s.s + r * kBlockQ + w * kLanes));
      for (int w = 0; w < kQVecs; ++w) {
        alpha[w] = exp2v(m[j][w] - m_new[w]);
        sum[w] = splat(0.0f);
      }
      for (int64_t r = 0; r < nk; ++r) {
        for (int w = 0; w < kQVecs; ++w) {
          float* row = s.s + r * kBlockQ + w * kLanes;
          const vf e = exp2v(load(row) - m_new[w]);
          sum[w] += e;
          store(row, e);
        }
      }
      for (int w = 0; w < kQVecs; ++w) {
        l[j][w] = l[j][w] * alpha[w] + sum[w];
        m[j][w] = m_new[w];
      }
      if (p.is_careful && t.is_causal && k0 + nk - 1 > off + b.q0) {
        acc_t_block_masked<D>(s.acc + j * kHeadFloats, alpha, v + k0 * kv_stride, kv_stride, s.s, nk, k0, off, b.q0);
      } else {
        acc_t_block<D>(s.acc + j * kHeadFloats, alpha, v + k0 * kv_stride, kv_stride, s.s, nk);
      }
    }
  }
  // 3. O = O^T / l, LSE = (m + log2 l) ln 2; no keys at all: O = 0, LSE = -inf. A row with keys
  //    whose scores are all -inf (an infinite input) has l = 0: NaN, as exp(-inf - -inf) gives.
  //    A NaN l (a NaN input) gives NaN through the arithmetic.
  for (int64_t j = 0; j < b.heads; ++j) {
    float* out = o + (t.q_offset + b.q0) * q_stride + (b.head + j) * D;
    float* out_lse = lse + (t.q_offset + b.q0) * p.num_q_heads + b.head + j;
    const float* acc = s.acc + j * kHeadFloats;
    float mm[kBlockQ], ll[kBlockQ];
    for (int w = 0; w < kQVecs; ++w) {
      store(mm + w * kLanes, m[j][w]);
      store(ll + w * kLanes, l[j][w]);
    }
    for (int64_t i = 0; i < b.rows; ++i) {
      const bool has_keys = (t.is_causal ? off + b.q0 + i + 1 : t.kv_len) > 0;
      if (!has_keys) {
        for (int64_t d = 0; d < D; ++d) out[i * q_stride + d] = 0.0f;
        out_lse[i * p.num_q_heads] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = ll[i] == 0.0f ? std::numeric_limits<float>::quiet_NaN() : 1.0f / ll[i];
      for (int64_t d = 0; d < D; ++d) out[i * q_stride + d] = acc[d * kBlockQ + i] * inv;
      out_lse[i * p.num_q_heads] = ll[i] == 0.0f ? std::numeric_limits<float>::quiet_NaN()
                                                 : (mm[i] + std::log2(ll[i])) * static_cast<float>(M_LN2);
    }
  }
}

template <int D>
void backward_pack(const Problem& p, const QueryBlock& b, const Packed& pk) {
  const AttnTask& t = p.tasks[b.task];
  const int64_t q_stride = p.num_q_heads * D;
  const float c = p.scale * static_cast<float>(M_LOG2E);
  const int64_t row0 = (t.q_offset + b.q0) * q_stride + b.head * D;
  float* qt = pk.qt + b.packed * D * kBlockQ;
  float* dot = pk.dot + b.packed * D * kBlockQ;
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t i = 0; i < b.rows; ++i) {
      qt[d * kBlockQ + i] = p.q[row0 + i * q_stride + d] * c;
      dot[d * kBlockQ + i] = p.d_o[row0 + i * q_stride + d];
    }
    std::fill(qt + d * kBlockQ + b.rows, qt + (d + 1) * kBlockQ, 0.0f);
    std::fill(dot + d * kBlockQ + b.rows, dot + (d + 1) * kBlockQ, 0.0f);
  }
  std::fill(pk.dqt + b.packed * D * kBlockQ, pk.dqt + (b.packed + 1) * D * kBlockQ, 0.0f);
  float* lse2 = pk.lse2 + b.packed * kBlockQ;
  float* delta = pk.delta + b.packed * kBlockQ;
  for (int64_t i = 0; i < kBlockQ; ++i) {
    if (i >= b.rows) {
      lse2[i] = std::numeric_limits<float>::infinity();
      delta[i] = 0.0f;
      continue;
    }
    lse2[i] = p.lse[(t.q_offset + b.q0 + i) * p.num_q_heads + b.head] * static_cast<float>(M_LOG2E);
    float sum = 0.0f;
    for (int64_t d = 0; d < D; ++d) sum += p.d_o[row0 + i * q_stride + d] * p.o[row0 + i * q_stride + d];
    delta[i] = sum;
  }
}

// P^T and dS^T of one (key range, query block) pair, into s.s and s.dp.
template <int D>
void probabilities_and_ds(const float* k, const float* v, int64_t kv_stride, int64_t nk,
                          const float* qt, const float* dot, const float* lse2, const float* delta,
                          bool needs_mask, bool is_careful, int64_t k0, int64_t off, int64_t q0, const Scratch& s) {
  st_block<D>(k, kv_stride, qt, nk, s.s);
  if (needs_mask) mask_causal(s.s, nk, k0, off, q0);
  st_block<D>(v, kv_stride, dot, nk, s.dp);
  vf l2[kQVecs], dl[kQVecs];
  for (int w = 0; w < kQVecs; ++w) {
    l2[w] = load(lse2 + w * kLanes);
    dl[w] = load(delta + w * kLanes);
  }
  for (int64_t j = 0; j < nk; ++j) {
    for (int w = 0; w < kQVecs; ++w) {
      float* srow = s.s + j * kBlockQ + w * kLanes;
      float* drow = s.dp + j * kBlockQ + w * kLanes;
      const vf prob = exp2v(load(srow) - l2[w]);
      store(srow, prob);
      store(drow, prob * (load(drow) - dl[w]));
    }
  }
  if (needs_mask && is_careful) {  // a NaN LSE or dP of a masked pair: 0 there, as never computed
    zero_masked(s.s, nk, k0, off, q0);
    zero_masked(s.dp, nk, k0, off, q0);
  }
}

template <int D>
void backward_unit(const Problem& p, const BwdUnit& u, const Packed& pk, const Scratch& s) {
  const int64_t q_stride = p.num_q_heads * D;
  const int64_t kv_stride = p.num_kv_heads * D;
  // A sweep: as many 64-row key blocks as the dK/dV scratch holds (256 rows at D 64, 128 at
  // D 128), each query block's packed Q^T, dO^T and dQ^T loaded once for all of them.
  constexpr int64_t kSweepRows = kScratchFloats / D;
  static_assert(kSweepRows % kBlockK == 0);
  for (int64_t s0 = u.r0; s0 < u.r1; s0 += kSweepRows) {
    const int64_t s1 = std::min(u.r1, s0 + kSweepRows);
    std::fill(s.dk, s.dk + (s1 - s0) * D, 0.0f);
    std::fill(s.dv, s.dv + (s1 - s0) * D, 0.0f);
    // Heads, then tasks, then query blocks, then key blocks: a key row's sum runs over each
    // head's queries in task order, so cutting a document into in-order shards does not change
    // a single bit; a query row's dQ^T sum runs over its keys in order, whatever the blocks.
    for (int64_t h = u.h0; h < u.h1; ++h) {
      for (int64_t n = 0; n < u.num_tasks; ++n) {
        const int64_t ti = u.tasks[n];
        const AttnTask& t = p.tasks[ti];
        const int64_t a0 = std::max(s0, t.kv_offset);
        const int64_t e0 = std::min(s1, t.kv_offset + t.kv_len);
        if (a0 >= e0 || t.q_len == 0) continue;
        const int64_t off = t.kv_len - t.q_len;
        // Query blocks from the first that sees the sweep's first key of this task.
        const int64_t first_query = t.is_causal ? std::max<int64_t>(0, a0 - t.kv_offset - off) : 0;
        if (first_query >= t.q_len) continue;
        const int64_t num_blocks = (t.q_len + kBlockQ - 1) / kBlockQ;
        for (int64_t qb = first_query / kBlockQ; qb < num_blocks; ++qb) {
          const int64_t q0 = qb * kBlockQ;
          const int64_t rows = std::min(kBlockQ, t.q_len - q0);
          const int64_t packed = pk.block_base[ti] + h * num_blocks + qb;
          const int64_t row0 = (t.q_offset + q0) * q_stride + h * D;
          // The sweep's 64-row key blocks (aligned to the segment) this query block sees.
          for (int64_t r0 = s0; r0 < s1; r0 += kBlockK) {
            const int64_t a = std::max(r0, t.kv_offset);
            const int64_t e = std::min(std::min(s1, r0 + kBlockK), t.kv_offset + t.kv_len);
            if (a >= e) continue;
            const int64_t k0 = a - t.kv_offset;  // task-relative key range [k0, k0 + nk)
            const int64_t nk = e - a;
            if (t.is_causal && k0 > off + q0 + rows - 1) break;  // no query of the block sees them
            const bool needs_mask = t.is_causal && k0 + nk - 1 > off + q0;
            const float* k = p.k + a * kv_stride + u.kv_head * D;
            const float* v = p.v + a * kv_stride + u.kv_head * D;
            probabilities_and_ds<D>(k, v, kv_stride, nk, pk.qt + packed * D * kBlockQ,
                                    pk.dot + packed * D * kBlockQ, pk.lse2 + packed * kBlockQ,
                                    pk.delta + packed * kBlockQ, needs_mask, p.is_careful, k0, off, q0, s);
            if (needs_mask && p.is_careful) {
              rows_acc_block_masked<D>(s.dv + (a - s0) * D, s.s, nk, p.d_o + row0, q_stride, rows, k0, off, q0);
              rows_acc_block_masked<D>(s.dk + (a - s0) * D, s.dp, nk, p.q + row0, q_stride, rows, k0, off, q0);
              acc_t_block_masked<D>(pk.dqt + packed * D * kBlockQ, nullptr, k, kv_stride, s.dp, nk, k0, off, q0);
            } else {
              rows_acc_block<D>(s.dv + (a - s0) * D, s.s, nk, p.d_o + row0, q_stride, rows);
              rows_acc_block<D>(s.dk + (a - s0) * D, s.dp, nk, p.q + row0, q_stride, rows);
              acc_t_block<D>(pk.dqt + packed * D * kBlockQ, nullptr, k, kv_stride, s.dp, nk);
            }
          }
          if (s.poll) s.poll(s.poll_ctx);
        }
      }
    }
    for (int64_t r = 0; r < s1 - s0; ++r) {
      float* dk_out = u.dk + (s0 - u.r0 + r) * u.stride;
      float* dv_out = u.dv + (s0 - u.r0 + r) * u.stride;
      for (int64_t d = 0; d < D; ++d) {
        dk_out[d] = s.dk[r * D + d] * u.dk_scale;
        dv_out[d] = s.dv[r * D + d];
      }
    }
  }
}

template <int D>
void backward_store_dq(const Problem& p, const QueryBlock& b, const Packed& pk, float* dq) {
  const AttnTask& t = p.tasks[b.task];
  const int64_t q_stride = p.num_q_heads * D;
  const float* acc = pk.dqt + b.packed * D * kBlockQ;
  float* out = dq + (t.q_offset + b.q0) * q_stride + b.head * D;
  for (int64_t i = 0; i < b.rows; ++i)
    for (int64_t d = 0; d < D; ++d) out[i * q_stride + d] = acc[d * kBlockQ + i] * p.scale;
}

inline void softmax_row(float* row, int64_t n, float* row_max, float* row_sum) {
  const float c = static_cast<float>(M_LOG2E);
  float m = -std::numeric_limits<float>::max();
  int64_t j = 0;
  vf mv = splat(m);
  for (; j + kLanes <= n; j += kLanes) mv = vmax(mv, load(row + j));
  for (int i = 0; i < kLanes; ++i) m = std::max(m, mv[i]);
  for (; j < n; ++j) m = std::max(m, row[j]);
  const float mc = m * c;
  vf sum = splat(0.0f);
  j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf e = exp2v(load(row + j) * c - mc);
    sum += e;
    store(row + j, e);
  }
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  for (; j < n; ++j) {
    row[j] = std::exp2(row[j] * c - mc);
    total += row[j];
  }
  *row_max = m;
  *row_sum = total;
}

// Head-dim dispatch: D is a template argument so every tile is fully unrolled.
#define DISTCA_HEAD_DIM_DISPATCH(fn, ...)                      \
  switch (p.head_dim) {                                        \
    case 32: return fn<32>(__VA_ARGS__);                       \
    case 64: return fn<64>(__VA_ARGS__);                       \
    case 128: return fn<128>(__VA_ARGS__);                     \
    case 256: return fn<256>(__VA_ARGS__);                     \
    default: DISTCA_CHECK(false) << "head_dim " << p.head_dim << " not instantiated"; \
  }

inline void forward_any(const Problem& p, const QueryBlock& b, float* o, float* lse, const Scratch& s) {
  DISTCA_HEAD_DIM_DISPATCH(forward_block, p, b, o, lse, s)
}
inline void pack_any(const Problem& p, const QueryBlock& b, const Packed& pk) {
  DISTCA_HEAD_DIM_DISPATCH(backward_pack, p, b, pk)
}
inline void unit_any(const Problem& p, const BwdUnit& u, const Packed& pk, const Scratch& s) {
  DISTCA_HEAD_DIM_DISPATCH(backward_unit, p, u, pk, s)
}
inline void store_dq_any(const Problem& p, const QueryBlock& b, const Packed& pk, float* dq) {
  DISTCA_HEAD_DIM_DISPATCH(backward_store_dq, p, b, pk, dq)
}
#undef DISTCA_HEAD_DIM_DISPATCH

// This build's routines under `name` (what CpuAttention::isa() reports).
inline const BlockRoutines& routines_named(const char* name) {
  static const BlockRoutines r{name, forward_any, pack_any, unit_any, store_dq_any, softmax_row};
  return r;
}

}  // namespace DISTCA_ISA_NAMESPACE
}  // namespace distca::kernels::cpu_detail
