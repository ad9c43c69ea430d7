#include "distca/runtime/exchange.h"

#include <algorithm>

namespace distca::runtime {
namespace {

// Appends every local row of `segments` to `index`; returns how many.
int64_t append_local_rows(const std::vector<Segment>& segments, std::vector<int64_t>& index) {
  int64_t n = 0;
  for (const Segment& s : segments) {
    for (int64_t i = 0; i < s.rows; ++i) index.push_back(s.local_row + i);
    n += s.rows;
  }
  return n;
}

// position[server_row] = where that row lands in the received buffer; returns the rows received.
int64_t record_positions(const std::vector<Segment>& segments, int64_t next, std::vector<int64_t>& position) {
  for (const Segment& s : segments) {
    for (int64_t i = 0; i < s.rows; ++i) position[s.server_row + i] = next++;
  }
  return next;
}

void add_task(VarlenGroup& g, const kernels::AttnTask& t) {
  g.cu_seqlens_q.push_back(g.cu_seqlens_q.back() + t.q_len);
  g.cu_seqlens_k.push_back(g.cu_seqlens_k.back() + t.kv_len);
  g.max_seqlen_q = std::max(g.max_seqlen_q, t.q_len);
  g.max_seqlen_k = std::max(g.max_seqlen_k, t.kv_len);
}

}  // namespace

ExchangeLayout exchange_layout(const Route& route) {
  const int32_t r = route.num_ranks;
  ExchangeLayout x;
  x.rank = route.rank;
  x.num_ranks = r;
  x.num_local_rows = route.num_local_rows;
  x.q_send_splits.assign(r, 0);
  x.kv_send_splits.assign(r, 0);
  x.q_recv_splits.assign(r, 0);
  x.kv_recv_splits.assign(r, 0);

  // Owner: per server, its unsplit Q rows, then its split ones (the order route.h sends them in).
  for (int32_t s = 0; s < r; ++s) {
    const int64_t first = static_cast<int64_t>(x.q_send_index.size());
    const int64_t unsplit = append_local_rows(route.to_server_q[s], x.q_send_index);
    const int64_t split = append_local_rows(route.to_server_split_q[s], x.q_send_index);
    x.q_send_splits[s] = unsplit + split;
    for (int64_t m = first; m < first + unsplit; ++m) {
      x.copy_entries.push_back(m);
      x.copy_rows.push_back(x.q_send_index[m]);
    }
    for (int64_t m = first + unsplit; m < first + unsplit + split; ++m) {
      x.merge_entries.push_back(m);
      x.merge_rows.push_back(x.q_send_index[m]);
    }
    x.kv_send_splits[s] = append_local_rows(route.to_server_kv[s], x.kv_send_index);
  }

  // Server: where each of its Q and K/V buffer rows arrives, owner after owner.
  std::vector<int64_t> q_pos(route.num_server_q_rows, -1), kv_pos(route.num_server_kv_rows, -1);
  int64_t q_next = 0, kv_next = 0;
  for (int32_t o = 0; o < r; ++o) {
    const int64_t q_first = q_next, kv_first = kv_next;
    q_next = record_positions(route.from_owner_q[o], q_next, q_pos);
    q_next = record_positions(route.from_owner_split_q[o], q_next, q_pos);
    kv_next = record_positions(route.from_owner_kv[o], kv_next, kv_pos);
    x.q_recv_splits[o] = q_next - q_first;
    x.kv_recv_splits[o] = kv_next - kv_first;
  }

  // Varlen layout: causal tasks first, then the non-causal ones, each in plan order.
  x.causal.cu_seqlens_q = x.causal.cu_seqlens_k = {0};
  x.noncausal.cu_seqlens_q = x.noncausal.cu_seqlens_k = {0};
  for (const bool causal : {true, false}) {
    for (const kernels::AttnTask& t : route.tasks) {
      if (t.is_causal != causal) continue;
      add_task(causal ? x.causal : x.noncausal, t);
      for (int64_t i = 0; i < t.q_len; ++i) x.q_gather.push_back(q_pos[t.q_offset + i]);
      for (int64_t i = 0; i < t.kv_len; ++i) x.kv_gather.push_back(kv_pos[t.kv_offset + i]);
    }
    if (causal) {
      x.causal_q_rows = static_cast<int64_t>(x.q_gather.size());
      x.causal_kv_rows = static_cast<int64_t>(x.kv_gather.size());
    }
  }
  return x;
}

}  // namespace distca::runtime
