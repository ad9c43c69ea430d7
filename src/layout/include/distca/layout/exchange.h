// One rank's exchange layout for a framework that moves rows with a plain all-to-all of one
// tensor at a time (torch.distributed.all_to_all_single) and runs the server's attention with a
// variable-length kernel (FlashAttention's flash_attn_varlen_func): index arrays and split sizes,
// derived from the rank's Route (route.h), so they move exactly the rows the runtime moves.
//
// Unlike the runtime's one packed message per peer, Q and K/V travel in separate all-to-alls,
// and a rank's rows for itself go through the all-to-all too (its own split), as
// all_to_all_single does. Per rank r (R ranks):
//
//   dispatch   q_send = q_local[q_send_index]      (split by q_send_splits, one chunk per server)
//              kv_send = kv_local[kv_send_index]   (kv_send_splits)
//              all_to_all -> q_recv (q_recv_splits), kv_recv (kv_recv_splits)
//   server     q_var = q_recv[q_gather], kv_var = kv_recv[kv_gather]: the varlen layout, the
//              causal tasks first (rows [0, causal_q_rows) of q_var, [0, causal_kv_rows) of
//              kv_var), then the non-causal ones (key ranges wholly before their queries). Each
//              group has its own cu_seqlens (from 0) and max_seqlen; causal tasks are
//              bottom-right aligned (query i of a task sees keys [0, kv_len - q_len + i]).
//              A task's K/V rows are its own copy in kv_var (varlen kernels take one contiguous
//              key range per sequence), gathered from kv_recv, where they arrived once.
//   return     out_send[q_gather] = o_var (and lse); all_to_all with the Q splits swapped ->
//              out_ret, whose entry m answers q_send_index[m]
//   owner      copy_entries: out_local[copy_rows] = out_ret[copy_entries] (a row's only task);
//              merge_entries/merge_rows: partial results of key-split rows, merged per row by
//              the LSE rule (lse = log sum exp lse_m, o = sum exp(lse_m - lse) o_m)
//   backward   dO (with the merged O and LSE the server needs for the split rows' softmax)
//              goes out as Q did; dq_send[q_gather] = dq_var returns as O did and the owner
//              sums it: dq_local[q_send_index] += dq_ret (fp32). dK/dV: dkv_recv[kv_gather] +=
//              dkv_var (fp32), back with the K/V splits swapped, and dkv_local[kv_send_index] +=
//              dkv_ret.
#pragma once

#include <cstdint>
#include <vector>

#include "distca/layout/route.h"

namespace distca::layout {

// cu_seqlens and maxima of one varlen call.
struct VarlenGroup {
  std::vector<int64_t> cu_seqlens_q;  // (tasks + 1), from 0
  std::vector<int64_t> cu_seqlens_k;  // (tasks + 1), from 0
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  int64_t num_tasks() const { return static_cast<int64_t>(cu_seqlens_q.size()) - 1; }
};

struct ExchangeLayout {
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int64_t num_local_rows = 0;

  // Owner side: local rows in send order, grouped by server 0..R-1; (R) rows per server.
  std::vector<int64_t> q_send_index, q_send_splits;
  std::vector<int64_t> kv_send_index, kv_send_splits;
  // Owner side, for the returned outputs (entries index q_send_index's order).
  std::vector<int64_t> copy_entries, copy_rows;    // unsplit rows: copied
  std::vector<int64_t> merge_entries, merge_rows;  // key-split rows: LSE-merged (dQ summed)

  // Server side: (R) rows from each owner; positions into the received buffers.
  std::vector<int64_t> q_recv_splits, kv_recv_splits;
  std::vector<int64_t> q_gather;   // (server Q rows) varlen row -> position in q_recv
  std::vector<int64_t> kv_gather;  // (sum of task key lengths) varlen row -> position in kv_recv
  VarlenGroup causal, noncausal;
  int64_t causal_q_rows = 0, causal_kv_rows = 0;
};

// The layout of route's rank. Every rank computes its own from the same batch and tasks.
ExchangeLayout exchange_layout(const Route& route);

}  // namespace distca::layout
