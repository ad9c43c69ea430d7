#include "distca/layout/exchange.h"

#include <algorithm>

namespace distca::layout {
namespace {

int64_t rows_of(const std::vector<Segment>& segments) {
  int64_t n = 0;
  for (const Segment& s : segments) n += s.rows;
  return n;
}

// Writes every local row of `segments` at `out`; returns the end.
int64_t* write_local_rows(const std::vector<Segment>& segments, int64_t* out) {
  for (const Segment& s : segments) {
    for (int64_t i = 0; i < s.rows; ++i) *out++ = s.local_row + i;
  }
  return out;
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

// Every array is sized before it is filled: at 512 ranks a rank's arrays hold about a million
// rows, and growing them row by row copied each several times (a third of the time it took).
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
  int64_t unsplit_rows = 0, split_rows = 0, kv_rows = 0;
  for (int32_t s = 0; s < r; ++s) {
    unsplit_rows += rows_of(route.to_server_q[s]);
    split_rows += rows_of(route.to_server_split_q[s]);
    kv_rows += rows_of(route.to_server_kv[s]);
  }
  x.q_send_index.resize(static_cast<size_t>(unsplit_rows + split_rows));
  x.kv_send_index.resize(static_cast<size_t>(kv_rows));
  x.copy_entries.resize(static_cast<size_t>(unsplit_rows));
  x.copy_rows.resize(static_cast<size_t>(unsplit_rows));
  x.merge_entries.resize(static_cast<size_t>(split_rows));
  x.merge_rows.resize(static_cast<size_t>(split_rows));
  int64_t* q_out = x.q_send_index.data();
  int64_t* kv_out = x.kv_send_index.data();
  size_t copied = 0, merged = 0;
  for (int32_t s = 0; s < r; ++s) {
    const int64_t first = q_out - x.q_send_index.data();
    int64_t* const split_begin = write_local_rows(route.to_server_q[s], q_out);
    q_out = write_local_rows(route.to_server_split_q[s], split_begin);
    const int64_t split_first = split_begin - x.q_send_index.data();
    const int64_t end = q_out - x.q_send_index.data();
    x.q_send_splits[s] = end - first;
    for (int64_t m = first; m < split_first; ++m, ++copied) {
      x.copy_entries[copied] = m;
      x.copy_rows[copied] = x.q_send_index[m];
    }
    for (int64_t m = split_first; m < end; ++m, ++merged) {
      x.merge_entries[merged] = m;
      x.merge_rows[merged] = x.q_send_index[m];
    }
    int64_t* const kv_end = write_local_rows(route.to_server_kv[s], kv_out);
    x.kv_send_splits[s] = kv_end - kv_out;
    kv_out = kv_end;
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
  int64_t q_gather_rows = 0, kv_gather_rows = 0, causal_tasks = 0;
  for (const kernels::AttnTask& t : route.tasks) {
    q_gather_rows += t.q_len;
    kv_gather_rows += t.kv_len;
    causal_tasks += t.is_causal ? 1 : 0;
  }
  x.q_gather.resize(static_cast<size_t>(q_gather_rows));
  x.kv_gather.resize(static_cast<size_t>(kv_gather_rows));
  x.causal.cu_seqlens_q = x.causal.cu_seqlens_k = {0};
  x.noncausal.cu_seqlens_q = x.noncausal.cu_seqlens_k = {0};
  x.causal.cu_seqlens_q.reserve(static_cast<size_t>(causal_tasks) + 1);
  x.causal.cu_seqlens_k.reserve(static_cast<size_t>(causal_tasks) + 1);
  const size_t noncausal_tasks = route.tasks.size() - static_cast<size_t>(causal_tasks);
  x.noncausal.cu_seqlens_q.reserve(noncausal_tasks + 1);
  x.noncausal.cu_seqlens_k.reserve(noncausal_tasks + 1);
  int64_t* q_gather = x.q_gather.data();
  int64_t* kv_gather = x.kv_gather.data();
  for (const bool causal : {true, false}) {
    for (const kernels::AttnTask& t : route.tasks) {
      if (t.is_causal != causal) continue;
      add_task(causal ? x.causal : x.noncausal, t);
      q_gather = std::copy_n(q_pos.begin() + t.q_offset, t.q_len, q_gather);
      kv_gather = std::copy_n(kv_pos.begin() + t.kv_offset, t.kv_len, kv_gather);
    }
    if (causal) {
      x.causal_q_rows = q_gather - x.q_gather.data();
      x.causal_kv_rows = kv_gather - x.kv_gather.data();
    }
  }
  return x;
}

}  // namespace distca::layout
