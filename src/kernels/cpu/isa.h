// The boundary between the CPU attention driver (attention_cpu.cc: validation, dtype conversion,
// work lists, threads) and the block routines, which are compiled once per instruction set
// (isa_avx512.cc, isa_avx2.cc, isa_portable.cc) from one source (blocks.h); isa_select.cc picks
// the build that runs. Everything here is fp32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "distca/kernels/attention.h"
#include "distca/kernels/registry.h"

namespace distca::kernels::cpu_detail {

constexpr int64_t kBlockQ = 64;  // queries per block, in the vector lanes: 4 AVX-512 vectors, 8 AVX2, 16 portable
constexpr int64_t kBlockK = 64;  // keys per block
constexpr int64_t kMaxHeadDim = std::ranges::max(kCpuHeadDims);  // the registry's "cpu" head dims

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
  // An input holds a NaN or an infinity: the blocks the causal mask cuts leave the masked pairs
  // out of every product (finite inputs take the fast path, which multiplies them by 0).
  bool is_careful = false;
};

// A block of up to kBlockQ queries of one task and one query head.
struct QueryBlock {
  int64_t task = 0;
  int64_t head = 0;
  int64_t q0 = 0;    // first query, relative to the task
  int64_t rows = 0;  // 1..kBlockQ
  int64_t packed = 0;  // index of this block in the backward's packed arrays
  int64_t heads = 1;   // the forward: query heads head..head+heads-1, all of one KV head
};

// One work item of the backward: the key rows [r0, r1) of a segment (the union of the key
// ranges of tasks that share K/V rows) for one KV head, against query heads [h0, h1) of that
// head's group. For every 64-row key block it computes P and dS once per (query block, key block)
// pair and uses them for all three gradients: dV and dK of the key block (summed in scratch over
// heads, then tasks, then query blocks, in that order) and dQ^T of the query block (added into
// Packed::dqt, over keys in order). The key block's sums go to dk/dv rows r0.. with the given row
// stride, dK times dk_scale.
struct BwdUnit {
  int64_t kv_head = 0;
  int64_t h0 = 0, h1 = 0;
  int64_t r0 = 0, r1 = 0;
  const int64_t* tasks = nullptr;  // the segment's tasks, in task order
  int64_t num_tasks = 0;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t stride = 0;
  float dk_scale = 1.0f;
};

// The backward's per-block inputs, packed once per call. Index b is QueryBlock::packed; the
// blocks of task t, head h are block_base[t] + h * ceil(q_len / kBlockQ) + (q0 / kBlockQ).
struct Packed {
  float* qt = nullptr;     // [blocks, D, kBlockQ] Q^T * scale * log2(e), zero-padded
  float* dot = nullptr;    // [blocks, D, kBlockQ] dO^T, zero-padded
  float* lse2 = nullptr;   // [blocks, kBlockQ] LSE * log2(e); +inf in padding
  float* delta = nullptr;  // [blocks, kBlockQ] rowsum(dO * O)
  float* dqt = nullptr;    // [blocks, D, kBlockQ] dQ^T / scale, zeroed by backward_pack
  const int64_t* block_base = nullptr;  // [tasks]
};

// Per-thread scratch, each kBlockK * kMaxHeadDim floats at least (64-byte aligned).
struct Scratch {
  float* s = nullptr;   // [kBlockK, kBlockQ] scores, then probabilities
  float* dp = nullptr;  // [kBlockK, kBlockQ] dP, then dS
  float* acc = nullptr; // [heads, D, kBlockQ] the forward's O^T (kFwdScratchFloats)
  float* qt = nullptr;  // [heads, D, kBlockQ] the forward's packed Q^T (kFwdScratchFloats)
  float* dk = nullptr;  // [kBlockK, D]
  float* dv = nullptr;  // [kBlockK, D]
  // The calling thread's scratch only: CpuAttentionOptions::poll (throttled), called inside a
  // long work item (a backward unit runs up to about 0.1 s on the demo).
  void (*poll)(void*) = nullptr;
  void* poll_ctx = nullptr;
};
constexpr int64_t kScratchFloats = kBlockK * kMaxHeadDim;
// The forward's O^T and Q^T scratch: kFwdScratchFloats / (D * kBlockQ) query heads at once (16 at
// D 64, 8 at D 128; 512 KB at D 128 with both, which stays in a core's L2).
constexpr int64_t kFwdScratchFloats = 4 * kScratchFloats;
constexpr int64_t fwd_heads_at_once(int64_t head_dim) { return kFwdScratchFloats / (head_dim * kBlockQ); }

struct BlockRoutines {
  const char* name;
  // Writes O rows and LSE of one query block (o: [Tq, Hq, D], lse: [Tq, Hq]).
  void (*forward)(const Problem&, const QueryBlock&, float* o, float* lse, const Scratch&);
  // Fills the packed arrays of one query block (and zeroes its dQ^T).
  void (*backward_pack)(const Problem&, const QueryBlock&, const Packed&);
  // Runs one backward unit (see BwdUnit). A unit covers its segment's whole key range, so the
  // query blocks of its heads and tasks get all their dQ^T additions from it alone, and units
  // run in parallel touch disjoint dQ^T blocks and disjoint dk/dv rows.
  void (*backward_unit)(const Problem&, const BwdUnit&, const Packed&, const Scratch&);
  // Writes dQ rows of one query block from its dQ^T.
  void (*backward_store_dq)(const Problem&, const QueryBlock&, const Packed&, float* dq);
  // In place: row[j] = exp(row[j] - max) for j < n; returns max and the sum (for the GEMM
  // baseline's materialized softmax, so it uses the same exp as the fused kernel).
  void (*softmax_row)(float* row, int64_t n, float* row_max, float* row_sum);
};

// One per build (isa_*.cc); the x86-64 ones exist only in x86-64 builds.
const BlockRoutines& avx512_routines();
const BlockRoutines& avx2_routines();
const BlockRoutines& portable_routines();
// The routines of a build this CPU runs (isa_select.cc). REQUIRES: check_cpu_isa(isa) is ok.
const BlockRoutines& routines_for(const std::string& isa);
// The routines of the build an empty CpuAttentionOptions::isa resolves to.
const BlockRoutines& default_routines();

}  // namespace distca::kernels::cpu_detail
