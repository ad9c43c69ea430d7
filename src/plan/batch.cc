#include "distca/plan/batch.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "distca/core/json.h"

#include <algorithm>

namespace distca::plan {

int64_t Batch::total_tokens() const {
  int64_t total = 0;
  for (const Piece& p : pieces) total += p.length();
  return total;
}

void Batch::index() {
  doc_pieces.assign(doc_lengths.size(), {});
  for (int32_t i = 0; i < static_cast<int32_t>(pieces.size()); ++i) {
    doc_pieces[pieces[i].doc].push_back(i);
  }
  for (auto& list : doc_pieces) {
    std::sort(list.begin(), list.end(),
              [&](int32_t a, int32_t b) { return pieces[a].begin < pieces[b].begin; });
  }
}

Status Batch::validate() const {
  if (num_ranks <= 0) return invalid_argument(fmt::format("ranks must be positive, got {}", num_ranks));
  if (tokens_per_rank <= 0) {
    return invalid_argument(fmt::format("tokens per rank must be positive, got {}", tokens_per_rank));
  }
  std::vector<int64_t> rank_tokens(num_ranks, 0);
  for (const Piece& p : pieces) {
    if (p.doc < 0 || p.doc >= num_docs() || p.rank < 0 || p.rank >= num_ranks ||
        p.begin < 0 || p.end <= p.begin || p.end > doc_lengths[p.doc]) {
      return invalid_argument(fmt::format("malformed piece: doc {} [{}, {}) on rank {}", p.doc,
                                          p.begin, p.end, p.rank));
    }
    rank_tokens[p.rank] += p.length();
  }
  int64_t total = 0;
  for (const int64_t length : doc_lengths) {
    if (length > 0 && (length > kMaxTokens || (total += length) > kMaxTokens)) {
      return invalid_argument(fmt::format("more than {} tokens in the batch (a step holds at most that many; the "
                                          "sums of causal pairs stay within 64 bits below it)",
                                          kMaxTokens));
    }
  }
  for (int32_t r = 0; r < num_ranks; ++r) {
    if (rank_tokens[r] > tokens_per_rank) {
      return invalid_argument(fmt::format("rank {} holds {} tokens, more than tokens per rank {}", r,
                                          rank_tokens[r], tokens_per_rank));
    }
  }
  if (doc_pieces.size() != doc_lengths.size()) return invalid_argument("batch is not indexed");
  for (int32_t d = 0; d < num_docs(); ++d) {
    if (doc_lengths[d] <= 0) {
      return invalid_argument(fmt::format("document {} has length {}", d, doc_lengths[d]));
    }
    int64_t at = 0;
    for (int32_t i : doc_pieces[d]) {
      if (pieces[i].begin != at) {
        return invalid_argument(fmt::format("pieces of document {} do not tile it at token {}", d, at));
      }
      at = pieces[i].end;
    }
    if (at != doc_lengths[d]) {
      return invalid_argument(fmt::format("pieces of document {} end at {} of {}", d, at, doc_lengths[d]));
    }
  }
  return Status::ok();
}

Result<Batch> pack_documents(const std::vector<int64_t>& lengths, int32_t num_ranks,
                             int64_t tokens_per_rank) {
  if (num_ranks <= 0) return invalid_argument(fmt::format("ranks must be positive, got {}", num_ranks));
  if (tokens_per_rank <= 0) {
    return invalid_argument(fmt::format("tokens per rank must be positive, got {}", tokens_per_rank));
  }
  if (int64_t{num_ranks} * tokens_per_rank > kMaxTokens) {
    return invalid_argument(fmt::format("{} ranks x {} tokens is more than {} tokens per step", num_ranks,
                                        tokens_per_rank, kMaxTokens));
  }
  Batch batch;
  batch.num_ranks = num_ranks;
  batch.tokens_per_rank = tokens_per_rank;
  int32_t rank = 0;
  int64_t used = 0;  // tokens on `rank`
  for (int64_t length : lengths) {
    if (length <= 0) {
      return invalid_argument(fmt::format("document length must be positive, got {}", length));
    }
    if (rank == num_ranks) break;
    const int32_t doc = batch.num_docs();
    int64_t at = 0;
    while (at < length && rank < num_ranks) {
      const int64_t take = std::min(length - at, tokens_per_rank - used);
      batch.pieces.push_back(Piece{doc, at, at + take, rank});
      at += take;
      used += take;
      if (used == tokens_per_rank) {
        ++rank;
        used = 0;
      }
    }
    batch.doc_lengths.push_back(at);  // cut where the batch is full
  }
  batch.index();
  return batch;
}

Result<Batch> batch_from_ranks(const std::vector<std::vector<int64_t>>& ranks,
                               int64_t tokens_per_rank) {
  if (ranks.empty()) return invalid_argument("a batch needs at least one rank");
  if (tokens_per_rank < 0) {
    return invalid_argument(fmt::format("tokens per rank must be positive, got {}", tokens_per_rank));
  }
  Batch batch;
  batch.num_ranks = static_cast<int32_t>(ranks.size());
  int64_t largest = 0, total = 0;
  for (int32_t r = 0; r < batch.num_ranks; ++r) {
    int64_t used = 0;
    for (int64_t length : ranks[r]) {
      if (length <= 0) {
        return invalid_argument(
            fmt::format("rank {}: document length must be positive, got {}", r, length));
      }
      if (length > kMaxTokens || used + length > kMaxTokens) {
        return invalid_argument(fmt::format("rank {}: more than {} tokens", r, kMaxTokens));
      }
      batch.pieces.push_back(Piece{batch.num_docs(), 0, length, r});
      batch.doc_lengths.push_back(length);
      used += length;
    }
    if (tokens_per_rank > 0 && used > tokens_per_rank) {
      return invalid_argument(fmt::format("rank {} holds {} tokens, more than --tokens-per-rank {}",
                                          r, used, tokens_per_rank));
    }
    largest = std::max(largest, used);
    total += used;
    if (total > kMaxTokens) {
      // Sums of causal pairs over a step stay within 64 bits only below 2^31 tokens.
      return invalid_argument(fmt::format("more than {} tokens in the batch (a step holds at most that many)", kMaxTokens));
    }
  }
  batch.tokens_per_rank = tokens_per_rank > 0 ? tokens_per_rank : std::max<int64_t>(largest, 1);
  batch.index();
  return batch;
}

Result<Batch> parse_batch_json(const std::string& text, int64_t tokens_per_rank,
                               const std::string& origin) {
  constexpr const char* kShape = "{\"ranks\": [[len, ...], ...]}";
  DISTCA_ASSIGN_OR_RETURN(const nlohmann::json json, parse_json(text, origin));
  if (!json.is_object() || !json.contains("ranks") || !json["ranks"].is_array()) {
    return invalid_argument(fmt::format("{}: expected an object {}", origin, kShape));
  }
  for (const auto& [key, value] : json.items()) {
    if (key != "ranks") {
      return invalid_argument(fmt::format("{}: unknown key \"{}\" (a batch file is {} and nothing else)", origin,
                                          text_excerpt(key), kShape));
    }
  }
  std::vector<std::vector<int64_t>> ranks;
  for (const auto& rank : json["ranks"]) {
    const size_t r = ranks.size();
    if (!rank.is_array()) {
      return invalid_argument(fmt::format("{}: rank {} is {}, expected an array of document lengths", origin, r,
                                          json_excerpt(rank)));
    }
    // A rank of a training step always holds tokens: an empty one is a mistake in the file.
    if (rank.empty()) {
      return invalid_argument(fmt::format("{}: rank {} lists no documents; every rank needs at least one "
                                          "document length (a positive integer)", origin, r));
    }
    std::vector<int64_t> lengths;
    for (const auto& length : rank) {
      // JSON reads 0 and up as unsigned, negative integers as signed.
      const bool is_positive_integer = length.is_number_unsigned() ? length.get<uint64_t>() > 0
                                                                   : length.is_number_integer() && length.get<int64_t>() > 0;
      if (!is_positive_integer) {
        return invalid_argument(fmt::format("{}: rank {} document {} has length {}, expected a positive integer",
                                            origin, r, lengths.size(), json_excerpt(length)));
      }
      if (length.get<uint64_t>() > static_cast<uint64_t>(kMaxTokens)) {
        return invalid_argument(fmt::format("{}: rank {} document {} has length {}, more than {} tokens", origin, r,
                                            lengths.size(), json_excerpt(length), kMaxTokens));
      }
      lengths.push_back(length.get<int64_t>());
    }
    ranks.push_back(std::move(lengths));
  }
  auto batch = batch_from_ranks(ranks, tokens_per_rank);
  if (!batch.is_ok()) return invalid_argument(origin + ": " + batch.status().message());
  return batch;
}

Result<PooledBatch> pool_batches(const std::vector<PoolPart>& parts, int32_t num_ranks, int64_t tokens_per_rank) {
  PooledBatch out;
  out.batch.num_ranks = num_ranks;
  out.batch.tokens_per_rank = tokens_per_rank;
  std::vector<int> owner(static_cast<size_t>(std::max(num_ranks, 0)), -1);
  for (size_t k = 0; k < parts.size(); ++k) {
    const PoolPart& part = parts[k];
    if (part.batch == nullptr) return invalid_argument(fmt::format("pool part {} has no batch", k));
    const Batch& b = *part.batch;
    if (part.rank_offset < 0 || part.rank_offset + b.num_ranks > num_ranks) {
      return invalid_argument(fmt::format("pool part {} (stage {}, micro-batch {}): ranks [{}, {}) are not within the pool's {}",
                                          k, part.stage, part.micro_batch, part.rank_offset, part.rank_offset + b.num_ranks, num_ranks));
    }
    if (b.tokens_per_rank > tokens_per_rank) {
      return invalid_argument(fmt::format("pool part {}: {} tokens per rank, the pool holds {}", k, b.tokens_per_rank, tokens_per_rank));
    }
    for (int32_t r = 0; r < b.num_ranks; ++r) {
      int& o = owner[part.rank_offset + r];
      if (o >= 0) return invalid_argument(fmt::format("pool parts {} and {} share rank {}", o, k, part.rank_offset + r));
      o = static_cast<int>(k);
    }
    const auto first_doc = static_cast<int32_t>(out.batch.doc_lengths.size());
    for (int32_t d = 0; d < b.num_docs(); ++d) {
      out.batch.doc_lengths.push_back(b.doc_lengths[d]);
      out.origin.push_back({part.stage, part.micro_batch, d});
    }
    for (const Piece& p : b.pieces) out.batch.pieces.push_back(Piece{p.doc + first_doc, p.begin, p.end, p.rank + part.rank_offset});
  }
  // Pieces ordered by rank, then by position in the rank, as every batch keeps them.
  std::stable_sort(out.batch.pieces.begin(), out.batch.pieces.end(), [](const Piece& a, const Piece& b) { return a.rank < b.rank; });
  out.batch.index();
  DISTCA_RETURN_IF_ERROR(out.batch.validate());
  return out;
}

}  // namespace distca::plan
