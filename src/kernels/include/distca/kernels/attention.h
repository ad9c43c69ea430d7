// Core attention over a list of CA tasks: the interface every implementation (ref/, cpu/, the
// BLAS baseline, cuda/) takes, plus the parts they share: validation, causal-aware FLOP counts
// and the LSE merge of partial results.
//
// Layout (docs/design.md §2): packed THD. Q is [Tq, Hq, D], K and V are [Tkv, Hkv, D], row-major.
// Query head h reads key/value head h / (Hq / Hkv) (GQA). A task addresses Q rows
// [q_offset, q_offset + q_len) and K/V rows [kv_offset, kv_offset + kv_len). Causal tasks are
// bottom-right aligned: query i of the task (0-based) sees task keys [0, kv_len - q_len + i].
// Non-causal tasks (KV-range pieces wholly before their queries) see all kv_len keys. Several
// tasks may address the same K/V rows (shards of one document share its prefix, stored once);
// the Q ranges of tasks are disjoint.
//
// Every output element is written: Q rows no task covers get O = 0, LSE = -inf and dQ = 0; K/V
// rows no task reads get dK = dV = 0. A query that sees no key (a non-causal task with
// kv_len = 0) gets O = 0, LSE = -inf.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "distca/core/bf16.h"
#include "distca/core/status.h"

namespace distca::kernels {

struct AttnTask {
  int64_t q_offset = 0;
  int64_t q_len = 0;
  int64_t kv_offset = 0;
  int64_t kv_len = 0;
  bool is_causal = true;
};

struct AttnDims {
  int64_t num_q_rows = 0;   // Tq
  int64_t num_kv_rows = 0;  // Tkv
  int64_t num_q_heads = 0;  // Hq
  int64_t num_kv_heads = 0; // Hkv; Hq % Hkv == 0
  int64_t head_dim = 0;     // D
};

// T is float or bf16 (storage); accumulation is fp32 in every fast path.
template <typename T>
struct AttnFwdParams {
  AttnDims dims;
  const T* q = nullptr;  // [Tq, Hq, D]
  const T* k = nullptr;  // [Tkv, Hkv, D]
  const T* v = nullptr;  // [Tkv, Hkv, D]
  std::span<const AttnTask> tasks;
  std::optional<float> scale;  // softmax scale; default 1 / sqrt(D)
  T* o = nullptr;              // [Tq, Hq, D] out
  float* lse = nullptr;        // [Tq, Hq] out, natural log
};

template <typename T>
struct AttnBwdParams {
  AttnDims dims;
  const T* q = nullptr;      // [Tq, Hq, D]
  const T* k = nullptr;      // [Tkv, Hkv, D]
  const T* v = nullptr;      // [Tkv, Hkv, D]
  const T* o = nullptr;      // [Tq, Hq, D] the forward's output
  const float* lse = nullptr;// [Tq, Hq] the forward's LSE
  const T* d_o = nullptr;    // [Tq, Hq, D] gradient of the loss w.r.t. O
  std::span<const AttnTask> tasks;
  std::optional<float> scale;
  T* dq = nullptr;  // [Tq, Hq, D] out
  T* dk = nullptr;  // [Tkv, Hkv, D] out; a row read by several tasks gets their fp32 sum
  T* dv = nullptr;  // [Tkv, Hkv, D] out
};

float softmax_scale(const AttnDims& dims, std::optional<float> scale);

// Checks dims, every task's ranges, disjoint Q ranges and non-null buffers. The kernels trust
// what passed. `ranges` is scratch for the disjointness check; a caller that validates every
// call passes its own so that nothing is allocated once it has grown.
using RangeScratch = std::vector<std::pair<int64_t, int64_t>>;
Status validate(const AttnDims& dims, std::span<const AttnTask> tasks, RangeScratch* ranges = nullptr);
template <typename T>
Status validate(const AttnFwdParams<T>& p, RangeScratch* ranges = nullptr);
template <typename T>
Status validate(const AttnBwdParams<T>& p, RangeScratch* ranges = nullptr);

// (query, key) pairs a task computes (per head): causal tasks count the bottom-right triangle.
int64_t task_pairs(const AttnTask& task);
int64_t total_pairs(std::span<const AttnTask> tasks);
// FLOPs of the forward: 4 * D * Hq per pair (QK^T and PV, a multiply-add counting 2). The
// backward is counted as 2.5x the forward (five matrix products against two), as FlashAttention
// reports it, whatever an implementation recomputes.
double forward_flops(const AttnDims& dims, std::span<const AttnTask> tasks);
double backward_flops(const AttnDims& dims, std::span<const AttnTask> tasks);

// LSE merge: folds a partial result (o_part, lse_part) of the same queries over a key range
// disjoint from the one already in (o, lse) into (o, lse), exactly:
//   lse' = log(exp(lse) + exp(lse_part)),  o' = exp(lse - lse') o + exp(lse_part - lse') o_part.
// A partial with lse = -inf (no keys) contributes nothing. Shapes: o [rows, H, D], lse [rows, H].
template <typename T>
void lse_merge(int64_t num_rows, int64_t num_heads, int64_t head_dim, const T* o_part,
               const float* lse_part, T* o, float* lse);

}  // namespace distca::kernels
