// Workloads: document-length distributions and the paper's sampling of a batch from them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"

namespace distca::plan {

// A distribution of document lengths: either an inverse CDF given by quantile points
// (interpolated log-linearly) or an empirical sample drawn uniformly.
class LengthDistribution {
 public:
  // REQUIRES: points sorted by probability from 0 to 1, lengths >= 1 and non-decreasing.
  static LengthDistribution from_quantiles(std::string name,
                                           std::vector<std::pair<double, int64_t>> points);
  static LengthDistribution from_sample(std::string name, std::vector<int64_t> lengths);

  const std::string& name() const { return name_; }
  // Length at cumulative probability u in [0, 1).
  int64_t quantile(double u) const;

 private:
  std::string name_;
  std::vector<std::pair<double, int64_t>> points_;
  std::vector<int64_t> sample_;
};

// "pretrain" (the WLB-LLM / DistCA Pretrain distribution) or "prolong" (ProLong mix), each
// described by its published quantiles.
Result<LengthDistribution> builtin_distribution(const std::string& name);
std::vector<std::string> builtin_distribution_names();
// A JSON array of positive integer lengths, each at most kMaxTokens.
Result<LengthDistribution> load_doc_lengths(const std::string& path);

// The paper's sampling: documents longer than long_threshold form a long pool drawn
// `upsample` times as often; short ones are kept with probability keep_short; every length
// is multiplied by `elongation` (0: auto = max(1, T / 65536), the paper's context / 64K); a
// long document becomes one of exactly T tokens with probability full_context_share (the
// paper's ProLong runs: keep_short 0, elongation 1, full_context_share 0.3).
struct SamplingOptions {
  int64_t long_threshold = 65536;
  double keep_short = 1.0;
  double upsample = 1.0;
  double elongation = 0.0;
  double full_context_share = 0.0;
  uint64_t seed = 0;

  // long_threshold in [1, kMaxTokens], keep_short and full_context_share in [0, 1], upsample in
  // [1, 1e6], elongation 0 (auto) or in [1, 1024].
  Status validate() const;
};

// Draws documents until R x T tokens are filled and packs them (pack_documents).
Result<Batch> sample_batch(const LengthDistribution& dist, const SamplingOptions& options,
                           int32_t num_ranks, int64_t tokens_per_rank);

}  // namespace distca::plan
