// Training inputs: learning-rate schedules, data identity and epochs, held-out documents, and
// checkpoint headers that are range- and type-checked.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <unistd.h>

#include "distca/core/file.h"
#include "distca/model/checkpoint.h"
#include "distca/model/config.h"
#include "distca/model/data.h"

namespace distca::model {
namespace {

namespace fs = std::filesystem;

// An empty folder of this test's own under the test temp dir.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("distca_inputs_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_jsonl(const fs::path& path, const std::vector<std::string>& texts) {
  std::ofstream out(path);
  for (const std::string& t : texts) out << nlohmann::json{{"text", t}}.dump() << "\n";
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::unique_ptr<DocumentSource> open(const fs::path& path) {
  auto r = open_data_source(path.string());
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(r.value()) : nullptr;
}

std::string text_of(const std::vector<int32_t>& tokens) { return std::string(tokens.begin(), tokens.end()); }

// The next `n` documents of a source as text.
std::vector<std::string> take(DocumentSource& source, int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    auto doc = source.next();
    EXPECT_TRUE(doc.is_ok()) << doc.status().to_string();
    if (!doc.is_ok()) break;
    out.push_back(text_of(doc.value()));
  }
  return out;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---- learning-rate schedules ----

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

// ---- data identity ----

TEST(DataIdentity, FileSourcesAreIdentifiedByTheirContent) {
  const fs::path dir = fresh_dir("identity");
  write_jsonl(dir / "a.jsonl", {"hello", "world"});
  write_jsonl(dir / "same.jsonl", {"hello", "world"});
  write_jsonl(dir / "other.jsonl", {"hellO", "world"});     // the same document count
  write_jsonl(dir / "cut.jsonl", {"hellowor", "ld"});       // the same bytes, other documents
  write_jsonl(dir / "order.jsonl", {"world", "hello"});
  const std::string a = open(dir / "a.jsonl")->identity();
  EXPECT_EQ(open(dir / "same.jsonl")->identity(), a);
  EXPECT_NE(open(dir / "other.jsonl")->identity(), a);
  EXPECT_NE(open(dir / "cut.jsonl")->identity(), a);
  EXPECT_NE(open(dir / "order.jsonl")->identity(), a);
  EXPECT_TRUE(has(open(dir / "a.jsonl")->describe(), "a.jsonl (2 documents"));  // for people: the path
  // Directories: sorted files, identified by their bytes, not their names.
  for (const char* d : {"d1", "d2", "d3"}) fs::create_directories(dir / d);
  write_text(dir / "d1" / "x.txt", "hello");
  write_text(dir / "d1" / "y.txt", "world");
  write_text(dir / "d2" / "p.txt", "hello");
  write_text(dir / "d2" / "q.txt", "world");
  write_text(dir / "d3" / "x.txt", "hellO");
  write_text(dir / "d3" / "y.txt", "world");
  EXPECT_EQ(open(dir / "d1")->identity(), open(dir / "d2")->identity());
  EXPECT_NE(open(dir / "d1")->identity(), open(dir / "d3")->identity());
  EXPECT_EQ(open(dir / "d1")->identity(), a);  // the same documents in the same order
  // Synthetic: the workload, the context and the seed.
  auto synthetic = [](const std::string& w, int64_t context, uint64_t seed) {
    return make_synthetic_source(w, context, seed).value()->identity();
  };
  EXPECT_EQ(synthetic("pretrain", 256, 1), synthetic("pretrain", 256, 1));
  EXPECT_NE(synthetic("pretrain", 256, 1), synthetic("pretrain", 256, 2));
  EXPECT_NE(synthetic("pretrain", 256, 1), synthetic("prolong", 256, 1));
  EXPECT_NE(synthetic("pretrain", 256, 1), synthetic("pretrain", 512, 1));
  fs::remove_all(dir);
}

TEST(DataIdentity, AFileChangedWhileTrainingIsAnError) {
  const fs::path dir = fresh_dir("changed");
  // Rewritten in place after it was opened (and validated), before training read it.
  write_jsonl(dir / "a.jsonl", {"one", "two", "three"});
  auto jsonl = open(dir / "a.jsonl");
  write_jsonl(dir / "a.jsonl", {"one", "TWO", "three"});
  EXPECT_EQ(take(*jsonl, 1), std::vector<std::string>{"one"});
  auto r = jsonl->next();
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(has(r.status().message(), "a.jsonl:2: the file changed while training")) << r.status().message();
  // Shorter than when opened: caught where it ends.
  write_jsonl(dir / "b.jsonl", {"one", "two", "three"});
  auto shorter = open(dir / "b.jsonl");
  write_jsonl(dir / "b.jsonl", {"one"});
  EXPECT_EQ(take(*shorter, 1), std::vector<std::string>{"one"});
  r = shorter->next();
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(has(r.status().message(), "3 documents when opened, now 1")) << r.status().message();
  fs::create_directories(dir / "texts");
  write_text(dir / "texts" / "a.txt", "alpha");
  write_text(dir / "texts" / "b.txt", "beta");
  auto texts = open(dir / "texts");
  write_text(dir / "texts" / "b.txt", "BETA");
  EXPECT_EQ(take(*texts, 1), std::vector<std::string>{"alpha"});
  r = texts->next();
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(has(r.status().message(), "b.txt: the file changed while training")) << r.status().message();
  fs::remove_all(dir);
}

// ---- epochs ----

TEST(Epochs, CountHowOftenAFileSourceStartedAgain) {
  const fs::path dir = fresh_dir("epochs");
  write_jsonl(dir / "a.jsonl", {"one", "", "two", "three"});  // the empty text is no document
  fs::create_directories(dir / "texts");
  for (const char* name : {"one", "two", "three"}) write_text(dir / "texts" / (std::string(name) + ".txt"), name);
  for (const char* path : {"a.jsonl", "texts"}) {
    SCOPED_TRACE(path);
    auto source = open(dir / path);
    EXPECT_EQ(source->epoch(), 0);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      for (int doc = 0; doc < 3; ++doc) {
        ASSERT_TRUE(source->next().is_ok());
        EXPECT_EQ(source->epoch(), epoch) << doc;
      }
    }
  }
  auto synthetic = make_synthetic_source("pretrain", 64, 1);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(synthetic.value()->next().is_ok());
  EXPECT_EQ(synthetic.value()->epoch(), 0);
  // The packer reports the epoch of the last document it drew: three documents of 10 bytes,
  // 16 tokens a step.
  write_jsonl(dir / "ten.jsonl", {"aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"});
  Packer packer(open(dir / "ten.jsonl"), 1, 16);
  EXPECT_EQ(packer.epoch(), 0);
  ASSERT_TRUE(packer.next().is_ok());  // a, 6 of b
  EXPECT_EQ(packer.epoch(), 0);
  auto second = packer.next();         // the rest of b, c, 2 of a again
  ASSERT_TRUE(second.is_ok());
  EXPECT_EQ(packer.epoch(), 1);
  EXPECT_EQ(second.value().tokens.back(), 'a');
  fs::remove_all(dir);
}

// ---- held-out documents ----

TEST(HeldOut, FileSourcesHoldOutTheirLastDocuments) {
  const fs::path dir = fresh_dir("held_out");
  std::vector<std::string> docs;
  for (int i = 0; i < 10; ++i) docs.push_back(fmt::format("document {}", i));
  write_jsonl(dir / "a.jsonl", docs);
  fs::create_directories(dir / "texts");
  for (int i = 0; i < 10; ++i) write_text(dir / "texts" / fmt::format("{:02}.txt", i), docs[i]);
  for (const char* path : {"a.jsonl", "texts"}) {
    SCOPED_TRACE(path);
    auto train = open(dir / path);
    const std::string whole = train->identity();
    auto held = train->hold_out(3);
    ASSERT_TRUE(held.is_ok()) << held.status().to_string();
    DocumentSource& validation = *held.value();
    // Three epochs of each: training never sees a held-out document.
    const std::vector<std::string> seen_train = take(*train, 21), seen_held = take(validation, 9);
    EXPECT_EQ(train->epoch(), 2);
    EXPECT_EQ(validation.epoch(), 2);
    const std::set<std::string> train_set(seen_train.begin(), seen_train.end()),
        held_set(seen_held.begin(), seen_held.end());
    EXPECT_EQ(train_set, std::set<std::string>(docs.begin(), docs.begin() + 7));
    EXPECT_EQ(held_set, std::set<std::string>(docs.begin() + 7, docs.end()));
    for (const std::string& d : held_set) EXPECT_FALSE(train_set.contains(d)) << d;
    // Each part has its own identity, so a resume with another split is told apart.
    EXPECT_NE(train->identity(), whole);
    EXPECT_NE(validation.identity(), whole);
    EXPECT_NE(validation.identity(), train->identity());
    EXPECT_TRUE(has(train->describe(), "the last 3 held out")) << train->describe();
    EXPECT_TRUE(has(validation.describe(), "held out")) << validation.describe();
    // Another split of a fresh source is the same split.
    auto again = open(dir / path);
    ASSERT_TRUE(again->hold_out(3).is_ok());
    EXPECT_EQ(again->identity(), train->identity());
    // Refused: nothing left to train on, nothing held out, or documents already read.
    auto r = open(dir / path)->hold_out(10);
    ASSERT_FALSE(r.is_ok());
    EXPECT_TRUE(has(r.status().message(), "hold out at most 9")) << r.status().message();
    r = open(dir / path)->hold_out(0);
    ASSERT_FALSE(r.is_ok());
    EXPECT_TRUE(has(r.status().message(), "at least 1")) << r.status().message();
    r = train->hold_out(1);
    ASSERT_FALSE(r.is_ok());
    EXPECT_TRUE(has(r.status().message(), "before reading any")) << r.status().message();
  }
  fs::remove_all(dir);
}

TEST(HeldOut, TheSyntheticHeldOutStreamIsAnotherSeed) {
  auto train = make_synthetic_source("pretrain", 4096, 7);
  auto fresh = make_synthetic_source("pretrain", 4096, 7);
  auto held = train.value()->hold_out(1);
  ASSERT_TRUE(held.is_ok()) << held.status().to_string();
  EXPECT_EQ(train.value()->identity(), fresh.value()->identity());  // training is unchanged
  EXPECT_NE(held.value()->identity(), train.value()->identity());
  const auto train_docs = take(*train.value(), 50), held_docs = take(*held.value(), 50);
  EXPECT_EQ(train_docs, take(*fresh.value(), 50));
  EXPECT_NE(held_docs, train_docs);
  const std::set<std::string> train_set(train_docs.begin(), train_docs.end());
  int shared = 0;
  for (const std::string& d : held_docs) shared += train_set.contains(d) && d.size() > 8 ? 1 : 0;
  EXPECT_EQ(shared, 0);
  EXPECT_FALSE(train.value()->hold_out(1).is_ok());  // after reading
}

TEST(HeldOut, ValidationStepsArePackedLikeTrainingSteps) {
  auto source = make_synthetic_source("prolong", 64, 3);
  auto held = source.value()->hold_out(1);
  ASSERT_TRUE(held.is_ok());
  auto steps = make_validation_steps(std::move(held.value()), 2, 64, 3);
  ASSERT_TRUE(steps.is_ok()) << steps.status().to_string();
  ASSERT_EQ(steps.value().size(), 3u);
  // The same as a Packer over the same held-out stream.
  Packer packer(std::move(make_synthetic_source("prolong", 64, 3).value()->hold_out(1).value()), 2, 64);
  for (const StepData& s : steps.value()) {
    ASSERT_TRUE(s.batch.validate().is_ok());
    EXPECT_EQ(s.batch.num_ranks, 2);
    EXPECT_EQ(s.tokens.size(), 128u);
    auto p = packer.next();
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(s.tokens, p.value().tokens);
    EXPECT_EQ(s.targets, p.value().targets);
    EXPECT_EQ(s.positions, p.value().positions);
    EXPECT_EQ(s.num_targets, p.value().num_targets);
  }
  // A held-out file part too small for the steps asked for is refused, not counted twice.
  const fs::path dir = fresh_dir("validation");
  write_jsonl(dir / "a.jsonl", {"0123456789", "abcdefghij", "ABCDEFGHIJ", "klmnopqrst"});
  auto enough = open(dir / "a.jsonl");
  auto two = enough->hold_out(2);  // 20 tokens
  ASSERT_TRUE(two.is_ok());
  auto fits = make_validation_steps(std::move(two.value()), 2, 5, 2);
  ASSERT_TRUE(fits.is_ok()) << fits.status().to_string();
  EXPECT_EQ(text_of(fits.value()[0].tokens) + text_of(fits.value()[1].tokens), "ABCDEFGHIJklmnopqrst");
  auto small = open(dir / "a.jsonl");
  auto too_few = make_validation_steps(std::move(small->hold_out(2).value()), 2, 5, 3);
  ASSERT_FALSE(too_few.is_ok());
  EXPECT_TRUE(has(too_few.status().message(), "hold out more documents")) << too_few.status().message();
  // Bad arguments.
  auto fresh = [] { return make_synthetic_source("pretrain", 64, 1).value(); };
  EXPECT_FALSE(make_validation_steps(nullptr, 2, 64, 1).is_ok());
  EXPECT_FALSE(make_validation_steps(fresh(), 0, 64, 1).is_ok());
  EXPECT_FALSE(make_validation_steps(fresh(), 2, 0, 1).is_ok());
  EXPECT_FALSE(make_validation_steps(fresh(), 2, 64, 0).is_ok());
  fs::remove_all(dir);
}

// ---- checkpoint headers ----

class CheckpointHeader : public ::testing::Test {
 protected:
  void SetUp() override {
    // A file per test and process: ctest runs this fixture's tests as processes side by side, and
    // with one shared file a test loaded another's header (CI, 2026-11-28).
    path_ = (fs::path(::testing::TempDir()) /
             fmt::format("distca_inputs_header_{}_{}.ckpt", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                         static_cast<long>(::getpid())))
                .string();
    config_ = find_preset("tiny").value().model;
    cad_ = ModelState<float>::create(config_);
    colocated_ = ModelState<float>::create(config_);
    cad_.step = colocated_.step = 7;
    ASSERT_TRUE(save_checkpoint(path_, {{"colocated", &colocated_}, {"cad", &cad_}}, {{"data", "x"}}).is_ok());
    const std::string text = read_text_file(path_).value();
    const size_t line1 = text.find('\n'), line2 = text.find('\n', line1 + 1);
    magic_ = text.substr(0, line1 + 1);
    header_ = nlohmann::json::parse(text.substr(line1 + 1, line2 - line1 - 1));
    payload_ = text.substr(line2 + 1);
  }
  void TearDown() override { fs::remove(path_); }
  // Writes the checkpoint with another header and the same payload, and loads it.
  Result<nlohmann::json> load_with(const nlohmann::json& header) {
    EXPECT_TRUE(write_file_atomic(path_, magic_ + header.dump() + "\n" + payload_).is_ok());
    auto fresh = ModelState<float>::create(config_);
    return load_checkpoint(path_, {{"cad", &fresh}});
  }
  std::string path_;
  ModelConfig config_;
  ModelState<float> cad_, colocated_;
  std::string magic_, payload_;
  nlohmann::json header_;
};

TEST_F(CheckpointHeader, AGoodHeaderLoads) {
  auto fresh = ModelState<float>::create(config_);
  auto r = load_checkpoint(path_, {{"cad", &fresh}});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(fresh.step, 7);
  EXPECT_EQ(r.value()["run"]["data"], "x");
  nlohmann::json last = header_;
  last["step"] = kMaxCheckpointStep;  // the largest plausible step
  EXPECT_TRUE(load_with(last).is_ok());
  last["step"] = 0;
  EXPECT_TRUE(load_with(last).is_ok());
}

TEST_F(CheckpointHeader, EveryDamagedFieldIsRefusedNamingItAndTheFile) {
  struct Damage {
    std::string name;
    std::function<void(nlohmann::json&)> change;
    std::string field;  // the message names it
  };
  const int64_t floats = header_["floats_per_state"].get<int64_t>();
  const std::vector<Damage> damages = {
      {"negative step", [](nlohmann::json& h) { h["step"] = -1; }, "\"step\""},
      {"fractional step", [](nlohmann::json& h) { h["step"] = 1.5; }, "\"step\""},
      {"huge step", [](nlohmann::json& h) { h["step"] = 99999999999LL; }, "\"step\""},
      {"step as text", [](nlohmann::json& h) { h["step"] = "5"; }, "\"step\""},
      {"no step", [](nlohmann::json& h) { h.erase("step"); }, "\"step\""},
      {"unknown state", [](nlohmann::json& h) { h["states"] = {"colocated", "flash"}; }, "\"states\""},
      {"duplicate state", [](nlohmann::json& h) { h["states"] = {"cad", "cad"}; }, "\"states\""},
      {"states not a list", [](nlohmann::json& h) { h["states"] = "cad"; }, "\"states\""},
      {"no states", [](nlohmann::json& h) { h["states"] = nlohmann::json::array(); }, "\"states\""},
      {"one state fewer", [](nlohmann::json& h) { h["states"] = {"cad"}; }, "\"payload_bytes\""},
      {"floats per state", [&](nlohmann::json& h) { h["floats_per_state"] = floats + 1; }, "\"floats_per_state\""},
      {"fractional floats", [&](nlohmann::json& h) { h["floats_per_state"] = 1.5; }, "\"floats_per_state\""},
      {"negative floats", [&](nlohmann::json& h) { h["floats_per_state"] = -floats; }, "\"floats_per_state\""},
      {"payload bytes", [](nlohmann::json& h) { h["payload_bytes"] = h["payload_bytes"].get<int64_t>() + 4; }, "\"payload_bytes\""},
      {"checksum not text", [](nlohmann::json& h) { h["fnv1a"] = 5; }, "\"fnv1a\""},
      {"checksum not hex", [](nlohmann::json& h) { h["fnv1a"] = "not-a-checksum!!"; }, "\"fnv1a\""},
      {"model layers", [](nlohmann::json& h) { h["model"]["num_layers"] = 2.5; }, "\"num_layers\""},
      {"model field", [](nlohmann::json& h) { h["model"]["dropout"] = 0.1; }, "\"dropout\""},
      {"no model", [](nlohmann::json& h) { h.erase("model"); }, "\"model\""},
      {"run not an object", [](nlohmann::json& h) { h["run"] = "text"; }, "\"run\""},
      {"no run", [](nlohmann::json& h) { h.erase("run"); }, "\"run\""},
      {"unknown field", [](nlohmann::json& h) { h["learning_rate"] = 0.1; }, "\"learning_rate\""},
  };
  for (const Damage& d : damages) {
    nlohmann::json header = header_;
    d.change(header);
    auto r = load_with(header);
    ASSERT_FALSE(r.is_ok()) << d.name;
    EXPECT_TRUE(has(r.status().message(), d.field)) << d.name << ": " << r.status().message();
    EXPECT_TRUE(has(r.status().message(), path_)) << d.name << ": " << r.status().message();
  }
  // A header that is no object, and a magic line without a version.
  EXPECT_FALSE(load_with(nlohmann::json::array({1, 2})).is_ok());
  ASSERT_TRUE(write_file_atomic(path_, "distca-checkpoint\n{}\n").is_ok());
  auto fresh = ModelState<float>::create(config_);
  auto r = load_checkpoint(path_, {{"cad", &fresh}});
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(has(r.status().message(), "not a distca checkpoint")) << r.status().message();
}

TEST_F(CheckpointHeader, SavingRefusesWhatLoadingWouldRefuse) {
  auto other = ModelState<float>::create(config_);
  EXPECT_FALSE(save_checkpoint(path_, {{"flash", &other}}, nlohmann::json::object()).is_ok());
  EXPECT_FALSE(save_checkpoint(path_, {{"cad", &cad_}, {"cad", &other}}, nlohmann::json::object()).is_ok());
  EXPECT_FALSE(save_checkpoint(path_, {{"cad", &cad_}}, "not an object").is_ok());
  EXPECT_FALSE(save_checkpoint(path_, {{"cad", &cad_}, {"colocated", &other}}, nlohmann::json::object()).is_ok())
      << "states at different steps (7 and 0)";
  // None of them replaced the good file.
  auto fresh = ModelState<float>::create(config_);
  EXPECT_TRUE(load_checkpoint(path_, {{"colocated", &fresh}}).is_ok());
}

}  // namespace
}  // namespace distca::model
