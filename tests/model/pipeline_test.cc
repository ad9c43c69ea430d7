// Pipeline-parallel training (issue 18) under LocalComm: for (pp, dp) in {(2,1), (3,1), (4,1),
// (2,2)} and M in {1, 2, 2P + 1}, both schedules (colocated 1F1B; cad: lockstep ticks with
// pooled plans, every CAD policy) reproduce the loss curve of the same model trained on one rank
// with the same micro-batches, and after one step every owned gradient equals one rank's.
#include "distca/model/pipeline.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"

namespace distca::model {
namespace {

namespace fs = std::filesystem;

// A JSONL file of documents of varied lengths (the packing is then the same for D ranks of T
// tokens and one rank of D x T tokens: the stream is cut the same way).
std::string data_file() {
  static const std::string path = [] {
    const fs::path p = fs::path(::testing::TempDir()) / "distca_pipeline.jsonl";
    std::ofstream out(p);
    uint64_t x = 12345;
    for (int d = 0; d < 400; ++d) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      const int len = 4 + static_cast<int>((x >> 33) % 150) + (d % 7 == 0 ? 120 : 0);
      std::string text;
      for (int i = 0; i < len; ++i) text += static_cast<char>('a' + (x >> (i % 40)) % 26);
      out << "{\"text\": \"" << text << "\"}\n";
    }
    return p.string();
  }();
  return path;
}

PipelineOptions options(int pp, int M, const std::string& schedule, const std::string& policy, int64_t context, int steps,
                        int64_t layers) {
  PipelineOptions o;
  o.train.model.num_layers = layers;
  o.train.model.d_model = 64;
  o.train.model.num_q_heads = 2;
  o.train.model.num_kv_heads = 1;
  o.train.model.head_dim = 32;
  o.train.model.ffn_dim = 64;
  o.train.context = context;
  o.train.steps = steps;
  o.train.data_path = data_file();
  o.train.policy = policy;
  o.train.granularity = 16;
  o.pp = pp;
  o.micro_batches = M;
  o.schedule = schedule;
  return o;
}

struct Curve {
  std::vector<double> losses;
  std::vector<float> gradient;  // step 1, the whole arena (each stage's owned range from its rank)
};

Curve train(int ranks, const PipelineOptions& o) {
  Curve run;
  std::mutex mu;
  const int steps = static_cast<int>(o.train.steps);
  auto statuses = comm::LocalWorld::run(ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(c, o));
    for (int s = 0; s < steps; ++s) {
      DISTCA_ASSIGN_OR_RETURN(PipelineStepRecord r, t->step());
      std::lock_guard lock(mu);
      if (c.rank() == 0) run.losses.push_back(r.loss);
      if (s == 0 && t->replica() == 0) {
        const auto [b, e] = t->owned_range();
        if (run.gradient.empty()) run.gradient.assign(static_cast<size_t>(t->state().params.size()), 0.0f);
        std::copy(t->last_gradient().begin(), t->last_gradient().end(), run.gradient.begin() + b);
      }
    }
    return Status::ok();
  }, std::chrono::seconds(60));
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].message();
  return run;
}

void expect_same(const Curve& got, const Curve& want, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-5 * std::abs(want.losses[s])) << "step " << s + 1;
  }
  ASSERT_EQ(got.gradient.size(), want.gradient.size());
  float scale = 0;
  for (float g : want.gradient) scale = std::max(scale, std::abs(g));
  float worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < want.gradient.size(); ++i) {
    if (std::abs(got.gradient[i] - want.gradient[i]) > worst) worst = std::abs(got.gradient[i] - want.gradient[i]), at = i;
  }
  EXPECT_LE(worst, 1e-5f * scale) << "largest gradient difference at element " << at;
}

TEST(Pipeline, EveryLayoutAndScheduleReproducesTheOneRankCurveAndGradients) {
  constexpr int64_t T = 64;
  constexpr int kSteps = 10;
  for (auto [pp, dp] : {std::pair{2, 1}, {3, 1}, {4, 1}, {2, 2}}) {
    for (int M : {1, 2, 2 * pp + 1}) {
      // The same model on one rank, each micro-batch D x T tokens.
      const int64_t layers = 2 * pp;
      const Curve one = train(1, options(1, M, "colocated", "none", dp * T, kSteps, layers));
      ASSERT_EQ(one.losses.size(), static_cast<size_t>(kSteps));
      ASSERT_LT(one.losses.back(), one.losses.front());  // it learns
      const std::string where = fmt::format("pp {}, dp {}, M {}", pp, dp, M);
      expect_same(train(pp * dp, options(pp, M, "colocated", "none", T, kSteps, layers)), one, where + ", colocated");
      for (const char* policy : {"distca", "minmax", "minbytes"}) {
        expect_same(train(pp * dp, options(pp, M, "cad", policy, T, kSteps, layers)), one, where + ", cad " + policy);
      }
    }
  }
}

TEST(Pipeline, BadLayoutsAreRefused) {
  auto statuses = comm::LocalWorld::run(4, [](comm::Communicator& c) -> Status {
    for (auto [pp, what] : {std::pair{3, "--pp 3 must divide the 4 ranks"}, {8, "--pp 8 must divide the 4 ranks"}}) {
      auto t = PipelineTrainer::create(c, options(pp, 2, "cad", "minmax", 64, 1, 12));
      if (t.is_ok() || t.status().message().find(what) == std::string::npos) return internal_error(t.is_ok() ? "accepted" : t.status().message());
    }
    PipelineOptions o = options(4, 2, "cad", "minmax", 64, 1, 12);
    o.train.model.num_layers = 6;
    auto t = PipelineTrainer::create(c, o);
    if (t.is_ok() || t.status().message().find("--pp 4 must divide the model's 6 layers") == std::string::npos) {
      return internal_error(t.is_ok() ? "6 layers on 4 stages accepted" : t.status().message());
    }
    o = options(2, 2, "zigzag", "minmax", 64, 1, 12);
    t = PipelineTrainer::create(c, o);
    if (t.is_ok()) return internal_error("schedule zigzag accepted");
    return Status::ok();
  });
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].message();
}

}  // namespace
}  // namespace distca::model
