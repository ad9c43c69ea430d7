// Event timing of the schedules the simulator prices: collectives (alpha-beta), a 1F1B
// pipeline, and ping-pong layers (two nano-batches sharing one compute engine and one link).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

namespace distca::sim {

// One direction of a link: a message costs latency + bytes / bytes_per_second.
struct Link {
  double latency_seconds = 0;
  double bytes_per_second = 0;
};

// One all-to-all exchange (a CAD phase) over ranks whose links are all `link`: each rank sends
// and receives at once (full duplex), so the exchange takes as long as the rank with the most
// bytes to send or to receive: latency + max(send, recv) / bandwidth. 0 when nothing moves.
double exchange_seconds(const std::vector<int64_t>& send_bytes, const std::vector<int64_t>& recv_bytes,
                        const Link& link);

enum class Collective { kAllReduce, kAllGather, kReduceScatter, kAllToAll };
const char* collective_name(Collective c);

// Ring alpha-beta model over n ranks: `bytes` is the full buffer (all-reduce: the buffer every
// rank holds; all-gather / reduce-scatter: the gathered result; all-to-all: what one rank sends
// in all). Bus-bandwidth factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n,
// all-to-all (n-1)/n; latency steps: 2(n-1), n-1, n-1, n-1. n = 1 costs nothing.
double collective_seconds(Collective c, double bytes, int n, const Link& link);

// 1F1B over S stages and M micro-batches: stage s runs min(S-s-1, M) forwards, then alternates
// one forward and one backward, then drains its backwards. F(s, m) waits for F(s-1, m), B(s, m)
// for B(s+1, m) (the last stage's for its own F), each plus p2p_seconds. fwd/bwd are [S][M].
struct PipelineTiming {
  double seconds = 0;          // makespan
  std::vector<double> busy;    // (S) seconds each stage computed; the rest is bubble
};
PipelineTiming one_f_one_b(const std::vector<std::vector<double>>& fwd, const std::vector<std::vector<double>>& bwd,
                           double p2p_seconds);

// One layer of one nano-batch: compute `linear`, send `dispatch`, compute `attention`, send
// `ret` (the return), in that order.
struct LayerOps {
  double linear = 0;
  double dispatch = 0;
  double attention = 0;
  double ret = 0;
};
// Ping-pong: two nano-batches' layer chains on one compute engine and one link, each used in a
// fixed order (compute: linear A, linear B, attention A, attention B, next layer ...; link:
// dispatch A, dispatch B, return A, return B, ...): four ticks per layer, where one nano-batch's
// communication overlaps the other's compute. layers[i] = {nano A, nano B}.
double pingpong_seconds(const std::vector<std::array<LayerOps, 2>>& layers);
// The same work with no overlap: every operation after the previous one.
double sequential_seconds(const std::vector<std::array<LayerOps, 2>>& layers);

}  // namespace distca::sim
