// Lower bounds on the forward dispatch bytes (Q + K/V) of any plan as balanced as a given one,
// so that a planner's bytes can be read against what is possible, not only against another
// planner.
//
// The argument: a server computes a pair (query q, key k) of a document only if it holds both
// rows, so the pairs it computes of one sender's documents are at most a * b for the a query
// rows and b key rows it receives, and those bytes are a * q + b * kv >= 2 sqrt(a b q kv)
// (the square root is subadditive, so work from several documents or senders costs more).
//   - A sender above the load cap M sends at least its excess away, in pieces of at most M (no
//     server ends above M): at least 2 sqrt(q kv) * sum of sqrt(piece), least for whole pieces.
//   - The servers below M take in, net of what they pass on, the whole excess, each at most its
//     room M - load; so the busiest takes in at least the water level t at which
//     sum of min(room, t) covers the excess, and receives at least 2 sqrt(t q kv).
//   - The whole dispatch is at least the sum of the senders' bounds.
//   - And at least what the receivers' rooms allow. Write w(s, r) for the pairs of s's
//     documents that server r computes; the dispatch is at least the sum over s != r of
//     2 sqrt(q kv w(s, r)). A plan may chain work (r takes s's work and hands its own on to r'),
//     but no chain lowers that sum: moving d = min(w(s, r), w(r, r')) so that s sends to r'
//     directly and r keeps its own changes it by sqrt(w(s, r) - d) - sqrt(w(s, r))
//     + sqrt(w(r, r') - d) - sqrt(w(r, r')) + sqrt(w(s, r') + d) - sqrt(w(s, r')) <= 0 (one of
//     the first two terms is -sqrt(d), the last at most sqrt(d)), keeps every server's load and
//     ends (the pairs moved fall by d each time). Without chains a receiver takes in at most its
//     room M - load, in pieces w <= room, each costing at least 2 sqrt(q kv) w / sqrt(room);
//     the receivers take in the whole excess, so the dispatch is at least the least sum of
//     I / sqrt(room) over intakes I <= room covering it: the largest rooms filled first.
// Valid when every document lies on one rank (no receiver owns rows of another rank's
// documents) and rows are not relayed (every row comes from its owner).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distca/plan/batch.h"
#include "distca/plan/cost.h"

namespace distca::plan {

struct DispatchBounds {
  bool is_computed = false;
  std::string why_not;        // when not computed
  int64_t max_pairs = 0;      // the load cap M the bounds hold for (causal pairs)
  double max_send = 0;        // bytes: the busiest sender's dispatch
  double max_recv = 0;        // bytes: the busiest receiver's dispatch
  double total = 0;           // bytes: Q + K/V of the whole dispatch, the larger of:
  double total_by_senders = 0;  //   the senders' bounds summed
  double total_by_rooms = 0;    //   the receivers' rooms
};

// Bounds for every plan whose largest server load is at most max_pairs causal pairs.
DispatchBounds dispatch_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs);

// Lower bounds on the busiest link: per phase, the most bytes any rank sends or receives
// (max over ranks of max(send, receive)), for every plan as balanced as max_pairs.
//   - Forward dispatch: a link carries at least the busiest sender's and at least the busiest
//     receiver's dispatch, so the larger of those two bounds.
//   - A stateful step (the four phases one after the other, each as long as its busiest link):
//     the rank that gives away a rows and b keys sends or receives in the four phases at least
//     a (q + out + dO + dQ) + b (kv + dK/dV) bytes in all, each phase's share at most that
//     phase's busiest link; so the sum of the phases' busiest links is at least the dispatch
//     bound with those per-row costs. The same holds for the rank that takes them in.
//   - And a row a server computes only part of (a key-split task) costs o = out more: the merged
//     O/LSE goes out again with dO. Take one document's piece on one server: a rows of which t
//     whole (the server computes all keys [0, i] of row i), b keys. Whole rows need keys up to
//     the largest of them, so they hold at most t b - t (t - 1) / 2 pairs, and the piece
//     w <= a b - t (t - 1) / 2; it costs a (Q + o) - t o + b K (Q, K: the per-row costs above).
//     With b at its least and t free, that is at least a (Q + o - o^2 / 2K) + K w / a - o / 2 -
//     K / 8a >= 2 sqrt((Q + o - o^2 / 2K) K w) - (o / 2 + K / 8), against 2 sqrt(Q K w) if every
//     row may count as whole: sqrt((Q + o - o^2 / 2K) / Q) = 1.08x higher at 32/8 heads in bf16.
//     A sender's pieces number at most (ranks - 1) x its documents, a receiver's at most the
//     senders' documents, so each bound is the larger of the two forms, the second less that many
//     times o / 2 + K / 8 bytes (a few MB against GB).
struct LinkBounds {
  bool is_computed = false;
  std::string why_not;
  int64_t max_pairs = 0;
  double fwd_dispatch = 0;  // bytes: the forward dispatch's busiest link
  double step = 0;          // bytes: the sum over the four phases (stateful) of each one's busiest link
};
LinkBounds link_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs);

// The step's bound (LinkBounds::step) at each of `max_pairs`, with the same arithmetic where
// documents may span ranks. It is no bound there (a document's other owners hold its rows for
// free), but it follows how the busiest link grows as the cap shrinks, which --tolerance auto
// needs to predict a balance it has not planned.
std::vector<double> step_link_estimates(const Batch& batch, const TokenBytes& bytes, const std::vector<int64_t>& max_pairs);

}  // namespace distca::plan
