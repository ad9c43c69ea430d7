#include "distca/sim/timing.h"

#include <algorithm>

#include "distca/core/check.h"

namespace distca::sim {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all-reduce";
    case Collective::kAllGather: return "all-gather";
    case Collective::kReduceScatter: return "reduce-scatter";
    case Collective::kAllToAll: return "all-to-all";
  }
  return "?";
}

double exchange_seconds(const std::vector<int64_t>& send_bytes, const std::vector<int64_t>& recv_bytes,
                        const Link& link) {
  DISTCA_CHECK(send_bytes.size() == recv_bytes.size() && link.bytes_per_second > 0) << "exchange over a link";
  double worst = 0;
  for (size_t r = 0; r < send_bytes.size(); ++r) {
    const double bytes = static_cast<double>(std::max(send_bytes[r], recv_bytes[r]));
    if (bytes > 0) worst = std::max(worst, link.latency_seconds + bytes / link.bytes_per_second);
  }
  return worst;
}

double collective_seconds(Collective c, double bytes, int n, const Link& link) {
  DISTCA_CHECK(n >= 1 && bytes >= 0 && link.bytes_per_second > 0) << "collective over " << n << " ranks";
  if (n == 1 || bytes == 0) return 0;
  const double k = static_cast<double>(n - 1) / n;
  const double factor = c == Collective::kAllReduce ? 2 * k : k;
  const double steps = c == Collective::kAllReduce ? 2.0 * (n - 1) : static_cast<double>(n - 1);
  return steps * link.latency_seconds + factor * bytes / link.bytes_per_second;
}

PipelineTiming one_f_one_b(const std::vector<std::vector<double>>& fwd, const std::vector<std::vector<double>>& bwd,
                           double p2p) {
  const int S = static_cast<int>(fwd.size());
  DISTCA_CHECK(S >= 1 && fwd.size() == bwd.size()) << "fwd and bwd need the same stages";
  const int M = static_cast<int>(fwd[0].size());
  // Each stage's order of operations: (is_backward, micro-batch).
  std::vector<std::vector<std::pair<bool, int>>> order(S);
  for (int s = 0; s < S; ++s) {
    const int warm = std::min(S - s - 1, M);
    for (int m = 0; m < warm; ++m) order[s].push_back({false, m});
    for (int i = 0; i < M - warm; ++i) order[s].push_back({false, warm + i}), order[s].push_back({true, i});
    for (int m = M - warm; m < M; ++m) order[s].push_back({true, m});
  }
  std::vector<std::vector<double>> f_end(S, std::vector<double>(M, -1)), b_end(S, std::vector<double>(M, -1));
  std::vector<size_t> next(S, 0);
  std::vector<double> free_at(S, 0);
  PipelineTiming t;
  t.busy.assign(S, 0);
  for (size_t done = 0, total = static_cast<size_t>(2 * S * M); done < total;) {
    bool progressed = false;
    for (int s = 0; s < S; ++s) {
      while (next[s] < order[s].size()) {
        const auto [is_bwd, m] = order[s][next[s]];
        double ready = 0;
        if (!is_bwd) {
          if (s > 0 && f_end[s - 1][m] < 0) break;
          ready = s > 0 ? f_end[s - 1][m] + p2p : 0;
        } else if (s == S - 1) {
          if (f_end[s][m] < 0) break;
          ready = f_end[s][m];
        } else {
          if (b_end[s + 1][m] < 0) break;
          ready = b_end[s + 1][m] + p2p;
        }
        const double cost = is_bwd ? bwd[s][m] : fwd[s][m];
        const double end = std::max(ready, free_at[s]) + cost;
        (is_bwd ? b_end : f_end)[s][m] = end;
        free_at[s] = end;
        t.busy[s] += cost;
        t.seconds = std::max(t.seconds, end);
        ++next[s], ++done;
        progressed = true;
      }
    }
    DISTCA_CHECK(progressed) << "1F1B schedule deadlocked";
  }
  return t;
}

double pingpong_seconds(const std::vector<std::array<LayerOps, 2>>& layers) {
  double compute_free = 0, link_free = 0;
  std::array<double, 2> chain{0, 0};  // when each nano-batch's last operation ended
  auto compute = [&](int n, double seconds) { chain[n] = compute_free = std::max(compute_free, chain[n]) + seconds; };
  auto send = [&](int n, double seconds) { chain[n] = link_free = std::max(link_free, chain[n]) + seconds; };
  for (const auto& layer : layers) {
    for (int n = 0; n < 2; ++n) compute(n, layer[n].linear);
    for (int n = 0; n < 2; ++n) send(n, layer[n].dispatch);
    for (int n = 0; n < 2; ++n) compute(n, layer[n].attention);
    for (int n = 0; n < 2; ++n) send(n, layer[n].ret);
  }
  return std::max(chain[0], chain[1]);
}

double sequential_seconds(const std::vector<std::array<LayerOps, 2>>& layers) {
  double t = 0;
  for (const auto& layer : layers) {
    for (const LayerOps& op : layer) t += op.linear + op.dispatch + op.attention + op.ret;
  }
  return t;
}

}  // namespace distca::sim
