#include "distca/train/data.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "distca/core/file.h"
#include "distca/core/json.h"
#include "distca/plan/workload.h"

namespace distca::train {

namespace {

class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) / 9007199254740992.0; }

 private:
  uint64_t state_;
};

// A fixed Markov chain over 32 printable symbols: each symbol is followed by one of 4 others
// with probabilities 0.55, 0.25, 0.15, 0.05 (entropy about 1.1 nats per token).
class MarkovText {
 public:
  MarkovText() {
    SplitMix rng(0x5eed);
    for (auto& row : next_) {
      for (int& s : row) s = static_cast<int>(rng.next() % kSymbols);
    }
  }
  int32_t symbol(int s) const { return static_cast<unsigned char>(kAlphabet[s]); }
  int step(int s, double u) const {
    const int pick = u < 0.55 ? 0 : u < 0.80 ? 1 : u < 0.95 ? 2 : 3;
    return next_[s][pick];
  }
  static constexpr int kSymbols = 32;

 private:
  static constexpr const char* kAlphabet = "abcdefghijklmnopqrstuvwxyz .,;!?";
  int next_[kSymbols][4];
};

// The seed of a synthetic source's held-out stream is its own plus this (a prime, so nearby
// seeds of other runs do not land on it by accident).
constexpr uint64_t kHeldOutSeedOffset = 1000003;

// DocumentSource::hold_out's common checks.
Status check_hold_out(const std::string& what, int64_t documents, int64_t available, bool started) {
  if (started) return invalid_argument(fmt::format("{}: hold documents out before reading any", what));
  if (documents < 1) return invalid_argument(fmt::format("{}: hold out at least 1 document, got {}", what, documents));
  if (available >= 0 && documents >= available) {
    return invalid_argument(fmt::format("{}: holding out {} of its {} documents leaves none to train on; hold out at "
                                        "most {}",
                                        what, documents, available, available - 1));
  }
  return Status::ok();
}

class SyntheticSource final : public DocumentSource {
 public:
  SyntheticSource(std::string workload, plan::LengthDistribution dist, int64_t context, uint64_t seed)
      : workload_(std::move(workload)), dist_(std::move(dist)), context_(context), seed_(seed), rng_(seed) {}
  std::string describe() const override {
    return fmt::format("synthetic ({} lengths, context {}, seed {})", workload_, context_, seed_);
  }
  std::string identity() const override {
    return fmt::format("synthetic workload {} context {} seed {}", workload_, context_, seed_);
  }
  Result<std::unique_ptr<DocumentSource>> hold_out(int64_t documents) override {
    DISTCA_RETURN_IF_ERROR(check_hold_out(describe(), documents, -1, started_));
    return std::unique_ptr<DocumentSource>(new SyntheticSource(workload_, dist_, context_, seed_ + kHeldOutSeedOffset));
  }
  Result<std::vector<int32_t>> next() override {
    started_ = true;
    const int64_t len = next_length();
    std::vector<int32_t> doc(static_cast<size_t>(len));
    int s = static_cast<int>(rng_.next() % MarkovText::kSymbols);
    for (int32_t& t : doc) {
      t = text_.symbol(s);
      s = text_.step(s, rng_.uniform());
    }
    return doc;
  }

 private:
  int64_t draw() {
    const double scale = static_cast<double>(context_) / 32768.0;
    const auto len = static_cast<int64_t>(std::llround(static_cast<double>(dist_.quantile(rng_.uniform())) * scale));
    return std::max<int64_t>(2, len);
  }
  int64_t next_length() {
    if (workload_ != "skewed") return draw();
    if (short_left_ == 0) {  // a long document fills a rank, then short ones fill the next
      short_left_ = context_;
      return context_;
    }
    const int64_t len = std::min({draw(), std::max<int64_t>(2, context_ / 8), short_left_});
    short_left_ -= len;
    return len;
  }
  std::string workload_;
  plan::LengthDistribution dist_;
  int64_t context_;
  uint64_t seed_;
  SplitMix rng_;
  MarkovText text_;
  int64_t short_left_ = 0;
  bool started_ = false;
};

std::vector<int32_t> bytes_to_tokens(const std::string& s) {
  std::vector<int32_t> out(s.size());
  for (size_t i = 0; i < s.size(); ++i) out[i] = static_cast<unsigned char>(s[i]);
  return out;
}

// Parses one JSONL line: the text, "" for a blank line, or an error naming path:line.
Result<std::string> jsonl_text(const std::string& line, const std::string& path, int64_t number) {
  if (line.find_first_not_of(" \t\r") == std::string::npos) return std::string();
  DISTCA_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json(line, fmt::format("{}:{}", path, number)));
  if (!j.is_object() || !j.contains("text")) {
    return invalid_argument(fmt::format("{}:{}: expected an object with a \"text\" field", path, number));
  }
  if (!j.at("text").is_string()) return invalid_argument(fmt::format("{}:{}: \"text\" must be a string", path, number));
  return j.at("text").get<std::string>();
}

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL, kFnvPrime = 0x100000001b3ULL;

uint64_t fnv1a(const std::string& bytes) {
  uint64_t h = kFnvOffset;
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * kFnvPrime;
  return h;
}

// The identity of a run of documents from their hashes: the count and an FNV-1a hash over the
// documents' hashes in order (so both the text and where one document ends count).
std::string content_identity(std::span<const uint64_t> hashes) {
  uint64_t h = kFnvOffset;
  for (const uint64_t d : hashes) {
    for (int byte = 0; byte < 8; ++byte) h = (h ^ ((d >> (8 * byte)) & 0xff)) * kFnvPrime;
  }
  return fmt::format("{} documents, fnv1a-64 {:016x}", hashes.size(), h);
}

// Which part of a file source's n documents [begin, end) a source reads: all of them, the
// training part left by hold_out (a prefix), or the held-out part (the rest).
std::string part_of(int64_t begin, int64_t end, int64_t n, const char* noun) {
  if (begin == 0 && end == n) return fmt::format("{} {}", n, noun);
  if (begin == 0) return fmt::format("{} of {} {}; the last {} held out", end, n, noun, n - end);
  return fmt::format("the last {} of {} {}: held out", end - begin, n, noun);
}

// Documents [begin, end) of the non-empty lines of a JSONL file, `hashes` holding every
// document's hash as it was when the file was opened.
class JsonlSource final : public DocumentSource {
 public:
  JsonlSource(std::string path, std::vector<uint64_t> hashes, int64_t begin, int64_t end)
      : path_(std::move(path)), hashes_(std::move(hashes)), begin_(begin), end_(end) {}
  std::string describe() const override {
    return fmt::format("{} ({}, JSON lines)", path_, part_of(begin_, end_, std::ssize(hashes_), "documents"));
  }
  std::string identity() const override {
    return content_identity(std::span(hashes_).subspan(static_cast<size_t>(begin_), static_cast<size_t>(end_ - begin_)));
  }
  int64_t epoch() const override { return epoch_; }
  Result<std::unique_ptr<DocumentSource>> hold_out(int64_t documents) override {
    DISTCA_RETURN_IF_ERROR(check_hold_out(path_, documents, end_ - begin_, index_ > 0 || epoch_ > 0));
    auto held = std::make_unique<JsonlSource>(path_, hashes_, end_ - documents, end_);
    end_ -= documents;
    return std::unique_ptr<DocumentSource>(std::move(held));
  }
  Result<std::vector<int32_t>> next() override {
    if (index_ == end_) {  // this epoch's documents are done: start the next from the top
      in_ = std::ifstream(path_);
      if (!in_) return not_found(fmt::format("{}: cannot reopen", path_));
      line_ = 0;
      index_ = 0;
      ++epoch_;
    }
    std::string line;
    while (std::getline(in_, line)) {
      ++line_;
      DISTCA_ASSIGN_OR_RETURN(std::string text, jsonl_text(line, path_, line_));
      if (text.empty()) continue;
      const int64_t i = index_++;
      if (i < begin_) continue;  // before this source's part
      if (fnv1a(text) != hashes_[static_cast<size_t>(i)]) {
        return invalid_argument(fmt::format("{}:{}: the file changed while training (document {} differs from when "
                                            "it was opened); restart the run",
                                            path_, line_, i + 1));
      }
      return bytes_to_tokens(text);
    }
    return invalid_argument(fmt::format("{}: the file changed while training (it had {} documents when opened, now "
                                        "{}); restart the run",
                                        path_, hashes_.size(), index_));
  }

 private:
  std::string path_;
  std::vector<uint64_t> hashes_;
  int64_t begin_, end_;
  std::ifstream in_{path_};
  int64_t line_ = 0;   // of the last line read
  int64_t index_ = 0;  // the file's next document
  int64_t epoch_ = 0;
};

// Files [begin, end) of a sorted list of non-empty files, `hashes` holding each file's hash as
// it was when the directory was opened.
class DirectorySource final : public DocumentSource {
 public:
  DirectorySource(std::string dir, std::vector<std::string> files, std::vector<uint64_t> hashes, size_t begin,
                  size_t end)
      : dir_(std::move(dir)), files_(std::move(files)), hashes_(std::move(hashes)), begin_(begin), end_(end),
        next_(begin) {}
  std::string describe() const override {
    return fmt::format("{} ({})", dir_,
                       part_of(static_cast<int64_t>(begin_), static_cast<int64_t>(end_), std::ssize(files_), "text files"));
  }
  std::string identity() const override { return content_identity(std::span(hashes_).subspan(begin_, end_ - begin_)); }
  int64_t epoch() const override { return epoch_; }
  Result<std::unique_ptr<DocumentSource>> hold_out(int64_t documents) override {
    DISTCA_RETURN_IF_ERROR(check_hold_out(dir_, documents, static_cast<int64_t>(end_ - begin_),
                                          next_ != begin_ || epoch_ > 0));
    const size_t split = end_ - static_cast<size_t>(documents);
    auto held = std::make_unique<DirectorySource>(dir_, files_, hashes_, split, end_);
    end_ = split;
    return std::unique_ptr<DocumentSource>(std::move(held));
  }
  Result<std::vector<int32_t>> next() override {
    if (next_ == end_) {  // the next epoch
      next_ = begin_;
      ++epoch_;
    }
    const size_t i = next_++;
    DISTCA_ASSIGN_OR_RETURN(std::string text, read_text_file(files_[i]));
    if (fnv1a(text) != hashes_[i]) {
      return invalid_argument(fmt::format("{}: the file changed while training; restart the run", files_[i]));
    }
    return bytes_to_tokens(text);
  }

 private:
  std::string dir_;
  std::vector<std::string> files_;
  std::vector<uint64_t> hashes_;
  size_t begin_, end_;
  size_t next_;  // the next file
  int64_t epoch_ = 0;
};

}  // namespace

std::vector<std::string> synthetic_workloads() { return {"pretrain", "prolong", "skewed"}; }

Result<std::unique_ptr<DocumentSource>> make_synthetic_source(const std::string& workload, int64_t context,
                                                              uint64_t seed) {
  if (context < 16 || context > plan::kMaxTokens) {
    return invalid_argument(fmt::format("context must be 16..{} tokens, got {}", plan::kMaxTokens, context));
  }
  const std::string lengths = workload == "skewed" ? "pretrain" : workload;
  if (workload != "skewed" && workload != "pretrain" && workload != "prolong") {
    return invalid_argument(fmt::format("no workload '{}' (known: pretrain, prolong, skewed)", workload));
  }
  DISTCA_ASSIGN_OR_RETURN(plan::LengthDistribution dist, plan::builtin_distribution(lengths));
  return std::unique_ptr<DocumentSource>(new SyntheticSource(workload, std::move(dist), context, seed));
}

Result<std::unique_ptr<DocumentSource>> open_jsonl_source(const std::string& path) {
  // The file is read again at every epoch, so it must be a regular file (not a pipe), within the
  // input size limit.
  DISTCA_RETURN_IF_ERROR(check_input_file("--data", path, /*allow_pipe=*/false));
  std::ifstream in(path);
  if (!in) return not_found(fmt::format("{}: cannot open the data file", path));
  std::string line;
  int64_t number = 0;
  std::vector<uint64_t> hashes;  // one per document
  while (std::getline(in, line)) {
    ++number;
    DISTCA_ASSIGN_OR_RETURN(std::string text, jsonl_text(line, path, number));
    if (!text.empty()) hashes.push_back(fnv1a(text));
  }
  if (hashes.empty()) return invalid_argument(fmt::format("{}: no document (every line blank or with an empty text)", path));
  const auto n = std::ssize(hashes);
  return std::unique_ptr<DocumentSource>(new JsonlSource(path, std::move(hashes), 0, n));
}

Result<std::unique_ptr<DocumentSource>> open_directory_source(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> paths;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec) && it->file_size(ec) > 0) paths.push_back(it->path().string());
  }
  if (ec) return not_found(fmt::format("{}: cannot read the directory ({})", path, ec.message()));
  std::sort(paths.begin(), paths.end());
  // Every file is read once here for its hash (the source's identity).
  std::vector<std::string> files;
  std::vector<uint64_t> hashes;
  for (const std::string& file : paths) {
    DISTCA_ASSIGN_OR_RETURN(std::string text, read_text_file(file));
    if (text.empty()) continue;
    files.push_back(file);
    hashes.push_back(fnv1a(text));
  }
  if (files.empty()) return invalid_argument(fmt::format("{}: no non-empty file to train on", path));
  const size_t n = files.size();
  return std::unique_ptr<DocumentSource>(new DirectorySource(path, std::move(files), std::move(hashes), 0, n));
}

Result<std::unique_ptr<DocumentSource>> open_data_source(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return open_directory_source(path);
  if (!fs::exists(path, ec)) return not_found(fmt::format("--data {}: no such file or directory", path));
  if (path.ends_with(".jsonl") || path.ends_with(".json")) return open_jsonl_source(path);
  return invalid_argument(fmt::format("--data {}: expected a directory of text files or a .jsonl file with a "
                                      "\"text\" field per line",
                                      path));
}

Result<std::unique_ptr<DocumentSource>> open_training_source(const std::string& path, const std::string& workload,
                                                             int64_t context, uint64_t seed) {
  if (path.empty()) return make_synthetic_source(workload, context, seed);
  return open_data_source(path);
}

Packer::Packer(std::unique_ptr<DocumentSource> source, int32_t num_ranks, int64_t tokens_per_rank)
    : source_(std::move(source)), num_ranks_(num_ranks), tokens_per_rank_(tokens_per_rank) {}

Result<StepData> Packer::next() {
  const int64_t total = num_ranks_ * tokens_per_rank_;
  StepData s;
  s.tokens.reserve(static_cast<size_t>(total));
  s.targets.reserve(static_cast<size_t>(total));
  s.positions.reserve(static_cast<size_t>(total));
  std::vector<int64_t> lengths;
  while (static_cast<int64_t>(s.tokens.size()) < total) {
    std::vector<int32_t> doc;
    if (!carry_.empty()) {
      doc.swap(carry_);
    } else {
      DISTCA_ASSIGN_OR_RETURN(doc, source_->next());
      if (doc.empty()) return internal_error("a data source returned an empty document");
    }
    const auto room = static_cast<size_t>(total - static_cast<int64_t>(s.tokens.size()));
    const size_t take = std::min(room, doc.size());
    for (size_t i = 0; i < take; ++i) {
      s.tokens.push_back(doc[i]);
      s.targets.push_back(i + 1 < doc.size() ? doc[i + 1] : -1);
      s.positions.push_back(static_cast<int32_t>(i));
      s.num_targets += i + 1 < doc.size() ? 1 : 0;
    }
    lengths.push_back(static_cast<int64_t>(take));
    if (take < doc.size()) carry_.assign(doc.begin() + static_cast<std::ptrdiff_t>(take), doc.end());
  }
  DISTCA_ASSIGN_OR_RETURN(s.batch, plan::pack_documents(lengths, num_ranks_, tokens_per_rank_));
  return s;
}

Status Packer::skip(int64_t steps) {
  for (int64_t i = 0; i < steps; ++i) DISTCA_RETURN_IF_ERROR(next().status());
  return Status::ok();
}

Result<std::vector<StepData>> make_validation_steps(std::unique_ptr<DocumentSource> held_out, int32_t ranks,
                                                    int64_t tokens_per_rank, int64_t steps) {
  if (held_out == nullptr) return invalid_argument("validation steps need a held-out source");
  if (ranks < 1) return invalid_argument(fmt::format("validation steps need >= 1 rank, got {}", ranks));
  if (tokens_per_rank < 1 || tokens_per_rank > plan::kMaxTokens) {
    return invalid_argument(fmt::format("validation steps need 1..{} tokens per rank, got {}", plan::kMaxTokens,
                                        tokens_per_rank));
  }
  if (steps < 1 || steps > 10000) return invalid_argument(fmt::format("validation steps must be 1..10000, got {}", steps));
  const std::string what = held_out->describe();
  Packer packer(std::move(held_out), ranks, tokens_per_rank);
  std::vector<StepData> out;
  for (int64_t i = 0; i < steps; ++i) {
    DISTCA_ASSIGN_OR_RETURN(StepData s, packer.next());
    if (packer.epoch() > 0) {
      return invalid_argument(fmt::format("{}: the held-out documents fill {} of the {} validation steps of {} x {} "
                                          "tokens; hold out more documents or ask for fewer validation steps",
                                          what, i, steps, ranks, tokens_per_rank));
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace distca::train
