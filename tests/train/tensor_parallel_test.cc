// Tensor parallelism under LocalComm: the rank map and its groups, the parameter slices, and
// training: every (tp, pp, dp) layout with tp >= 2 and tp x pp x dp <= 8 (the data-parallel
// trainer for pp = 1, the pipeline trainer otherwise), colocated and CAD, reproduces the loss
// curve of the same model trained on one rank, within 1e-5 relative over 6 steps (10 with DISTCA_TEST_LONG=1).
#include "distca/train/tensor_parallel.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"
#include "distca/train/pipeline.h"
#include "distca/train/data_parallel.h"
#include "pipeline_util.h"
#include "soak.h"

namespace distca::train {
namespace {

namespace fs = std::filesystem;

std::string data_file() {
  // One file per process: ctest runs this binary's tests as concurrent processes.
  static const testing::ProcessDataFile file("distca_tp");
  return file.path();
}

using testing::tp_model;

TEST(RankMap, TensorParallelIsInnermostThenDataThenPipeline) {
  const RankMap m = RankMap::of(8, 2, 2);  // tp 2, pp 2, dp 2
  ASSERT_EQ(m.dp, 2);
  const RankCoords c = m.coords(5);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 0);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(m.tp_group(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.dp_group(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.pp_group(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.cad_group(5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.describe()[5], "rank 5: tp 1, pp 1, dp 0; groups tp [4 5], dp [5 7], pp [1 5], cad servers [1 3 5 7]");
  for (auto [tp, pp] : {std::pair{1, 1}, {2, 1}, {4, 2}, {1, 8}, {8, 1}}) {
    const RankMap r = RankMap::of(8, tp, pp);
    for (int w = 0; w < 8; ++w) EXPECT_EQ(r.rank(r.coords(w)), w) << tp << " " << pp;
  }
}

TEST(TensorParallel, ShardsAreSlicesOfTheWholeModel) {
  const model::ModelConfig c = tp_model(2);
  const auto whole = model::ModelState<float>::create(c);
  for (int tp : {2, 4, 8}) {
    int64_t held = 0;
    for (int i = 0; i < tp; ++i) {
      const auto s = model::ModelState<float>::create(c, tp, i);
      EXPECT_EQ(s.config.num_q_heads, 8 / tp);
      EXPECT_EQ(s.config.num_kv_heads, std::max(2 / tp, 1));
      held += s.params.size();
      const int kv = i / model::kv_head_replicas(c, tp);  // the key/value slice this rank holds
      for (const auto& b : s.params.blocks()) {
        const auto* w = whole.params.find(b.name);
        ASSERT_NE(w, nullptr);
        const float* got = s.params.at(b.offset);
        const float* all = whole.params.at(w->offset);
        const bool rows = b.name.ends_with(".wo") || b.name.ends_with(".w_down");
        const bool is_kv = b.name.ends_with(".wk") || b.name.ends_with(".wv");
        for (int64_t e = 0; e < b.count; ++e) {
          int64_t at = e;  // replicated
          if (model::ModelState<float>::is_tp_sharded(b.name)) {
            const int64_t width = b.count / c.d_model, whole_width = w->count / c.d_model;
            at = rows ? i * b.count + e : (e / width) * whole_width + (is_kv ? kv : i) * width + e % width;
          }
          ASSERT_EQ(got[e], all[at]) << b.name << " tp " << tp << " rank " << i << " element " << e;
        }
      }
    }
    // The replicated blocks on every rank, each projection once over the group, and a shared
    // key/value head once per rank that shares it.
    const int64_t replicated = 2 * c.vocab_size * c.d_model + c.d_model + c.num_layers * 2 * c.d_model;
    const int64_t kv = c.num_layers * 2 * c.d_model * c.kv_width();
    EXPECT_EQ(held, tp * replicated + (whole.params.size() - replicated) + (model::kv_head_replicas(c, tp) - 1) * kv) << tp;
  }
}

TEST(TensorParallel, LayoutsTheModelCannotSplitAreRefused) {
  model::ModelConfig m = tp_model(2);
  EXPECT_NE(model::tensor_parallel_shard(m, 3).status().message().find("query heads"), std::string::npos);
  m.num_q_heads = 6;
  m.num_kv_heads = 3;
  m.ffn_dim = 60;
  EXPECT_NE(model::tensor_parallel_shard(m, 2).status().message().find("key/value heads"), std::string::npos);
  m = tp_model(2);
  m.ffn_dim = 36;
  EXPECT_NE(model::tensor_parallel_shard(m, 8).status().message().find("ffn dim"), std::string::npos);
  TrainOptions o;
  o.model = tp_model(2);
  o.tp = 2;
  o.checkpoint_path = "x.ckpt";
  EXPECT_NE(o.validate(2).message().find("--tp does not support --checkpoint"), std::string::npos);
  // tp must divide the world.
  auto statuses = comm::LocalWorld::run(3, [&](comm::Communicator& c) -> Status {
    TrainOptions t;
    t.model = tp_model(2);
    t.tp = 2;
    return DataParallelTrainer::create(c, t).status();
  });
  for (const Status& s : statuses) EXPECT_NE(s.message().find("--tp 2 x --pp 1 must divide the 3 ranks"), std::string::npos) << s.message();
}

TEST(TensorParallel, RanksWithDifferentPlansAllSayWhich) {
  auto statuses = comm::LocalWorld::run(3, [&](comm::Communicator& c) -> Status {
    return check_same_plan(c, c.rank() == 2 ? 7 : 9, "step 1");
  });
  for (const Status& s : statuses) EXPECT_NE(s.message().find("step 1: rank 2 of the group made another plan"), std::string::npos) << s.message();
  statuses = comm::LocalWorld::run(2, [&](comm::Communicator& c) -> Status { return check_same_plan(c, 0xdeadbeefcafeULL, "x"); });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.message();
}

double worst(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  return testing::worst_relative(got, want);
}

TrainOptions dp_options(int tp, int64_t context, int64_t steps) {
  TrainOptions o;
  o.model = tp_model(2);
  o.context = context;
  o.steps = steps;
  o.data_path = data_file();
  o.granularity = 16;
  o.tp = tp;
  o.backends = {"colocated", "cad"};
  return o;
}

// Rank 0's loss per backend, in step order; every rank of the run must report the same.
// `split_steps`: the steps CAD ran as two ping-pong nano-batches (a step of one document runs
// whole), never one without ping-pong.
std::map<std::string, std::vector<double>> train_dp(int ranks, const TrainOptions& o, int* split_steps = nullptr) {
  std::vector<std::map<std::string, std::vector<double>>> per_rank(static_cast<size_t>(ranks));
  std::vector<int> split(static_cast<size_t>(ranks), 0);
  auto statuses = comm::LocalWorld::run(ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, DataParallelTrainer::create(c, o));
    for (int64_t s = 0; s < o.steps; ++s) {
      DISTCA_ASSIGN_OR_RETURN(auto records, t->step());
      for (const StepRecord& r : records) {
        per_rank[c.rank()][r.backend].push_back(r.loss);
        if (o.pingpong == "off" && r.split_micro_batches != 0) return internal_error("ping-pong off split a step");
        if (r.backend == "cad") split[c.rank()] += r.split_micro_batches;
      }
    }
    return Status::ok();
  }, std::chrono::seconds(60));
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].message();
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(per_rank[r], per_rank[0]) << "rank " << r;
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(split[r], split[0]) << "rank " << r;
  if (split_steps != nullptr) *split_steps = split[0];
  return per_rank[0];
}

// Colocated and CAD, ping-pong on (both backends: two nano-batches per step) and off, reproduce
// the one-rank curve (colocated, whole steps) on every layout.
TEST(TensorParallel, DataParallelLayoutsReproduceTheOneRankCurve) {
  constexpr int64_t T = 64;
  // 4 steps (10 with DISTCA_TEST_LONG=1): each layout's curve must match from the first step.
  const int64_t kSteps = distca::testing::soak<int64_t>(4, 10);
  struct Variant {
    const char* policy;
    plan::BackwardMode mode;
    const char* pingpong;
  };
  const std::vector<Variant> all = {{"minbytes", plan::BackwardMode::kStateful, "on"},
                                    {"minbytes", plan::BackwardMode::kStateless, "off"},
                                    {"distca", plan::BackwardMode::kStateless, "on"},
                                    {"distca", plan::BackwardMode::kStateful, "off"}};
  for (int dp : {1, 2, 4, 8}) {
    // One replica gets 2T (ping-pong needs two documents in a step; T tokens often hold one).
    const int64_t context = dp == 1 ? 2 * T : T;
    TrainOptions one = dp_options(1, dp * context, kSteps);
    one.backends = {"colocated"};
    one.pingpong = "off";
    const auto want = train_dp(1, one)["colocated"];
    ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
    ASSERT_LT(want.back(), want.front());  // it learns
    for (auto [tp, dp_size] : {std::pair{1, 2}, {2, 1}, {2, 2}, {2, 4}, {4, 1}, {4, 2}, {8, 1}}) {
      if (dp_size != dp) continue;
      // The larger layouts with ping-pong on and off once each (time).
      const size_t variants = tp * dp > 4 ? 2 : all.size();
      for (size_t v = 0; v < variants; ++v) {
        TrainOptions o = dp_options(tp, context, kSteps);
        o.policy = all[v].policy;
        o.backward_mode = all[v].mode;
        o.pingpong = all[v].pingpong;
        int split = 0;
        auto got = train_dp(tp * dp, o, &split);
        const std::string where = fmt::format("tp {}, dp {}, {}, {}, ping-pong {} ({} of {} steps split)", tp, dp, o.policy,
                                              plan::backward_mode_name(o.backward_mode), o.pingpong, split, kSteps);
        if (o.pingpong == "on") {
          EXPECT_GE(split, kSteps / 2) << where;
        }
        const double col = worst(got["colocated"], want), cad = worst(got["cad"], want);
        std::printf("%s: max rel loss diff vs one rank: colocated %.2e, cad %.2e\n", where.c_str(), col, cad);
        EXPECT_LE(col, 1e-5) << where << ", colocated";
        EXPECT_LE(cad, 1e-5) << where << ", cad";
      }
    }
  }
}

std::vector<double> train_pp(int ranks, const TrainOptions& o) {
  std::vector<double> losses;
  std::mutex mu;
  auto statuses = comm::LocalWorld::run(ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(c, o));
    for (int64_t s = 0; s < o.steps; ++s) {
      DISTCA_ASSIGN_OR_RETURN(std::vector<StepRecord> records, t->step());
      const StepRecord& r = records.at(0);
      std::lock_guard lock(mu);
      if (c.rank() == 0) losses.push_back(r.loss);
    }
    return Status::ok();
  }, std::chrono::seconds(60));
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].message();
  return losses;
}

TEST(TensorParallel, PipelineLayoutsReproduceTheOneRankCurve) {
  constexpr int64_t T = 64;
  // 4 steps (10 with DISTCA_TEST_LONG=1): each layout's curve must match from the first step.
  const int kSteps = distca::testing::soak<int>(4, 10);
  for (auto [tp, pp, dp] : {std::tuple{2, 2, 1}, {2, 2, 2}, {4, 2, 1}, {2, 4, 1}}) {
    const int M = 2 * pp;
    auto options = [&](int tp_, int pp_, int64_t context, const std::string& schedule, const std::string& policy) {
      TrainOptions o = testing::pipeline_options(data_file(), pp_, M, schedule, policy, context, kSteps, 2 * pp);
      o.model = tp_model(2 * pp);
      o.tp = tp_;
      return o;
    };
    const auto want = testing::one_rank_curve(options(1, 1, dp * T, "colocated", "none")).value().losses;
    ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
    const std::string where = fmt::format("tp {}, pp {}, dp {}", tp, pp, dp);
    for (const char* pingpong : {"on", "off"}) {
      auto with = [&](TrainOptions o) {
        o.pingpong = pingpong;
        return o;
      };
      const double col = worst(train_pp(tp * pp * dp, with(options(tp, pp, T, "colocated", "none"))), want);
      const double cad = worst(train_pp(tp * pp * dp, with(options(tp, pp, T, "cad", "minbytes"))), want);
      std::printf("%s, ping-pong %s: max rel loss diff vs one rank: colocated %.2e, cad %.2e\n", where.c_str(), pingpong,
                  col, cad);
      EXPECT_LE(col, 1e-5) << where << ", colocated, ping-pong " << pingpong;
      EXPECT_LE(cad, 1e-5) << where << ", cad, ping-pong " << pingpong;
    }
  }
}

}  // namespace
}  // namespace distca::train
