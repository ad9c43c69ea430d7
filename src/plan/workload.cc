#include "distca/plan/workload.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <random>

#include "distca/core/check.h"
#include "distca/core/file.h"
#include "distca/core/json.h"

namespace distca::plan {
namespace {

// Quantiles (cumulative probability, tokens) of the two published samples in
// ../shared/data (README there): they reproduce each sample's median, mean, p99 and the share of
// attention work held by documents of 16K tokens or more to within a few percent.
const std::vector<std::pair<double, int64_t>> kPretrainQuantiles = {
    {0.0, 1},         {0.01, 63},       {0.05, 324},      {0.1, 646},       {0.2, 1283},
    {0.3, 1932},      {0.4, 2582},      {0.5, 3227},      {0.6, 3861},      {0.7, 4514},
    {0.8, 5156},      {0.9, 5784},      {0.95, 6110},     {0.96, 6173},     {0.97, 6236},
    {0.975, 7484},    {0.98, 10080},    {0.985, 13216},   {0.99, 26070},    {0.9925, 42183},
    {0.995, 69118},   {0.996, 78669},   {0.997, 91226},   {0.998, 99310},   {0.999, 119836},
    {0.9995, 122665}, {0.9999, 124247}, {1.0, 124913}};
const std::vector<std::pair<double, int64_t>> kProlongQuantiles = {
    {0.0, 575},       {0.01, 678},      {0.05, 801},      {0.1, 919},       {0.2, 1130},
    {0.3, 1347},      {0.4, 1594},      {0.5, 1914},      {0.6, 2362},      {0.7, 3018},
    {0.8, 4050},      {0.9, 6051},      {0.95, 8379},     {0.96, 9208},     {0.97, 10431},
    {0.975, 11166},   {0.98, 12310},    {0.985, 13810},   {0.99, 16273},    {0.9925, 18048},
    {0.995, 21393},   {0.996, 24180},   {0.997, 27855},   {0.998, 33207},   {0.999, 47500},
    {0.9995, 74890},  {0.9999, 240055}, {1.0, 340149}};

// A uniform double in [0, 1) from 53 random bits: the same on every platform.
double uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

}  // namespace

LengthDistribution LengthDistribution::from_quantiles(std::string name,
                                                      std::vector<std::pair<double, int64_t>> points) {
  DISTCA_CHECK(points.size() >= 2 && points.front().first == 0.0 && points.back().first == 1.0)
      << "quantile points must run from 0 to 1";
  for (size_t i = 1; i < points.size(); ++i) {
    DISTCA_CHECK(points[i].first > points[i - 1].first && points[i].second >= points[i - 1].second &&
                 points[i - 1].second >= 1)
        << "quantile points must increase";
  }
  LengthDistribution d;
  d.name_ = std::move(name);
  d.points_ = std::move(points);
  return d;
}

LengthDistribution LengthDistribution::from_sample(std::string name, std::vector<int64_t> lengths) {
  DISTCA_CHECK(!lengths.empty()) << "an empirical distribution needs at least one length";
  LengthDistribution d;
  d.name_ = std::move(name);
  d.sample_ = std::move(lengths);
  return d;
}

int64_t LengthDistribution::quantile(double u) const {
  if (!sample_.empty()) {
    const auto i = std::min(sample_.size() - 1, static_cast<size_t>(u * static_cast<double>(sample_.size())));
    return sample_[i];
  }
  auto it = std::upper_bound(points_.begin(), points_.end(), u,
                             [](double v, const auto& p) { return v < p.first; });
  if (it == points_.end()) return points_.back().second;
  const auto& [p1, v1] = *it;
  const auto& [p0, v0] = *(it - 1);
  const double w = (u - p0) / (p1 - p0);
  const double log_len = std::log(static_cast<double>(v0)) +
                         w * (std::log(static_cast<double>(v1)) - std::log(static_cast<double>(v0)));
  return std::max<int64_t>(1, std::llround(std::exp(log_len)));
}

Result<LengthDistribution> builtin_distribution(const std::string& name) {
  if (name == "pretrain") return LengthDistribution::from_quantiles("pretrain", kPretrainQuantiles);
  if (name == "prolong") return LengthDistribution::from_quantiles("prolong", kProlongQuantiles);
  return not_found(fmt::format("unknown workload '{}' (expected pretrain or prolong, or give "
                               "--doc-lengths FILE or --batch FILE)", name));
}

std::vector<std::string> builtin_distribution_names() { return {"pretrain", "prolong"}; }

Result<LengthDistribution> load_doc_lengths(const std::string& path) {
  DISTCA_ASSIGN_OR_RETURN(const std::string text, read_text_file(path));
  DISTCA_ASSIGN_OR_RETURN(const nlohmann::json json, parse_json(text, path));
  if (!json.is_array() || json.empty()) {
    return invalid_argument(fmt::format("{}: expected a non-empty JSON array of lengths", path));
  }
  std::vector<int64_t> lengths;
  lengths.reserve(json.size());
  for (const auto& v : json) {
    // JSON reads 0 and up as unsigned, negative integers as signed.
    const bool is_positive_integer = v.is_number_unsigned() ? v.get<uint64_t>() > 0
                                                            : v.is_number_integer() && v.get<int64_t>() > 0;
    if (!is_positive_integer || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxTokens))) {
      return invalid_argument(fmt::format("{}: entry {} is {}, expected a positive integer length of at most {}",
                                          path, lengths.size(), json_excerpt(v), kMaxTokens));
    }
    lengths.push_back(v.get<int64_t>());
  }
  return LengthDistribution::from_sample(path, std::move(lengths));
}

Status SamplingOptions::validate() const {
  // Messages name the command-line flags (distca plan and distca simulate share them).
  if (long_threshold <= 0 || long_threshold > kMaxTokens) {
    return invalid_argument(fmt::format("--long-threshold must be in [1, {}] tokens, got {}", kMaxTokens, long_threshold));
  }
  if (!(keep_short >= 0 && keep_short <= 1)) {
    return invalid_argument(fmt::format("--keep-short must be in [0, 1], got {}", keep_short));
  }
  if (!(upsample >= 1 && upsample <= 1e6)) {
    return invalid_argument(fmt::format("--upsample must be in [1, 1e6], got {}", upsample));
  }
  if (!(full_context_share >= 0 && full_context_share <= 1)) {
    return invalid_argument(
        fmt::format("--full-context-share (the full-context share) must be in [0, 1], got {}", full_context_share));
  }
  // Below 1 the multiplier would shrink the published lengths into another distribution (and
  // towards one-token documents, millions of them per step).
  if (!(elongation == 0 || (elongation >= 1 && elongation <= 1024))) {
    return invalid_argument(fmt::format("--elongation must be 0 (auto) or in [1, 1024], got {}", elongation));
  }
  return Status::ok();
}

Result<Batch> sample_batch(const LengthDistribution& dist, const SamplingOptions& options,
                           int32_t num_ranks, int64_t tokens_per_rank) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  if (num_ranks <= 0) return invalid_argument(fmt::format("ranks must be positive, got {}", num_ranks));
  if (tokens_per_rank <= 0) {
    return invalid_argument(fmt::format("tokens per rank must be positive, got {}", tokens_per_rank));
  }
  if (int64_t{num_ranks} * tokens_per_rank > kMaxTokens) {
    return invalid_argument(fmt::format("{} ranks x {} tokens is more than {} tokens per step", num_ranks,
                                        tokens_per_rank, kMaxTokens));
  }
  const double elongation = options.elongation > 0
                                ? options.elongation
                                : std::max(1.0, static_cast<double>(tokens_per_rank) / 65536.0);
  // Long documents are drawn `upsample` times as often as in the source, short ones
  // `keep_short` times: accept each draw with its weight over the larger weight.
  const double top = std::max(options.upsample, options.keep_short);
  std::mt19937_64 rng(options.seed);
  const int64_t need = static_cast<int64_t>(num_ranks) * tokens_per_rank;
  std::vector<int64_t> lengths;
  int64_t total = 0;
  int64_t rejected_in_a_row = 0;
  while (total < need) {
    const int64_t length = dist.quantile(uniform(rng));
    const double weight = length > options.long_threshold ? options.upsample : options.keep_short;
    if (uniform(rng) * top >= weight) {
      if (++rejected_in_a_row > 10'000'000) {
        return infeasible("sampling accepted no document in 10M draws: raise --keep-short or "
                          "lower --long-threshold");
      }
      continue;
    }
    rejected_in_a_row = 0;
    const bool is_full = length > options.long_threshold && options.full_context_share > 0 &&
                         uniform(rng) < options.full_context_share;
    const int64_t scaled = is_full ? tokens_per_rank
                                   : std::clamp<int64_t>(std::llround(static_cast<double>(length) * elongation), 1, need);
    lengths.push_back(scaled);
    total += scaled;
  }
  return pack_documents(lengths, num_ranks, tokens_per_rank);
}

}  // namespace distca::plan
