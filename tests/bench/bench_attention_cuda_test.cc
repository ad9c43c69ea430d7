// The profile `distca bench attention --device cuda --profile-out` writes, checked without a GPU:
// the simulator reads it back, and it prices a whole document at exactly the time measured.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "distca/bench/bench_attention_cuda.h"
#include "distca/sim/profile.h"

namespace distca::bench {
namespace {

TEST(CudaProfile, TheMeasuredProfileLoadsAndPricesWholeDocumentsAtTheMeasuredTimes) {
  CudaAttentionBenchOptions o;
  const std::vector<MeasuredPoint> points = {{65536, 0.120, 0.300}, {4096, 0.0009, 0.0024}, {16384, 0.009, 0.022}};
  const nlohmann::json j = measured_cuda_profile(o, "NVIDIA H100 80GB HBM3 (sm_90)", "2026-11-25", points);
  EXPECT_EQ(j["measured"], true);
  EXPECT_EQ(j["device"], "NVIDIA H100 80GB HBM3 (sm_90)");
  EXPECT_EQ(j["date"], "2026-11-25");
  Result<sim::Profile> p = sim::profile_from_json(j, "measured profile");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  ASSERT_EQ(p.value().attention.size(), 1u);
  EXPECT_EQ(p.value().attention[0].tile_rows, 64);
  EXPECT_EQ(p.value().device_memory_bytes, sim::default_h200_profile().device_memory_bytes);  // none given
  for (const MeasuredPoint& m : points) {
    const int64_t pairs = sim::shard_pairs(m.tokens, m.tokens);
    EXPECT_NEAR(p.value().attention_seconds(m.tokens, m.tokens, pairs, o.q_heads, o.head_dim, false), m.fwd_seconds,
                1e-9 * m.fwd_seconds);
    EXPECT_NEAR(p.value().attention_seconds(m.tokens, m.tokens, pairs, o.q_heads, o.head_dim, true), m.bwd_seconds,
                1e-9 * m.bwd_seconds);
  }
}

// The GPU's own memory replaces the default profile's (an H100's 80 GB is not an H200's 141).
TEST(CudaProfile, TheMeasuredProfileTakesTheGpusOwnMemory) {
  CudaAttentionBenchOptions o;
  const nlohmann::json j = measured_cuda_profile(o, "NVIDIA H100 80GB HBM3 (sm_90)", "2026-11-25",
                                                 {{4096, 0.0009, 0.0024}}, 85'022'638'080.0);
  Result<sim::Profile> p = sim::profile_from_json(j, "measured profile");
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p.value().device_memory_bytes, 85'022'638'080.0);
  EXPECT_NE(p.value().device_memory_source.find("NVIDIA H100"), std::string::npos) << p.value().device_memory_source;
}

// gpu-check.sh's next step: `distca simulate --paper --profile` on the written profile.
TEST(CudaProfile, SimulatePaperRunsOnTheMeasuredProfile) {
  CudaAttentionBenchOptions o;
  const nlohmann::json j = measured_cuda_profile(o, "a GPU", "2026-11-25", {{4096, 0.0009, 0.0024}, {65536, 0.12, 0.3}});
  const std::string path = ::testing::TempDir() + "/measured_profile.json";
  std::ofstream(path) << j.dump(2);
  const std::string command = std::string(DISTCA_BIN) + " simulate --paper --iterations 1 --profile " + path + " > " + path +
                              ".out 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0);
  std::ifstream out(path + ".out");
  const std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("profile a GPU"), std::string::npos) << text;
  std::remove(path.c_str());
  std::remove((path + ".out").c_str());
}

}  // namespace
}  // namespace distca::bench
