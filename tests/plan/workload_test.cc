#include "distca/plan/workload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>

#include "distca/core/file.h"

namespace distca::plan {
namespace {

std::string shared_data(const std::string& name) {
  const char* dir = std::getenv("DISTCA_SHARED_DATA");
  return std::string(dir ? dir : "../shared/data") + "/" + name;
}

struct Stats {
  double mean, median, p99;
};
Stats stats(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return {mean, static_cast<double>(v[v.size() / 2]), static_cast<double>(v[v.size() * 99 / 100])};
}

// The built-in distributions are described by published statistics; they must reproduce the
// real samples' mean, median and p99.
TEST(BuiltinDistribution, MatchesTheSharedSamples) {
  for (const auto& [name, file] : {std::pair{"pretrain", "dist_wlbllm.json"}, std::pair{"prolong", "dist_prolong.json"}}) {
    const std::string path = shared_data(file);
    if (!std::filesystem::exists(path)) GTEST_SKIP() << "no " << path << " (set DISTCA_SHARED_DATA)";
    auto real = load_doc_lengths(path).value();
    LengthDistribution builtin = builtin_distribution(name).value();
    std::mt19937_64 rng(7);
    std::vector<int64_t> a, b;
    for (int i = 0; i < 200000; ++i) {
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
      a.push_back(builtin.quantile(u));
      b.push_back(real.quantile(u));
    }
    const Stats sa = stats(a), sb = stats(b);
    EXPECT_NEAR(sa.mean / sb.mean, 1.0, 0.03) << name;
    EXPECT_NEAR(sa.median / sb.median, 1.0, 0.03) << name;
    EXPECT_NEAR(sa.p99 / sb.p99, 1.0, 0.05) << name;
  }
}

TEST(SampleBatch, FillsEveryRankAndIsDeterministic) {
  LengthDistribution d = builtin_distribution("pretrain").value();
  SamplingOptions opt;
  opt.seed = 3;
  Batch a = sample_batch(d, opt, 16, 65536).value();
  Batch b = sample_batch(d, opt, 16, 65536).value();
  EXPECT_TRUE(a.validate().is_ok());
  EXPECT_EQ(a.total_tokens(), 16 * 65536);
  EXPECT_EQ(a.doc_lengths, b.doc_lengths);
  opt.seed = 4;
  EXPECT_NE(sample_batch(d, opt, 16, 65536).value().doc_lengths, a.doc_lengths);
}

TEST(SampleBatch, ElongationAndUpsamplingLengthenDocuments) {
  LengthDistribution d = builtin_distribution("pretrain").value();
  SamplingOptions plain;
  plain.elongation = 1;
  SamplingOptions longer = plain;
  longer.elongation = 4;
  longer.upsample = 4;
  longer.keep_short = 0.5;
  auto mean_len = [](const Batch& b) {
    return static_cast<double>(b.total_tokens()) / b.num_docs();
  };
  const double m1 = mean_len(sample_batch(d, plain, 64, 131072).value());
  const double m2 = mean_len(sample_batch(d, longer, 64, 131072).value());
  EXPECT_GT(m2, 4 * m1);
}

TEST(SampleBatch, TheProlongRunsDrawOnlyLongDocumentsSomeOfThemFullLength) {
  LengthDistribution d = builtin_distribution("prolong").value();
  SamplingOptions opt;
  opt.keep_short = 0;
  opt.elongation = 1;
  opt.full_context_share = 1;
  opt.seed = 5;
  Batch all_full = sample_batch(d, opt, 8, 131072).value();
  ASSERT_EQ(all_full.num_docs(), 8);
  for (int64_t len : all_full.doc_lengths) EXPECT_EQ(len, 131072);
  opt.full_context_share = 0.3;
  int64_t full = 0, docs = 0;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    opt.seed = seed;
    const Batch b = sample_batch(d, opt, 8, 131072).value();
    for (size_t i = 0; i < b.doc_lengths.size(); ++i) {
      // Every document is long; the last one may be cut where the step ends.
      if (i + 1 < b.doc_lengths.size()) {
        EXPECT_GT(b.doc_lengths[i], opt.long_threshold);
      }
      full += b.doc_lengths[i] == 131072 ? 1 : 0, ++docs;
    }
  }
  EXPECT_GT(full, docs / 10);
  EXPECT_LT(full, docs * 6 / 10);
  opt.full_context_share = 1.5;
  EXPECT_FALSE(sample_batch(d, opt, 8, 131072).is_ok());
}

TEST(SampleBatch, RejectsBadOptions) {
  LengthDistribution d = builtin_distribution("prolong").value();
  SamplingOptions opt;
  opt.keep_short = 1.5;
  EXPECT_FALSE(sample_batch(d, opt, 4, 1024).is_ok());
  opt = SamplingOptions{};
  opt.upsample = 0.5;
  EXPECT_FALSE(sample_batch(d, opt, 4, 1024).is_ok());
  EXPECT_FALSE(sample_batch(d, SamplingOptions{}, 0, 1024).is_ok());
  EXPECT_EQ(builtin_distribution("books").status().code(), StatusCode::kNotFound);
}

TEST(SamplingOptions, ElongationIsAutoOrOneTo1024AndMessagesNameTheFlags) {
  for (double e : {0.0, 1.0, 2.5, 1024.0}) {
    SamplingOptions opt;
    opt.elongation = e;
    EXPECT_TRUE(opt.validate().is_ok()) << e;
  }
  // Below 1 it would shrink the published lengths (towards millions of one-token documents).
  for (double e : {0.5, 1e-9, -1.0, 1025.0}) {
    SamplingOptions opt;
    opt.elongation = e;
    const Status s = opt.validate();
    ASSERT_FALSE(s.is_ok()) << e;
    EXPECT_NE(s.message().find("--elongation"), std::string::npos) << s.message();
  }
  SamplingOptions opt;
  opt.long_threshold = kMaxTokens + 1;
  EXPECT_NE(opt.validate().message().find("--long-threshold"), std::string::npos);
  opt = SamplingOptions{};
  opt.keep_short = -0.1;
  EXPECT_NE(opt.validate().message().find("--keep-short"), std::string::npos);
  opt = SamplingOptions{};
  opt.upsample = 2e6;
  EXPECT_NE(opt.validate().message().find("--upsample"), std::string::npos);
}

TEST(LoadDocLengths, RejectsMalformedFiles) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string bad = (dir / "distca_bad_lengths.json").string();
  ASSERT_TRUE(write_file_atomic(bad, "[1, 2, -3]").is_ok());
  EXPECT_FALSE(load_doc_lengths(bad).is_ok());
  ASSERT_TRUE(write_file_atomic(bad, "[1, 2").is_ok());
  EXPECT_FALSE(load_doc_lengths(bad).is_ok());
  ASSERT_TRUE(write_file_atomic(bad, "[]").is_ok());
  EXPECT_FALSE(load_doc_lengths(bad).is_ok());
  // Too long to scale and pack without overflow: refused, not wrapped to a negative length.
  for (const char* text : {"[5, 18446744073709551615]", "[5, 2147483648]", "[0]"}) {
    ASSERT_TRUE(write_file_atomic(bad, text).is_ok());
    auto r = load_doc_lengths(bad);
    ASSERT_FALSE(r.is_ok()) << text;
    EXPECT_NE(r.status().message().find("expected a positive integer length of at most 2147483647"), std::string::npos)
        << r.status().message();
  }
  ASSERT_TRUE(write_file_atomic(bad, "[5, 2147483647]").is_ok());
  EXPECT_TRUE(load_doc_lengths(bad).is_ok());
  EXPECT_EQ(load_doc_lengths("/nonexistent.json").status().code(), StatusCode::kNotFound);
  EXPECT_NE(load_doc_lengths(dir.string()).status().message().find("is a directory"), std::string::npos);
  std::filesystem::remove(bad);
}

}  // namespace
}  // namespace distca::plan
