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
// Valid when every document lies on one rank (no receiver owns rows of another rank's
// documents) and rows are not relayed (every row comes from its owner).
#pragma once

#include <cstdint>
#include <string>

#include "distca/plan/batch.h"
#include "distca/plan/cost.h"

namespace distca::plan {

struct DispatchBounds {
  bool is_computed = false;
  std::string why_not;        // when not computed
  int64_t max_pairs = 0;      // the load cap M the bounds hold for (causal pairs)
  double max_send = 0;        // bytes: the busiest sender's dispatch
  double max_recv = 0;        // bytes: the busiest receiver's dispatch
  double total = 0;           // bytes: Q + K/V of the whole dispatch
};

// Bounds for every plan whose largest server load is at most max_pairs causal pairs.
DispatchBounds dispatch_lower_bounds(const Batch& batch, const TokenBytes& bytes, int64_t max_pairs);

}  // namespace distca::plan
