// Documents and pieces: the linear layout of one step. A batch holds R ranks of at most T
// tokens each; a document that overflows a rank continues on the next, so it becomes pieces.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distca/core/status.h"

namespace distca::plan {

// Tokens [begin, end) of document `doc`, held by `rank` in the linear layout.
struct Piece {
  int32_t doc = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int32_t rank = 0;
  int64_t length() const { return end - begin; }
};

// Longest document and largest step: causal pair counts (L^2 / 2) stay exact in 64 bits.
inline constexpr int64_t kMaxTokens = (int64_t{1} << 31) - 1;
// The most ranks (GPUs) a plan or a simulated cluster may have.
inline constexpr int32_t kMaxRanks = 1'000'000;

struct Batch {
  int32_t num_ranks = 0;          // R
  int64_t tokens_per_rank = 0;    // T
  std::vector<int64_t> doc_lengths;  // (num_docs) L of each document
  std::vector<Piece> pieces;      // ordered by rank, then by position in the rank
  // For each document, indices into `pieces` ordered by begin (built by index()).
  std::vector<std::vector<int32_t>> doc_pieces;

  int32_t num_docs() const { return static_cast<int32_t>(doc_lengths.size()); }
  int64_t total_tokens() const;
  // Rebuilds doc_pieces. Called by every constructor below.
  void index();
  // Pieces tile every document exactly, ranks are in range, no rank holds more than T tokens.
  Status validate() const;
};

// Calls fn(owner_rank, rows) for each piece of `doc` that overlaps tokens [begin, end), in
// document order.
template <typename Fn>
void for_each_owner(const Batch& batch, int32_t doc, int64_t begin, int64_t end, Fn&& fn) {
  for (int32_t i : batch.doc_pieces[doc]) {
    const Piece& p = batch.pieces[i];
    if (p.end <= begin) continue;
    if (p.begin >= end) break;
    fn(p.rank, (end < p.end ? end : p.end) - (begin > p.begin ? begin : p.begin));
  }
}

// Packs documents in order into R ranks of T tokens; a document that overflows a rank
// continues on the next. Packing stops when all ranks are full (the last document is cut
// there) or the documents run out (the last ranks stay partly empty).
Result<Batch> pack_documents(const std::vector<int64_t>& lengths, int32_t num_ranks,
                             int64_t tokens_per_rank);

// An explicit batch: ranks[r] lists the lengths of the documents rank r holds, in order; a rank
// may be empty. tokens_per_rank = 0 takes the largest rank's total (1 if every rank is empty).
Result<Batch> batch_from_ranks(const std::vector<std::vector<int64_t>>& ranks,
                               int64_t tokens_per_rank);

// Parses a batch file, {"ranks": [[len, ...], ...]} and no other key (see batch_from_ranks):
// every rank lists at least one document, every length is a positive integer of at most
// kMaxTokens. Ranks may hold different numbers of tokens; tokens_per_rank = 0 takes the largest
// rank's total, else every rank must fit in it. `origin` names the input in errors (a file
// path), and each error names the rank.
Result<Batch> parse_batch_json(const std::string& text, int64_t tokens_per_rank,
                               const std::string& origin);

// Pipeline parallelism with CAD pools the core attention of every (stage, micro-batch) active in
// a tick into one batch over all ranks: part k is a micro-batch's batch (ranks 0..R_k - 1)
// placed on ranks [rank_offset, rank_offset + R_k) of the pool. Documents keep their order,
// part after part; origin[d] names the part (its stage and micro-batch) of pooled document d.
struct PoolPart {
  const Batch* batch = nullptr;
  int32_t rank_offset = 0;
  int32_t stage = 0;
  int32_t micro_batch = 0;
};
struct PooledBatch {
  Batch batch;
  struct Origin {
    int32_t stage = 0, micro_batch = 0, doc = 0;  // the part's stage and micro-batch, and the document there
  };
  std::vector<Origin> origin;  // (pooled docs)
};
// Parts must fit in num_ranks ranks of tokens_per_rank tokens and not share a rank; ranks no
// part covers hold nothing (they serve attention only). No part at all is a valid, empty pool.
Result<PooledBatch> pool_batches(const std::vector<PoolPart>& parts, int32_t num_ranks, int64_t tokens_per_rank);

}  // namespace distca::plan
