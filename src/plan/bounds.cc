#include "distca/plan/bounds.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace distca::plan {

namespace {

// Per rank: its causal pairs and how many documents (pieces) it holds.
struct RankWork {
  std::string why_not;  // set when a document spans ranks and whole documents were asked for
  std::vector<double> load, docs_on;
};

RankWork rank_work(const Batch& batch, bool whole_documents) {
  RankWork w;
  for (const auto& pieces : batch.doc_pieces) {
    if (whole_documents && pieces.size() > 1) {
      w.why_not = "a document spans ranks (its other owners hold rows for free)";
      return w;
    }
  }
  w.load.assign(batch.num_ranks, 0.0);
  w.docs_on.assign(batch.num_ranks, 0.0);
  for (const Piece& p : batch.pieces) {
    w.load[p.rank] += static_cast<double>(causal_pairs(p.begin, p.end));
    w.docs_on[p.rank] += 1;
  }
  return w;
}

// The bounds for rows of q bytes and keys of kv bytes. split_extra > 0 (a stateful step): a row a
// server computes only part of costs that much more (the merged O/LSE again), and a piece's
// bytes are at least max(unit sqrt(w), unit_split sqrt(w) - per_piece) (bounds.h).
DispatchBounds bounds(const RankWork& work, double q, double kv, double split_extra, int64_t max_pairs) {
  DispatchBounds b;
  b.max_pairs = max_pairs;
  if (!work.why_not.empty()) {
    b.why_not = work.why_not;
    return b;
  }
  const auto r = static_cast<int32_t>(work.load.size());
  const std::vector<double>& load = work.load;
  const std::vector<double>& docs_on = work.docs_on;
  const auto m = static_cast<double>(max_pairs);
  const double unit = 2 * std::sqrt(q * kv);
  const double o = split_extra;
  const double unit_split = o > 0 ? 2 * std::sqrt((q + o - o * o / (2 * kv)) * kv) : 0.0;
  const double per_piece = o / 2 + kv / 8;
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
  // The rooms smallest first: t lies where the rooms below it and t for each of the rest cover the
  // excess (m, the cap, when no level does).
  std::sort(room.begin(), room.end());
  double level = m, below = 0;
  for (size_t i = 0; i < room.size(); ++i) {
    const double rest = static_cast<double>(room.size() - i);
    if (below + rest * room[i] >= excess) {
      level = std::max(0.0, (excess - below) / rest);
      break;
    }
    below += room[i];
  }
  // At most one piece per sender's document.
  b.max_recv =
      excess > 0 ? std::max(unit * std::sqrt(level), unit_split * std::sqrt(level) - sender_docs * per_piece) : 0.0;
  // The whole dispatch, by the receivers' rooms: at least unit x sum of I / sqrt(room) over the
  // receivers, each taking I <= room, all of them the excess; least for the largest rooms
  // filled first.
  double by_rooms = 0, left = excess;
  for (auto it = room.rbegin(); it != room.rend(); ++it) {  // the largest rooms first
    const double c = *it;
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
  return bounds(rank_work(batch, true), static_cast<double>(bytes.q), static_cast<double>(bytes.kv), 0.0, max_pairs);
}

namespace {

// What a row costs over the four phases of a stateful step, and a split row's merged O/LSE.
DispatchBounds step_bounds(const RankWork& work, const TokenBytes& bytes, int64_t max_pairs) {
  const auto q_step = static_cast<double>(bytes.q + bytes.out + bytes.bwd_do + bytes.bwd_dq);
  const auto kv_step = static_cast<double>(bytes.kv + bytes.bwd_dkv);
  return bounds(work, q_step, kv_step, static_cast<double>(bytes.out), max_pairs);
}

}  // namespace

LinkBounds link_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs) {
  LinkBounds b;
  b.max_pairs = max_pairs;
  const RankWork work = rank_work(batch, true);
  const DispatchBounds fwd =
      bounds(work, static_cast<double>(bytes.q), static_cast<double>(bytes.kv), 0.0, max_pairs);
  if (!fwd.is_computed) {
    b.why_not = fwd.why_not;
    return b;
  }
  const DispatchBounds step = step_bounds(work, bytes, max_pairs);
  b.fwd_dispatch = std::max(fwd.max_send, fwd.max_recv);
  b.step = std::max(step.max_send, step.max_recv);
  b.is_computed = true;
  return b;
}

std::vector<double> step_link_estimates(const Batch& batch, const TokenBytes& bytes, const std::vector<int64_t>& max_pairs) {
  const RankWork work = rank_work(batch, false);
  std::vector<double> out;
  for (const int64_t m : max_pairs) {
    const DispatchBounds step = step_bounds(work, bytes, m);
    out.push_back(std::max(step.max_send, step.max_recv));
  }
  return out;
}

}  // namespace distca::plan
