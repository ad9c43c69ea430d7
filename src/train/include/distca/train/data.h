// Training data: documents as byte-level tokens, packed in order into R x T tokens per step
// (docs/design.md §1: every rank holds T tokens; a document that overflows a rank continues on the
// next). Sources:
//   synthetic   embedded default: document lengths from a built-in distribution scaled to the
//               context, text from a fixed random Markov chain (learnable: the loss falls from
//               ln 256 toward the chain's entropy, about 1.1 nats)
//   JSONL       one JSON object per line with a string field "text"
//   directory   every regular file under it (sorted by path) is one document
// Files are read again from the start when they run out (epochs). Bad input is reported with
// file and line before training starts; a file that changes while training is an error.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"

namespace distca::train {

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  // For people: the run header prints it (path and document count, or the synthetic settings).
  virtual std::string describe() const = 0;
  // For comparing: equal exactly when the source yields the same documents in the same order.
  // Files and directories: the document count and a 64-bit FNV-1a hash of every document's
  // bytes (so a file rewritten with other text of the same document count differs, and the
  // same text under another path is equal); synthetic: its workload, context and seed.
  virtual std::string identity() const = 0;
  // The next document's tokens (bytes 0..255), never empty.
  virtual Result<std::vector<int32_t>> next() = 0;
  // How many times the source ran out and started again from its first document, as of the
  // last document next() returned: 0 in the first epoch. Endless sources stay at 0.
  virtual int64_t epoch() const { return 0; }
  // Holds documents out for a validation loss: returns a source of documents this one will never
  // return. Call it before the first next(); it changes this source's describe() and identity().
  //   files, directories  the last `documents` documents (JSONL lines, sorted files) are held out
  //                       and this source wraps over the others; refused unless at least one
  //                       document remains for training
  //   synthetic           this source is unchanged; the held-out one is the same workload from
  //                       seed + 1000003, a stream the training one never repeats (`documents`
  //                       only has to be >= 1: the stream is endless)
  virtual Result<std::unique_ptr<DocumentSource>> hold_out(int64_t documents) = 0;
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
// What a trainer reads: the file source at `path`, or with an empty path the synthetic `workload`.
Result<std::unique_ptr<DocumentSource>> open_training_source(const std::string& path, const std::string& workload,
                                                             int64_t context, uint64_t seed);

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
  // The source's epoch as of the last step next() returned (see DocumentSource::epoch).
  int64_t epoch() const { return source_->epoch(); }

 private:
  std::unique_ptr<DocumentSource> source_;
  int32_t num_ranks_;
  int64_t tokens_per_rank_;
  std::vector<int32_t> carry_;  // the rest of a document cut at the end of the last step
};

// Packs `steps` steps of `ranks` x `tokens_per_rank` tokens from a held-out source (from
// DocumentSource::hold_out), the same format as Packer::next, for a validation loss computed
// the same way at every evaluation. Refused when the held-out documents run out before the
// last step (a validation set that counts documents twice): hold out more documents or ask for
// fewer steps.
Result<std::vector<StepData>> make_validation_steps(std::unique_ptr<DocumentSource> held_out, int32_t ranks,
                                                    int64_t tokens_per_rank, int64_t steps);

}  // namespace distca::train
