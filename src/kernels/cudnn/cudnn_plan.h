// The host side of CudnnAttention (distca/kernels/cudnn.h): how a task list becomes cuDNN calls.
// Plain C++ (no CUDA, no cuDNN), built in every build, so graph keys, shape buckets, task grouping
// and the dK/dV scratch layout are tested on any machine.
//
// cuDNN's fused attention takes a batch of sequences with ragged offsets (THD): sequence b reads
// Q rows from its own offset and K/V rows from its own offset, with its own lengths under a padding
// mask. A CA task is exactly one such sequence, so a task list is one batch per mask kind (bottom-
// right causal, non-causal). cuDNN compiles a graph per shape; a plan changes every step, so the
// graph's shape is bucketed: the batch, the longest query and key lengths and the packed totals
// round up to powers of two, and the slots past the real tasks get length 0.
//
// Pieces of one computation merge into one sequence first: consecutive causal shards of a document
// (shard j's query rows follow shard i's and its keys end where its queries do) are one causal
// sequence over the longer prefix, and consecutive non-causal pieces over the same keys are one
// sequence; each query row sees exactly the keys it saw. So a server holding a run of a
// document's shards runs them at whole-document speed, and their dK/dV needs no sum.
//
// Sequences that still share K/V rows read them through overlapping offsets, which the forward
// allows. The backward writes dK/dV per sequence, so when any two overlap (or the caller wants fp32
// sums) each writes its own rows of a scratch buffer, which one kernel adds into the fp32 sums after
// the call; otherwise cuDNN writes dK/dV in place. The backward's calls each hold sequences with
// disjoint K/V rows (overlapping ones go to separate calls: cuDNN 9.19's backward was measured wrong
// on 128 overlapping shards in one call), so a call's scratch is at most the K/V rows; the calls
// reuse it in stream order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "distca/core/status.h"
#include "distca/kernels/attention.h"

namespace distca::kernels::cudnn {

// What a built graph depends on: calls with equal keys share one graph.
struct GraphKey {
  bool backward = false;
  bool causal = true;
  bool bf16 = true;
  int64_t batch = 0;       // sequence slots (tasks, bucketed)
  int64_t s_q = 0;         // longest query length, bucketed
  int64_t s_kv = 0;        // longest key length, bucketed
  int64_t total_q = 0;     // Q rows of the packed tensor, bucketed (backward workspace bound)
  int64_t total_kv = 0;    // rows of the dK/dV tensor written, bucketed (backward workspace bound)
  int64_t h_q = 0, h_kv = 0, d = 0;
  float scale = 0.f;
  bool top_left = false;   // causal with cuDNN's top-left mask (every sequence of the call is square)
  bool max_total = true;   // backward: the packed totals bound the workspace (set_max_total_seq_len_*)
  bool dense = false;      // one sequence as a dense [1, h, s, d] graph of exactly s_q x s_kv (no offsets)
  bool head_major_lse = false;  // dense: the LSE through an [h, s] buffer (PyTorch's layout)
  bool operator==(const GraphKey&) const = default;
};
struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const;
};

// The next power of two >= n, and at least `floor`.
int64_t bucket(int64_t n, int64_t floor = 1);

// A span of dK/dV rows to add: scratch rows [src_row, src_row + rows) into rows [dst_row, ...).
struct AddSpan {
  int64_t src_row = 0, dst_row = 0, rows = 0;
};

// One cuDNN call: sequences of one mask kind in slots 0..slots.size()-1 (each the merge of one or
// more tasks); the rest of the key.batch slots are empty (length 0). Offsets are in elements of each
// tensor (int32, as cuDNN's ragged offsets), key.batch + 1 of them, non-decreasing past the real
// slots.
struct Call {
  GraphKey key;
  std::vector<int> tasks;        // indices into the task list of every task the call computes
  std::vector<AttnTask> slots;   // what each slot computes
  std::vector<int32_t> seq_q, seq_kv;                      // key.batch each
  std::vector<int32_t> q_off, kv_off, stats_off, dkv_off;  // key.batch + 1 each (dkv_off: backward)
  std::vector<AddSpan> add_spans;  // backward through scratch: added into the sums after this call
};

struct Plan {
  std::vector<Call> calls;
  // Q rows no call writes (uncovered, or a task with no keys): O = 0, LSE = -inf; dQ = 0.
  std::vector<std::pair<int64_t, int64_t>> empty_q_rows;
  // Backward: dK/dV through scratch (kv_scratch_rows rows, each call's from row 0) added into fp32
  // sums by each call's add_spans; otherwise in place, with empty_kv_rows (rows no task reads) zeroed.
  bool kv_scratch = false;
  int64_t kv_scratch_rows = 0;
  std::vector<std::pair<int64_t, int64_t>> empty_kv_rows;
};

// Graph variants, for timing them against each other on a GPU (DISTCA_CUDNN_GRAPH, a comma list of
// their names; each gives the same results):
//   exact-batch   no empty slots: key.batch = the call's sequence count, not its power of two;
//   top-left      cuDNN's top-left causal mask on calls whose sequences all have as many queries as
//                 keys (where it is the bottom-right one), as PyTorch's SDPA asks for;
//   no-max-total  the backward without set_max_total_seq_len_q/kv (its workspace sized by batch x s);
//   dense         a call of one sequence as a dense graph of its exact lengths, at pointers moved to
//                 its rows: no ragged offsets, no padding mask, no sequence lengths (PyTorch's SDPA
//                 graph, with top-left its mask too; a graph per length, so for timing only);
//   head-major-lse  with dense: cuDNN reads and writes the LSE as [h, s] (PyTorch's layout) in a
//                 buffer transposed from and to distca's [T, H].
struct GraphVariants {
  bool exact_batch = false;
  bool top_left = false;
  bool max_total = true;
  bool dense = false;
  bool head_major_lse = false;
};
// "" is the default; an unknown name is an error naming the known ones.
Result<GraphVariants> parse_graph_variants(std::string_view names);

struct PlanOptions {
  bool backward = false;
  bool bf16 = true;
  float scale = 0.f;       // the softmax scale (resolved)
  bool dkv_fp32 = false;   // backward: the caller wants dK/dV as fp32 sums
  GraphVariants variants = {};
};

// Plans the calls of one pass. The dims and tasks must have passed validate(); fails (a Status)
// when an offset does not fit cuDNN's int32 ragged offsets.
Result<Plan> plan_calls(const AttnDims& dims, std::span<const AttnTask> tasks, const PlanOptions& options);

// True when two tasks with keys read a common K/V row.
bool kv_ranges_overlap(std::span<const AttnTask> tasks);

// The tasks with work (queries and keys) merged into sequences as above, each with the indices of
// the tasks it covers; causal and non-causal never merge.
std::vector<std::pair<AttnTask, std::vector<int>>> merge_tasks(std::span<const AttnTask> tasks);

}  // namespace distca::kernels::cudnn
