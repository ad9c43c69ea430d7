// Profiles (sim/profile.h): the built-in one, its JSON round trip, and bad ones refused with
// their origin.
#include <gtest/gtest.h>

#include <filesystem>

#include "distca/core/file.h"
#include "distca/sim/profile.h"

namespace distca::sim {
namespace {

TEST(Profile, DefaultIsValidRoundTripsAndPricesShortShardsWorse) {
  const Profile p = default_h200_profile();
  ASSERT_TRUE(p.validate().is_ok());
  auto back = profile_from_json(to_json(p), "test");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(to_json(back.value()), to_json(p));
  // A 16K document at the profile's 16K point: 640 TFLOP/s forward.
  const int64_t pairs = shard_pairs(16384, 16384);
  const double fwd = p.attention_seconds(16384, 16384, pairs, 4, 128, false);
  EXPECT_NEAR(4.0 * 128 * 4 * pairs / (fwd - 5e-6), 640e12, 1e9);
  // The same pairs in short documents cost more per pair; a 64-row shard of a long document
  // pays for a 128-row tile.
  const double short_doc = p.attention_seconds(512, 512, shard_pairs(512, 512), 4, 128, false);
  EXPECT_GT(short_doc / shard_pairs(512, 512), fwd / pairs);
  const double thin = p.attention_seconds(64, 16384, shard_pairs(64, 16384), 4, 128, true);
  const double tile = p.attention_seconds(128, 16384, shard_pairs(128, 16384), 4, 128, true);
  EXPECT_GT(thin, 0.9 * tile);
}

TEST(Profile, DeviceMemoryIsTheH200sAndOptional) {
  const Profile p = default_h200_profile();
  EXPECT_EQ(p.device_memory_bytes, 141e9);
  EXPECT_FALSE(p.device_memory_source.empty());
  // A profile without the field (older files, measured CPU profiles) has no device memory.
  nlohmann::json j = to_json(p);
  j.erase("device_memory_bytes");
  auto loaded = profile_from_json(j, "old.json");
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded.value().device_memory_bytes, 0.0);
  j["device_memory_bytes"] = -1;
  auto bad = profile_from_json(j, "neg.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("device memory"), std::string::npos) << bad.status().message();
}

TEST(Profile, BadProfilesAreRefusedWithTheirOrigin) {
  nlohmann::json good = to_json(default_h200_profile());
  auto expect_bad = [](nlohmann::json j, const std::string& what) {
    auto r = profile_from_json(j, "my.json");
    ASSERT_FALSE(r.is_ok()) << what;
    EXPECT_NE(r.status().message().find("my.json"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().message();
  };
  auto j = good;
  j["version"] = 7;
  expect_bad(j, "version 7");
  j = good;
  j["format"] = "other";
  expect_bad(j, "not a distca profile");
  j = good;
  j["attention"][0]["points"][1]["q_tokens"] = 100;
  j["attention"][0]["points"][1]["kv_tokens"] = 100;
  expect_bad(j, "sorted");
  j = good;
  j["linear_flops_per_second"] = -1;
  expect_bad(j, "linear FLOP/s");
  j = good;
  j.erase("inter_node");
  expect_bad(j, "inter_node");
}

// What fuzzing found (tests/fuzz/crashes/profile: token counts whose product overflowed when a
// shard was priced) is refused when the profile is read.
TEST(Profile, InputsThatOnceOverflowedAreRefused) {
  const std::filesystem::path dir = std::filesystem::path(__FILE__).parent_path() / "../fuzz/crashes/profile";
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    Result<Profile> p = load_profile(entry.path().string());
    ASSERT_FALSE(p.is_ok()) << entry.path();
    EXPECT_NE(p.status().message().find("tokens must be an integer in [0, 2147483647]"), std::string::npos)
        << p.status().message();
  }
  EXPECT_GE(seen, 1);
}

}  // namespace
}  // namespace distca::sim
