// The boundary between the CPU attention driver (attention_cpu.cc: validation, dtype conversion,
// work lists, threads) and the block routines, which are compiled once per instruction set
// (isa_avx512.cc, isa_portable.cc) from one source (blocks.h). Everything here is fp32.
#pragma once

#include <cstdint>

#include "distca/kernels/attention.h"

namespace distca::kernels::cpu_detail {

constexpr int64_t kBlockQ = 64;  // queries per block: four 16-lane vectors
constexpr int64_t kBlockK = 64;  // keys per block
constexpr int64_t kMaxHeadDim = 256;

struct Problem {
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv
  int64_t head_dim = 0;      // D
  float scale = 0;
  const float* q = nullptr;    // [Tq, Hq, D]
  const float* k = nullptr;    // [Tkv, Hkv, D]
  const float* v = nullptr;    // [Tkv, Hkv, D]
  const float* o = nullptr;    // [Tq, Hq, D] (backward)
  const float* d_o = nullptr;  // [Tq, Hq, D] (backward)
  const float* lse = nullptr;  // [Tq, Hq]    (backward)
  const AttnTask* tasks = nullptr;
  int64_t num_tasks = 0;
};

// A block of up to kBlockQ queries of one task and one query head.
struct QueryBlock {
  int64_t task = 0;
  int64_t head = 0;
  int64_t q0 = 0;    // first query, relative to the task
  int64_t rows = 0;  // 1..kBlockQ
  int64_t packed = 0;  // index of this block in the backward's packed arrays
};

// Rows [r0, r1) of the K/V buffer for one KV head: the unit of the dK/dV pass.
struct KvBlock {
  int64_t kv_head = 0;
  int64_t r0 = 0;
  int64_t r1 = 0;
};

// The backward's per-block inputs, packed once per call. Index b is QueryBlock::packed; the
// blocks of task t, head h are block_base[t] + h * ceil(q_len / kBlockQ) + (q0 / kBlockQ).
struct Packed {
  float* qt = nullptr;     // [blocks, D, kBlockQ] Q^T * scale * log2(e), zero-padded
  float* dot = nullptr;    // [blocks, D, kBlockQ] dO^T, zero-padded
  float* lse2 = nullptr;   // [blocks, kBlockQ] LSE * log2(e); +inf in padding
  float* delta = nullptr;  // [blocks, kBlockQ] rowsum(dO * O)
  const int64_t* block_base = nullptr;  // [tasks]
};

// Per-thread scratch, each kBlockK * kMaxHeadDim floats at least (64-byte aligned).
struct Scratch {
  float* s = nullptr;   // [kBlockK, kBlockQ] scores, then probabilities
  float* dp = nullptr;  // [kBlockK, kBlockQ] dP, then dS
  float* acc = nullptr; // [D, kBlockQ] O^T or dQ^T
  float* qt = nullptr;  // [D, kBlockQ] the forward's packed Q^T
  float* dk = nullptr;  // [kBlockK, D]
  float* dv = nullptr;  // [kBlockK, D]
};
constexpr int64_t kScratchFloats = kBlockK * kMaxHeadDim;

struct BlockRoutines {
  const char* name;
  // Writes O rows and LSE of one query block (o: [Tq, Hq, D], lse: [Tq, Hq]).
  void (*forward)(const Problem&, const QueryBlock&, float* o, float* lse, const Scratch&);
  // Fills the packed arrays of one query block.
  void (*backward_pack)(const Problem&, const QueryBlock&, const Packed&);
  // Writes dQ rows of one query block.
  void (*backward_dq)(const Problem&, const QueryBlock&, const Packed&, float* dq, const Scratch&);
  // Writes dK/dV rows [r0, r1) of one KV head: the fp32 sum over every task, head and query
  // block that reads them, in task, head, block order (so the result never depends on threads).
  void (*backward_dkdv)(const Problem&, const KvBlock&, const Packed&, float* dk, float* dv,
                        const Scratch&);
  // In place: row[j] = exp(row[j] - max) for j < n; returns max and the sum (for the GEMM
  // baseline's materialized softmax, so it uses the same exp as the fused kernel).
  void (*softmax_row)(float* row, int64_t n, float* row_max, float* row_sum);
};

bool supports_head_dim(int64_t head_dim);
const BlockRoutines& avx512_routines();
const BlockRoutines& portable_routines();
// AVX-512 where the CPU has it, else portable.
const BlockRoutines& best_routines(bool is_portable = false);

}  // namespace distca::kernels::cpu_detail
