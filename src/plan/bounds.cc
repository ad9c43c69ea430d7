#include "distca/plan/bounds.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <vector>

namespace distca::plan {

namespace {

// The bounds for rows of q bytes and keys of kv bytes. split_extra > 0 (a stateful step): a row a
// server computes only part of costs that much more (the merged O/LSE again), and a piece's
// bytes are at least max(unit sqrt(w), unit_split sqrt(w) - per_piece) (bounds.h).
DispatchBounds bounds(const Batch& batch, double q, double kv, double split_extra, int64_t max_pairs) {
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
  const double unit = 2 * std::sqrt(q * kv);
  const double o = split_extra;
  const double unit_split = o > 0 ? 2 * std::sqrt((q + o - o * o / (2 * kv)) * kv) : 0.0;
  const double per_piece = o / 2 + kv / 8;
  std::vector<double> docs_on(r, 0.0);  // documents per rank (each lies on one)
  for (const Piece& p : batch.pieces) docs_on[p.rank] += 1;
  double sender_docs = 0;
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
    sender_docs += docs_on[s];
    double roots = 0;  // least sum of sqrt(piece) over its pieces
    for (int32_t k = 0; k + 1 < r && left > 0; ++k) {
      const double w = std::min(m, left);
      roots += std::sqrt(w);
      left -= w;
    }
    // At most one piece per other server and document.
    const double send = std::max(unit * roots, unit_split * roots - (r - 1) * docs_on[s] * per_piece);
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
  // At most one piece per sender's document.
  b.max_recv = excess > 0 ? std::max(unit * std::sqrt(lo), unit_split * std::sqrt(lo) - sender_docs * per_piece) : 0.0;
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

}  // namespace

DispatchBounds dispatch_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs) {
  return bounds(batch, static_cast<double>(bytes.q), static_cast<double>(bytes.kv), 0.0, max_pairs);
}

LinkBounds link_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs) {
  LinkBounds b;
  b.max_pairs = max_pairs;
  const DispatchBounds fwd = dispatch_lower_bounds(batch, bytes, max_pairs);
  if (!fwd.is_computed) {
    b.why_not = fwd.why_not;
    return b;
  }
  // What a row costs over the four phases of a stateful step, and a split row's merged O/LSE.
  const auto q_step = static_cast<double>(bytes.q + bytes.out + bytes.bwd_do + bytes.bwd_dq);
  const auto kv_step = static_cast<double>(bytes.kv + bytes.bwd_dkv);
  const DispatchBounds step = bounds(batch, q_step, kv_step, static_cast<double>(bytes.out), max_pairs);
  b.fwd_dispatch = std::max(fwd.max_send, fwd.max_recv);
  b.step = std::max(step.max_send, step.max_recv);
  b.is_computed = true;
  return b;
}

}  // namespace distca::plan
