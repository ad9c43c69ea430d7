#include "distca/model/data.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "distca/plan/workload.h"

namespace distca::model {

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

class SyntheticSource final : public DocumentSource {
 public:
  SyntheticSource(std::string workload, plan::LengthDistribution dist, int64_t context, uint64_t seed)
      : workload_(std::move(workload)), dist_(std::move(dist)), context_(context), seed_(seed), rng_(seed) {}
  std::string describe() const override {
    return fmt::format("synthetic ({} lengths, context {}, seed {})", workload_, context_, seed_);
  }
  Result<std::vector<int32_t>> next() override {
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
};

std::vector<int32_t> bytes_to_tokens(const std::string& s) {
  std::vector<int32_t> out(s.size());
  for (size_t i = 0; i < s.size(); ++i) out[i] = static_cast<unsigned char>(s[i]);
  return out;
}

// Parses one JSONL line: the text, "" for a blank line, or an error naming path:line.
Result<std::string> jsonl_text(const std::string& line, const std::string& path, int64_t number) {
  if (line.find_first_not_of(" \t\r") == std::string::npos) return std::string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(fmt::format("{}:{}: not JSON ({})", path, number, e.what()));
  }
  if (!j.is_object() || !j.contains("text")) {
    return invalid_argument(fmt::format("{}:{}: expected an object with a \"text\" field", path, number));
  }
  if (!j["text"].is_string()) return invalid_argument(fmt::format("{}:{}: \"text\" must be a string", path, number));
  return j["text"].get<std::string>();
}

class JsonlSource final : public DocumentSource {
 public:
  JsonlSource(std::string path, int64_t documents) : path_(std::move(path)), documents_(documents) {}
  std::string describe() const override { return fmt::format("{} ({} documents, JSON lines)", path_, documents_); }
  Result<std::vector<int32_t>> next() override {
    for (int pass = 0; pass < 2; ++pass) {
      std::string line;
      while (std::getline(in_, line)) {
        ++line_;
        DISTCA_ASSIGN_OR_RETURN(std::string text, jsonl_text(line, path_, line_));
        if (!text.empty()) return bytes_to_tokens(text);
      }
      in_ = std::ifstream(path_);  // the next epoch
      line_ = 0;
      if (!in_) return not_found(fmt::format("{}: cannot reopen", path_));
    }
    return internal_error(fmt::format("{}: no document on a whole pass", path_));
  }

 private:
  std::string path_;
  int64_t documents_;
  std::ifstream in_{path_};
  int64_t line_ = 0;
};

class DirectorySource final : public DocumentSource {
 public:
  DirectorySource(std::string dir, std::vector<std::string> files) : dir_(std::move(dir)), files_(std::move(files)) {}
  std::string describe() const override { return fmt::format("{} ({} text files)", dir_, files_.size()); }
  Result<std::vector<int32_t>> next() override {
    for (size_t tries = 0; tries < files_.size(); ++tries) {
      const std::string& path = files_[next_];
      next_ = (next_ + 1) % files_.size();
      std::ifstream in(path, std::ios::binary);
      if (!in) return not_found(fmt::format("{}: cannot read", path));
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!text.empty()) return bytes_to_tokens(text);
    }
    return invalid_argument(fmt::format("{}: every file is empty", dir_));
  }

 private:
  std::string dir_;
  std::vector<std::string> files_;
  size_t next_ = 0;
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
  std::ifstream in(path);
  if (!in) return not_found(fmt::format("{}: cannot open the data file", path));
  std::string line;
  int64_t number = 0, documents = 0;
  while (std::getline(in, line)) {
    ++number;
    DISTCA_ASSIGN_OR_RETURN(std::string text, jsonl_text(line, path, number));
    documents += text.empty() ? 0 : 1;
  }
  if (documents == 0) return invalid_argument(fmt::format("{}: no document (every line blank or with an empty text)", path));
  return std::unique_ptr<DocumentSource>(new JsonlSource(path, documents));
}

Result<std::unique_ptr<DocumentSource>> open_directory_source(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> files;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec) && it->file_size(ec) > 0) files.push_back(it->path().string());
  }
  if (ec) return not_found(fmt::format("{}: cannot read the directory ({})", path, ec.message()));
  if (files.empty()) return invalid_argument(fmt::format("{}: no non-empty file to train on", path));
  std::sort(files.begin(), files.end());
  return std::unique_ptr<DocumentSource>(new DirectorySource(path, std::move(files)));
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

}  // namespace distca::model
