// Checkpoint headers: a damaged field is refused naming it and the file, and a save refuses what
// a load would refuse.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "distca/core/file.h"
#include "distca/model/checkpoint.h"
#include "distca/model/config.h"
#include "distca/model/model.h"

namespace distca::model {
namespace {

namespace fs = std::filesystem;

bool says(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class CheckpointHeader : public ::testing::Test {
 protected:
  void SetUp() override {
    // A file per test and process: ctest runs this fixture's tests as processes side by side, and
    // with one shared file a test loaded another's header.
    path_ = (fs::path(::testing::TempDir()) /
             fmt::format("distca_checkpoint_header_{}_{}.ckpt", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
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
    EXPECT_TRUE(says(r.status().message(), d.field)) << d.name << ": " << r.status().message();
    EXPECT_TRUE(says(r.status().message(), path_)) << d.name << ": " << r.status().message();
  }
  // A header that is no object, and a magic line without a version.
  EXPECT_FALSE(load_with(nlohmann::json::array({1, 2})).is_ok());
  ASSERT_TRUE(write_file_atomic(path_, "distca-checkpoint\n{}\n").is_ok());
  auto fresh = ModelState<float>::create(config_);
  auto r = load_checkpoint(path_, {{"cad", &fresh}});
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(says(r.status().message(), "not a distca checkpoint")) << r.status().message();
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
