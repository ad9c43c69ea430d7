// Training data: documents as byte-level tokens, packed in order into R x T tokens per step
// (DESIGN.md §1: every rank holds T tokens; a document that overflows a rank continues on the
// next). Sources:
//   synthetic   embedded default: document lengths from a built-in distribution scaled to the
//               context, text from a fixed random Markov chain (learnable: the loss falls from
//               ln 256 toward the chain's entropy, about 1.1 nats)
//   JSONL       one JSON object per line with a string field "text"
//   directory   every regular file under it (sorted by path) is one document
// Files are read again from the start when they run out (epochs). Bad input is reported with
// file and line before training starts.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"

namespace distca::model {

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  virtual std::string describe() const = 0;
  // The next document's tokens (bytes 0..255), never empty.
  virtual Result<std::vector<int32_t>> next() = 0;
};

// Workloads of the synthetic source: "pretrain" and "prolong" draw lengths from the built-in
// distributions scaled by context / 32768 (their 99th percentile lands near the context), at
// least 2 tokens; "skewed" alternates one document of exactly `context` tokens with short
// pretrain documents that fill the next rank exactly, so every other rank holds a whole long
// document (the straggler case CAD exists for).
std::vector<std::string> synthetic_workloads();
Result<std::unique_ptr<DocumentSource>> make_synthetic_source(const std::string& workload, int64_t context,
                                                              uint64_t seed);
// Validates the whole file first: a line that is not a JSON object with a string "text" is an
// error naming file:line. Blank lines and empty texts are skipped; no document at all is an
// error.
Result<std::unique_ptr<DocumentSource>> open_jsonl_source(const std::string& path);
Result<std::unique_ptr<DocumentSource>> open_directory_source(const std::string& path);
// A directory, or a .jsonl / .json file of JSON lines.
Result<std::unique_ptr<DocumentSource>> open_data_source(const std::string& path);

// One step's tokens, the same on every rank; each rank reads its slice.
struct StepData {
  plan::Batch batch;                  // R ranks of T tokens
  std::vector<int32_t> tokens;        // [R T]
  std::vector<int32_t> targets;       // [R T] next token of the same document, -1 at its end
  std::vector<int32_t> positions;     // [R T] position in the document
  int64_t num_targets = 0;            // over all ranks
  std::span<const int32_t> slice(const std::vector<int32_t>& v, int rank) const {
    const int64_t t = batch.tokens_per_rank;
    return {v.data() + rank * t, static_cast<size_t>(t)};
  }
};

// Packs documents in order into steps of R x T tokens. A document cut at the end of a step
// continues in the next as a new document (positions from 0); its last token in the cut step
// still predicts the document's next token.
class Packer {
 public:
  Packer(std::unique_ptr<DocumentSource> source, int32_t num_ranks, int64_t tokens_per_rank);
  Result<StepData> next();
  // Skips `steps` steps (resuming from a checkpoint replays the stream).
  Status skip(int64_t steps);
  const DocumentSource& source() const { return *source_; }

 private:
  std::unique_ptr<DocumentSource> source_;
  int32_t num_ranks_;
  int64_t tokens_per_rank_;
  std::vector<int32_t> carry_;  // the rest of a document cut at the end of the last step
};

}  // namespace distca::model
