// cuDNN engine autotuning's host side (src/kernels/cudnn/engine_tuning.h), in every build: which
// candidate the timing picks within its time cap, and the cache file a later run reads (a bad,
// foreign or missing one ignored with one line, never trusted).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../../src/kernels/cudnn/engine_tuning.h"

namespace distca::kernels::cudnn {
namespace {

std::string name_of(int64_t i) { return "eng" + std::to_string(i); }

TEST(CudnnEngine, TheFastestCandidateThatRanIsChosen) {
  const std::vector<double> ms = {3.0, 1.5, 2.0, 1.25, 4.0};
  double clock = 0;
  std::vector<int64_t> timed;
  const EngineChoice c =
      choose_engine(5, name_of, [&](int64_t i) -> Result<double> { timed.push_back(i); return ms[i]; }, 10.0,
                    [&] { return clock; })
          .value();
  EXPECT_EQ(c.index, 3);
  EXPECT_EQ(c.name, "eng3");
  EXPECT_EQ(c.ms, 1.25);
  EXPECT_EQ(c.timed, 5);
  EXPECT_EQ(c.candidates, 5);
  EXPECT_FALSE(c.from_cache);
  EXPECT_EQ(timed, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(CudnnEngine, FailedCandidatesAreSkippedAndNoneRunningIsAnError) {
  auto failing = [](int64_t i) -> Result<double> {
    if (i % 2 == 0) return internal_error("not supported on this device");
    return 10.0 - static_cast<double>(i);
  };
  const EngineChoice c = choose_engine(4, name_of, failing, 10.0, [] { return 0.0; }).value();
  EXPECT_EQ(c.index, 3);  // 1 (9 ms) and 3 (7 ms) ran
  const Result<EngineChoice> none =
      choose_engine(3, name_of, [](int64_t) -> Result<double> { return internal_error("bad plan"); }, 10.0, [] { return 0.0; });
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("none of the 3"), std::string::npos) << none.status().message();
  EXPECT_NE(none.status().message().find("bad plan"), std::string::npos) << none.status().message();
  EXPECT_FALSE(choose_engine(0, name_of, failing, 1.0, [] { return 0.0; }).is_ok());
  // A time that is not a time is a failure, not the fastest.
  const EngineChoice nan = choose_engine(2, name_of, [](int64_t i) -> Result<double> {
                             return i == 0 ? -1.0 : 5.0;
                           }, 10.0, [] { return 0.0; }).value();
  EXPECT_EQ(nan.index, 1);
}

TEST(CudnnEngine, TheTimeCapStopsTheSearchAfterTheFirstCandidate) {
  double clock = 0;
  // Each candidate takes 0.3 s of wall time; a cap of 0.5 s times the first two only.
  auto timing = [&](int64_t i) -> Result<double> {
    clock += 0.3;
    return 5.0 - static_cast<double>(i);
  };
  const EngineChoice c = choose_engine(6, name_of, timing, 0.5, [&] { return clock; }).value();
  EXPECT_EQ(c.timed, 2);
  EXPECT_EQ(c.index, 1);
  // A cap of zero still times the first (heuristics' plan 0 is always a candidate).
  clock = 0;
  EXPECT_EQ(choose_engine(6, name_of, timing, 0.0, [&] { return clock; }).value().timed, 1);
}

TEST(CudnnEngine, TheKnobsAreCheckedWhereTheyAreRead) {
  EXPECT_FALSE(parse_autotune(nullptr).value());
  EXPECT_FALSE(parse_autotune("").value());
  EXPECT_FALSE(parse_autotune("0").value());
  EXPECT_TRUE(parse_autotune("1").value());
  const Result<bool> yes = parse_autotune("yes");
  ASSERT_FALSE(yes.is_ok());
  EXPECT_NE(yes.status().message().find("DISTCA_CUDNN_AUTOTUNE must be 0 or 1, got 'yes'"), std::string::npos);
  EXPECT_EQ(parse_autotune_ms(nullptr).value(), 0.5);
  EXPECT_EQ(parse_autotune_ms("250").value(), 0.25);
  EXPECT_EQ(parse_autotune_ms("0").value(), 0.0);
  for (const char* bad : {"-1", "abc", "1e9", "nan", "5ms", "inf"}) {
    const Result<double> ms = parse_autotune_ms(bad);
    ASSERT_FALSE(ms.is_ok()) << bad;
    EXPECT_NE(ms.status().message().find("DISTCA_CUDNN_AUTOTUNE_MS"), std::string::npos) << ms.status().message();
  }
}

class CudnnEngineCache : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("distca_engine_cache_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  void write(const std::string& p, const std::string& text) const { std::ofstream(p) << text; }
  std::filesystem::path dir_;
};

TEST_F(CudnnEngineCache, AChoiceSavedIsReadBackForTheSameDeviceAndCudnn) {
  const std::string p = path("engines.json");
  std::string warning;
  EngineCache cache = EngineCache::load(p, "NVIDIA H100", "cuDNN 9.19.0", &warning);
  EXPECT_TRUE(warning.empty()) << warning;  // no file yet: empty, silently
  EXPECT_EQ(cache.size(), 0u);
  cache.put("backward causal bf16 batch 8", EngineChoice{4, "eng7_k2", 1.5, 6, 9, false});
  cache.put("forward causal bf16 batch 8", EngineChoice{0, "eng0", 0.5, 9, 9, false});
  ASSERT_TRUE(cache.save().is_ok());
  const EngineCache again = EngineCache::load(p, "NVIDIA H100", "cuDNN 9.19.0", &warning);
  EXPECT_TRUE(warning.empty()) << warning;
  ASSERT_EQ(again.size(), 2u);
  const auto c = again.find("backward causal bf16 batch 8");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->index, 4);
  EXPECT_EQ(c->name, "eng7_k2");
  EXPECT_EQ(c->ms, 1.5);
  EXPECT_TRUE(c->from_cache);
  EXPECT_FALSE(again.find("forward non-causal").has_value());
}

TEST_F(CudnnEngineCache, AForeignOrBadCacheIsIgnoredWithOneLine) {
  const std::string p = path("engines.json");
  EngineCache made = EngineCache::load(p, "NVIDIA H100", "cuDNN 9.19.0", nullptr);
  made.put("k", EngineChoice{2, "eng2", 1.0, 3, 3, false});
  ASSERT_TRUE(made.save().is_ok());
  struct Case {
    const char* what;
    std::string device, cudnn, text;  // text empty: the saved file as it is
    const char* says;
  };
  const Case cases[] = {
      {"another GPU", "NVIDIA H200", "cuDNN 9.19.0", "", "made on NVIDIA H100"},
      {"another cuDNN", "NVIDIA H100", "cuDNN 9.20.0", "", "cuDNN 9.19.0"},
      {"not JSON", "NVIDIA H100", "cuDNN 9.19.0", "{\"format\": ", ""},
      {"another format", "NVIDIA H100", "cuDNN 9.19.0", R"({"format": "distca-plan", "version": 1})", "distca-cudnn-engines"},
      {"a bad entry", "NVIDIA H100", "cuDNN 9.19.0",
       R"({"format": "distca-cudnn-engines", "version": 1, "device": "NVIDIA H100", "cudnn": "cuDNN 9.19.0",
           "engines": {"k": {"index": -3, "name": "x", "ms": 1}}})",
       "entry 'k'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string file = path(c.what);
    if (c.text.empty()) {
      std::filesystem::copy_file(p, file, std::filesystem::copy_options::overwrite_existing);
    } else {
      write(file, c.text);
    }
    std::string warning;
    const EngineCache cache = EngineCache::load(file, c.device, c.cudnn, &warning);
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_NE(warning.find("ignored"), std::string::npos) << warning;
    EXPECT_NE(warning.find(c.says), std::string::npos) << warning;
    EXPECT_EQ(warning.find('\n'), std::string::npos) << warning;
  }
  // An unwritable place is an error from save(), not a crash.
  EngineCache nowhere = EngineCache::load((dir_ / "no" / "such" / "dir" / "e.json").string(), "d", "c", nullptr);
  nowhere.put("k", EngineChoice{0, "eng0", 1.0, 1, 1, false});
  EXPECT_FALSE(nowhere.save().is_ok());
  // No path: never read or written.
  EngineCache none = EngineCache::load("", "d", "c", nullptr);
  none.put("k", EngineChoice{0, "eng0", 1.0, 1, 1, false});
  EXPECT_TRUE(none.save().is_ok());
}

}  // namespace
}  // namespace distca::kernels::cudnn
