// Training data sources: data identity by content, epochs, held-out documents and the
// validation steps packed from them.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "distca/core/file.h"
#include "distca/train/data.h"

namespace distca::train {
namespace {

namespace fs = std::filesystem;

// An empty folder of this test's own under the test temp dir.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("distca_data_" + name);
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


// Data identity.

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

}  // namespace
}  // namespace distca::train
