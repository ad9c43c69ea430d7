// The model's configurations: learning-rate schedules (OptimConfig) and the JSON of ModelConfig
// and OptimConfig, range- and type-checked.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/model/config.h"

namespace distca::model {
namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Schedule, ConstantIsTheWarmUpThenThePeakForever) {
  OptimConfig o;
  o.lr = 0.01;
  o.warmup_steps = 4;
  ASSERT_TRUE(o.validate().is_ok());  // constant needs no total steps
  EXPECT_DOUBLE_EQ(o.lr_at(0), 0.0025);
  EXPECT_DOUBLE_EQ(o.lr_at(1), 0.005);
  EXPECT_DOUBLE_EQ(o.lr_at(3), 0.01);
  for (int64_t s : {4, 5, 100, 100000000}) EXPECT_EQ(o.lr_at(s), 0.01) << s;
  o.total_steps = 10;  // ignored by constant
  EXPECT_EQ(o.lr_at(50), 0.01);
}

TEST(Schedule, CosineAndLinearDecayFromThePeakToTheFloorAtTheLastStep) {
  for (const std::string name : {"cosine", "linear"}) {
    SCOPED_TRACE(name);
    OptimConfig o;
    o.lr = 0.01;
    o.warmup_steps = 5;  // steps 0..4; the peak at step 4
    o.schedule = name;
    o.total_steps = 15;  // the last step is 14: the decay spans 10 steps
    ASSERT_TRUE(o.validate().is_ok()) << o.validate().to_string();
    EXPECT_DOUBLE_EQ(o.floor_lr(), 0.001);  // 0.1 x lr by default
    EXPECT_DOUBLE_EQ(o.lr_at(0), 0.002);
    EXPECT_DOUBLE_EQ(o.lr_at(4), 0.01);                // the end of the warm-up: the peak
    EXPECT_NEAR(o.lr_at(9), (0.01 + 0.001) / 2, 1e-15);  // halfway
    EXPECT_DOUBLE_EQ(o.lr_at(14), 0.001);              // the last step: the floor
    for (int64_t s : {15, 16, 1000, 100000000}) EXPECT_DOUBLE_EQ(o.lr_at(s), 0.001) << s;
    for (int64_t s = 4; s < 14; ++s) EXPECT_LT(o.lr_at(s + 1), o.lr_at(s)) << s;
    // Both are point-symmetric about the midpoint.
    for (int64_t k = 0; k <= 10; ++k) EXPECT_NEAR(o.lr_at(4 + k) + o.lr_at(14 - k), 0.011, 1e-15) << k;
    if (name == "linear") {
      EXPECT_NEAR(o.lr_at(6), 0.01 - 0.2 * 0.009, 1e-15);  // a fifth of the way down
    }
  }
  // Cosine keeps more of the peak early and less late than linear.
  OptimConfig cosine;
  cosine.schedule = "cosine";
  cosine.total_steps = 15;
  OptimConfig linear = cosine;
  linear.schedule = "linear";
  EXPECT_GT(cosine.lr_at(6), linear.lr_at(6));
  EXPECT_LT(cosine.lr_at(12), linear.lr_at(12));
}

TEST(Schedule, NoWarmUpAnExplicitFloorAndOneStep) {
  OptimConfig o;
  o.lr = 0.01;
  o.warmup_steps = 0;
  o.schedule = "linear";
  o.min_lr = 0.0;
  o.total_steps = 11;
  ASSERT_TRUE(o.validate().is_ok());
  EXPECT_DOUBLE_EQ(o.lr_at(0), 0.01);  // no warm-up: the peak at step 0
  EXPECT_DOUBLE_EQ(o.lr_at(5), 0.005);
  EXPECT_DOUBLE_EQ(o.lr_at(10), 0.0);
  EXPECT_DOUBLE_EQ(o.lr_at(-3), 0.01);  // before the first step: the first step
  o.schedule = "cosine";
  o.min_lr = 0.002;
  o.total_steps = 1;  // the only step is the last
  ASSERT_TRUE(o.validate().is_ok());
  EXPECT_DOUBLE_EQ(o.lr_at(0), 0.002);
}

TEST(Schedule, BadSettingsAreRefusedWithWhatToChange) {
  struct Bad {
    std::string name;
    std::function<void(OptimConfig&)> change;
    std::string expect;
  };
  const std::vector<Bad> bad = {
      {"unknown schedule", [](OptimConfig& o) { o.schedule = "step"; }, "--lr-schedule must be constant, cosine or linear"},
      {"floor above the peak", [](OptimConfig& o) { o.min_lr = 0.1; }, "--min-lr"},
      {"negative floor", [](OptimConfig& o) { o.min_lr = -1e-4; }, "--min-lr"},
      {"NaN floor", [](OptimConfig& o) { o.min_lr = std::nan(""); }, "--min-lr"},
      {"no total steps", [](OptimConfig& o) { o.total_steps = 0; }, "total steps"},
      {"negative total steps", [](OptimConfig& o) { o.total_steps = -5; }, "total steps"},
      {"warm-up to the end", [](OptimConfig& o) { o.warmup_steps = 20; }, "warm-up"},
  };
  for (const Bad& b : bad) {
    OptimConfig o;
    o.lr = 0.01;
    o.schedule = "cosine";
    o.total_steps = 20;
    ASSERT_TRUE(o.validate().is_ok());
    b.change(o);
    const Status s = o.validate();
    ASSERT_FALSE(s.is_ok()) << b.name;
    EXPECT_TRUE(has(s.message(), b.expect)) << b.name << ": " << s.message();
  }
  OptimConfig constant;
  constant.min_lr = 0.1;  // above lr even where it is not used: a typo either way
  EXPECT_FALSE(constant.validate().is_ok());
}

TEST(Schedule, JsonCarriesTheScheduleAndOldJsonReadsAsConstant) {
  OptimConfig o;
  o.lr = 0.02;
  o.warmup_steps = 3;
  o.schedule = "cosine";
  o.total_steps = 40;
  const nlohmann::json j = to_json(o);
  EXPECT_EQ(j["schedule"], "cosine");
  EXPECT_DOUBLE_EQ(j["min_lr"].get<double>(), 0.002);  // the floor in effect
  EXPECT_EQ(j["total_steps"], 40);
  auto back = optim_config_from_json(j);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(to_json(back.value()), j);
  for (int64_t s = 0; s < 45; ++s) EXPECT_EQ(back.value().lr_at(s), o.lr_at(s)) << s;
  // JSON from before the schedules.
  nlohmann::json old = j;
  old.erase("schedule");
  old.erase("min_lr");
  old.erase("total_steps");
  auto legacy = optim_config_from_json(old);
  ASSERT_TRUE(legacy.is_ok()) << legacy.status().to_string();
  EXPECT_EQ(legacy.value().schedule, "constant");
  EXPECT_EQ(legacy.value().lr_at(39), 0.02);
  struct Bad {
    std::string field;
    nlohmann::json value;
  };
  for (const Bad& b : std::vector<Bad>{{"warmup_steps", 2.5}, {"lr", "fast"}, {"schedule", 3}, {"surprise", 1}}) {
    nlohmann::json damaged = j;
    damaged[b.field] = b.value;
    auto r = optim_config_from_json(damaged);
    ASSERT_FALSE(r.is_ok()) << b.field;
    EXPECT_TRUE(has(r.status().message(), "\"" + b.field + "\"")) << r.status().message();
  }
  nlohmann::json unknown = j;
  unknown["schedule"] = "exponential";
  EXPECT_FALSE(optim_config_from_json(unknown).is_ok());
}

TEST(Schedule, ModelConfigJsonIsReadWithItsTypes) {
  const ModelConfig c = find_preset("tiny").value().model;
  const nlohmann::json j = to_json(c);
  ASSERT_TRUE(model_config_from_json(j).is_ok());
  struct Bad {
    std::string field;
    nlohmann::json value;
  };
  for (const Bad& b : std::vector<Bad>{{"num_layers", 2.5}, {"d_model", "64"}, {"init_seed", -1}, {"parameters", 5}, {"colour", "red"}}) {
    nlohmann::json damaged = j;
    damaged[b.field] = b.value;
    auto r = model_config_from_json(damaged);
    ASSERT_FALSE(r.is_ok()) << b.field;
    EXPECT_TRUE(has(r.status().message(), "\"" + b.field + "\"")) << r.status().message();
  }
}

}  // namespace
}  // namespace distca::model
