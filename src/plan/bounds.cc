#include "distca/plan/bounds.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <vector>

namespace distca::plan {

DispatchBounds dispatch_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs) {
  DispatchBounds b;
  b.max_pairs = max_pairs;
  for (const auto& pieces : batch.doc_pieces) {
    if (pieces.size() > 1) {
      b.why_not = "a document spans ranks (its other owners hold rows for free)";
      return b;
    }
  }
  const int32_t r = batch.num_ranks;
  std::vector<double> load(r, 0.0);
  for (const Piece& p : batch.pieces) load[p.rank] += static_cast<double>(causal_pairs(p.begin, p.end));
  const auto m = static_cast<double>(max_pairs);
  const double unit = 2 * std::sqrt(static_cast<double>(bytes.q) * static_cast<double>(bytes.kv));
  // Senders: out >= excess (more if they also take work in), in pieces of at most m (no server
  // ends above m); fewest bytes in whole pieces of m.
  std::vector<double> room;  // of the servers below m
  double excess = 0;
  for (int32_t s = 0; s < r; ++s) {
    if (load[s] <= m) {
      room.push_back(m - load[s]);
      continue;
    }
    double left = load[s] - m;
    excess += left;
    double send = 0;
    for (int32_t k = 0; k + 1 < r && left > 0; ++k) {
      const double w = std::min(m, left);
      send += unit * std::sqrt(w);
      left -= w;
    }
    b.max_send = std::max(b.max_send, send);
    b.total += send;
  }
  // Receivers: the servers below m take in, net of what they send on, all the excess, each at
  // most its room; so the busiest takes in at least the water level t with
  // sum of min(room, t) = excess.
  double lo = 0, hi = m;
  for (int it = 0; it < 100; ++it) {
    const double t = (lo + hi) / 2;
    double sum = 0;
    for (double c : room) sum += std::min(c, t);
    if (sum >= excess) hi = t; else lo = t;
  }
  b.max_recv = excess > 0 ? unit * std::sqrt(lo) : 0.0;
  // The whole dispatch, by the receivers' rooms: at least unit x sum of I / sqrt(room) over the
  // receivers, each taking I <= room, all of them the excess; least for the largest rooms
  // filled first.
  std::sort(room.begin(), room.end(), std::greater<>());
  double by_rooms = 0, left = excess;
  for (double c : room) {
    if (left <= 0 || c <= 0) break;
    const double take = std::min(c, left);
    by_rooms += unit * take / std::sqrt(c);
    left -= take;
  }
  b.total_by_senders = b.total;
  b.total_by_rooms = by_rooms;
  b.total = std::max(b.total, by_rooms);
  b.is_computed = true;
  return b;
}

LinkBounds link_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs) {
  LinkBounds b;
  b.max_pairs = max_pairs;
  const DispatchBounds fwd = dispatch_lower_bounds(batch, bytes, max_pairs);
  if (!fwd.is_computed) {
    b.why_not = fwd.why_not;
    return b;
  }
  TokenBytes step_rows = bytes;  // what a row costs over the four phases of a stateful step
  step_rows.q = bytes.q + bytes.out + bytes.bwd_do + bytes.bwd_dq;
  step_rows.kv = bytes.kv + bytes.bwd_dkv;
  const DispatchBounds step = dispatch_lower_bounds(batch, step_rows, max_pairs);
  b.fwd_dispatch = std::max(fwd.max_send, fwd.max_recv);
  b.step = std::max(step.max_send, step.max_recv);
  b.is_computed = true;
  return b;
}

}  // namespace distca::plan
