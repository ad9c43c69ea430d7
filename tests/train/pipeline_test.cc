// Pipeline-parallel training under LocalComm: for (pp, dp) in {(2,1), (3,1), (4,1),
// (2,2)} and M in {1, 2, 2P + 1}, both schedules (colocated 1F1B; cad: lockstep ticks with
// pooled plans, every CAD policy), with ping-pong on and off, reproduce the loss curve of the same model trained on one rank
// with the same micro-batches, and after one step every owned gradient equals one rank's.
#include "distca/train/pipeline.h"

#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"
#include "distca/plan/pipeline_schedule.h"
#include "pipeline_util.h"
#include "soak.h"

namespace distca::train {
namespace {

namespace fs = std::filesystem;
using testing::Curve;

std::string data_file() {
  // One file per process: ctest runs this binary's tests as concurrent processes.
  static const testing::ProcessDataFile file("distca_pipeline");
  return file.path();
}

TrainOptions options(int pp, int M, const std::string& schedule, const std::string& policy, int64_t context, int steps,
                        int64_t layers) {
  return testing::pipeline_options(data_file(), pp, M, schedule, policy, context, steps, layers);
}

Curve train(int ranks, const TrainOptions& o) {
  Curve run;
  std::mutex mu;
  const int steps = static_cast<int>(o.steps);
  auto statuses = comm::LocalWorld::run(ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(c, o));
    for (int s = 0; s < steps; ++s) {
      DISTCA_ASSIGN_OR_RETURN(std::vector<StepRecord> records, t->step());
      const StepRecord& r = records.at(0);
      std::lock_guard lock(mu);
      if (c.rank() == 0) run.losses.push_back(r.loss), run.split_micro_batches += r.split_micro_batches;
      if (s == 0 && t->replica() == 0) {
        const auto [b, e] = t->owned_range();
        if (run.gradient.empty()) run.gradient.assign(static_cast<size_t>(t->state(0).params.size()), 0.0f);
        std::copy(t->last_gradient(0).begin(), t->last_gradient(0).end(), run.gradient.begin() + b);
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
  ASSERT_EQ(got.gradient.size(), want.gradient.size());
  const testing::Difference d = testing::difference(got.losses, got.gradient, 0, want);
  EXPECT_LE(d.loss, 1e-5);
  EXPECT_LE(d.gradient, 1e-5);
}

TEST(Pipeline, EveryLayoutAndScheduleReproducesTheOneRankCurveAndGradients) {
  constexpr int64_t T = 64;
  // 6 steps (10 with DISTCA_TEST_LONG=1): each layout's curve must match from the first step.
  const int kSteps = distca::testing::soak<int>(6, 10);
  for (auto [pp, dp] : {std::pair{2, 1}, {3, 1}, {4, 1}, {2, 2}}) {
    for (int M : {1, 2, 2 * pp + 1}) {
      // The same model on one rank, each micro-batch D x T tokens.
      const int64_t layers = 2 * pp;
      const Curve one = testing::one_rank_curve(options(1, M, "colocated", "none", dp * T, kSteps, layers)).value();
      ASSERT_EQ(one.losses.size(), static_cast<size_t>(kSteps));
      ASSERT_LT(one.losses.back(), one.losses.front());  // it learns
      const std::string where = fmt::format("pp {}, dp {}, M {}", pp, dp, M);
      // Colocated and cad minbytes with ping-pong on and off, the other policies with ping-pong
      // (cad's default).
      for (const auto& [schedule, policy, pingpong] : std::vector<std::array<std::string, 3>>{
               {"colocated", "none", "off"}, {"colocated", "none", "on"}, {"cad", "minbytes", "off"},
               {"cad", "minbytes", "auto"}, {"cad", "minmax", "auto"}, {"cad", "distca", "auto"}}) {
        TrainOptions o = options(pp, M, schedule, policy, T, kSteps, layers);
        o.pingpong = pingpong;
        const Curve got = train(pp * dp, o);
        const std::string what = fmt::format("{}, {} {}, ping-pong {}", where, schedule, policy, pingpong);
        expect_same(got, one, what);
        // Ping-pong splits the micro-batches of several documents (at least a third of them in
        // this data; 64-token micro-batches of one rank often hold one), none when off.
        if (pingpong == "off") {
          EXPECT_EQ(got.split_micro_batches, 0) << what;
        } else {
          EXPECT_GE(got.split_micro_batches, (kSteps * M + 2) / 3) << what;
        }
      }
    }
  }
}

// Memory per rank: the parts add up, the record's max and mean are over the ranks, the states and
// workspaces are what the stage holds (as many workspaces as its peak of micro-batches in flight
// in the schedule), and CAD's pooled attention buffers are counted on every rank.
TEST(Pipeline, MemoryPerRankIsWhatTheStageHoldsAndAddsUp) {
  constexpr int64_t T = 64;
  for (const char* schedule : {"colocated", "cad"}) {
    const TrainOptions o = options(2, 3, schedule, "minbytes", T, 2, 4);
    std::vector<StepRecord> records(4);
    auto statuses = comm::LocalWorld::run(4, [&](comm::Communicator& c) -> Status {
      DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(c, o));
      DISTCA_RETURN_IF_ERROR(t->step().status());
      DISTCA_ASSIGN_OR_RETURN(std::vector<StepRecord> step, t->step());
      records[c.rank()] = step.at(0);
      return Status::ok();
    }, std::chrono::seconds(60));
    for (const Status& st : statuses) ASSERT_TRUE(st.is_ok()) << st.message();
    const StepRecord& r = records[0];
    ASSERT_EQ(r.ranks.size(), 4u);
    const auto sched = plan::pipeline_schedule(schedule, 2, 3).value();
    int64_t most = 0;
    double mean = 0;
    for (int w = 0; w < 4; ++w) {
      SCOPED_TRACE(fmt::format("{} rank {}", schedule, w));
      const StepRecord::Rank& x = r.ranks[w];
      EXPECT_EQ(records[w].ranks[w].memory(), x.memory());  // every rank reports the same table
      EXPECT_EQ(x.memory(), x.memory_states + x.memory_activations + x.memory_attention + x.memory_messages);
      const int stage = w / 2;
      int held = 0, peak = 0;
      for (const auto& tick : sched.ticks) {
        held += tick[stage].op == plan::PipeOp::kForward ? 1 : tick[stage].op == plan::PipeOp::kBackward ? -1 : 0;
        peak = std::max(peak, held);
      }
      // A workspace per micro-batch in flight, and the buffer its stage messages land in (the
      // first stage's from the next, the last's from the previous).
      const int64_t workspace = model::Model<float>::workspace_bytes(o.model, T, {stage * 2, 2});
      const int64_t message = T * o.model.d_model * static_cast<int64_t>(sizeof(float));
      EXPECT_EQ(x.memory_activations, peak * workspace + message);
      EXPECT_EQ(x.memory_states, r.ranks[stage * 2].memory_states);  // the same within a stage
      EXPECT_GT(x.memory_attention, 0);
      EXPECT_GT(x.memory_messages, 0);
      most = std::max(most, x.memory());
      mean += static_cast<double>(x.memory()) / 4;
    }
    EXPECT_EQ(r.memory_max_bytes, most);
    EXPECT_NEAR(r.memory_mean_bytes, mean, 1e-6 * mean);
  }
}

// Recompute: a stage keeps as many workspaces as the last stage and recomputes the others'
// linear activations from their stage input and saved attention outputs, so the curve and the
// gradients are the same bit for bit, the first stage's recompute takes time, the last stage's
// none, and the stages' memory evens out.
TEST(Pipeline, RecomputeKeepsTheCurveBitForBitAndEvensMemoryAcrossStages) {
  constexpr int64_t T = 64;
  constexpr int kSteps = 3;
  for (const char* schedule : {"colocated", "cad"}) {
    for (const char* pingpong : {"off", "on"}) {
      const std::string what = fmt::format("{}, ping-pong {}", schedule, pingpong);
      SCOPED_TRACE(what);
      struct Run {
        std::vector<double> losses;
        std::vector<float> gradient;
        StepRecord last;
      };
      auto run = [&](bool recompute) {
        TrainOptions o = options(2, 3, schedule, schedule == std::string("cad") ? "minbytes" : "none", T, kSteps, 4);
        o.pingpong = pingpong;
        o.recompute = recompute;
        Run out;
        std::mutex mu;
        auto statuses = comm::LocalWorld::run(4, [&](comm::Communicator& c) -> Status {
          DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(c, o));
          for (int s = 0; s < kSteps; ++s) {
            DISTCA_ASSIGN_OR_RETURN(std::vector<StepRecord> records, t->step());
      const StepRecord& r = records.at(0);
            std::lock_guard lock(mu);
            if (c.rank() == 0) out.losses.push_back(r.loss), out.last = r;
            if (c.rank() == 0 && s == 0) out.gradient = t->last_gradient(0);  // stage 0's: the one that recomputes
          }
          return Status::ok();
        }, std::chrono::seconds(60));
        for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.message();
        return out;
      };
      const Run plain = run(false), again = run(true);
      ASSERT_EQ(again.losses.size(), static_cast<size_t>(kSteps));
      EXPECT_EQ(again.losses, plain.losses);
      EXPECT_EQ(again.gradient, plain.gradient);
      ASSERT_EQ(again.last.ranks.size(), 4u);
      for (int w = 0; w < 4; ++w) {
        const auto& x = again.last.ranks[w];
        if (w < 2) {
          EXPECT_GT(x.recompute, 0.0) << "rank " << w;
          EXPECT_LE(x.recompute, x.linear) << "rank " << w;  // inside linear
          EXPECT_LT(x.memory_activations, plain.last.ranks[w].memory_activations) << "rank " << w;
        } else {
          EXPECT_EQ(x.recompute, 0.0) << "rank " << w;
          EXPECT_EQ(x.memory_activations, plain.last.ranks[w].memory_activations) << "rank " << w;
        }
      }
      const double spread = static_cast<double>(again.last.memory_max_bytes) / again.last.memory_mean_bytes;
      const double before = static_cast<double>(plain.last.memory_max_bytes) / plain.last.memory_mean_bytes;
      std::printf("%s: memory max/mean over ranks %.3f without recompute, %.3f with\n", what.c_str(), before, spread);
      EXPECT_LT(spread, before);
    }
  }
}

// A stage that fails ends the step on every rank with its reason, well within the timeout.
TEST(Pipeline, AStageThatFailsEndsEveryRankWithItsError) {
  for (const char* schedule : {"colocated", "cad"}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto statuses = comm::LocalWorld::run(4, [&](comm::Communicator& c) -> Status {
      DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(c, options(2, 3, schedule, "minbytes", 64, 3, 4)));
      DISTCA_RETURN_IF_ERROR(t->step().status());
      if (c.rank() == 3) return internal_error("stage 1 replica 1 ran out of memory");
      return t->step().status();
    }, std::chrono::seconds(30));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << schedule;
    for (int r = 0; r < 4; ++r) {
      ASSERT_FALSE(statuses[r].is_ok()) << schedule << " rank " << r;
      EXPECT_NE(statuses[r].message().find("stage 1 replica 1 ran out of memory"), std::string::npos)
          << schedule << " rank " << r << ": " << statuses[r].message();
    }
  }
}

TEST(Pipeline, BadLayoutsAreRefused) {
  auto statuses = comm::LocalWorld::run(4, [](comm::Communicator& c) -> Status {
    for (auto [pp, what] : {std::pair{3, "--pp 3 must divide the 4 ranks"}, {6, "--pp 6 must divide the 4 ranks"}}) {
      auto t = PipelineTrainer::create(c, options(pp, 2, "cad", "minmax", 64, 1, 12));
      if (t.is_ok() || t.status().message().find(what) == std::string::npos) return internal_error(t.is_ok() ? "accepted" : t.status().message());
    }
    TrainOptions o = options(4, 2, "cad", "minmax", 64, 1, 12);
    o.model.num_layers = 6;
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
}  // namespace distca::train
