// Pipeline schedules as data: tables worked out by hand from the rules (the header's), tick by
// tick, for small P and M, and the properties every table must have for P 1..4, M 1..8.
#include "distca/plan/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace distca::plan {
namespace {

// "F0 F1 . B0 | . F0 B0 ." -> [stage][tick] tokens.
std::vector<std::vector<std::string>> parse(const std::string& table) {
  std::vector<std::vector<std::string>> rows(1);
  std::string spaced;
  for (char c : table) spaced += c == '|' ? std::string(" | ") : std::string(1, c);
  std::istringstream in(spaced);
  for (std::string tok; in >> tok;) {
    if (tok == "|") rows.emplace_back();
    else rows.back().push_back(tok);
  }
  return rows;
}

std::vector<std::vector<std::string>> tokens(const PipelineSchedule& s) {
  std::vector<std::vector<std::string>> rows(s.stages);
  for (const auto& tick : s.ticks) {
    for (int r = 0; r < s.stages; ++r) {
      const PipeSlot& x = tick[r];
      rows[r].push_back(x.op == PipeOp::kIdle ? "." : (x.op == PipeOp::kForward ? "F" : "B") + std::to_string(x.micro_batch));
    }
  }
  return rows;
}

struct HandTable {
  int stages, micro_batches;
  const char* table;
};

// Plain 1F1B, each op at the first tick its input is there (F after the previous stage's F, B
// after the next stage's B), stage r warming up with min(P - 1 - r, M) forwards.
TEST(PipelineSchedule, ColocatedIsOneFOneBAsWorkedOutByHand) {
  const HandTable tables[] = {
      {2, 1, "F0 .  .  B0 | .  F0 B0 ."},
      {2, 2, "F0 F1 .  B0 .  B1 | .  F0 B0 F1 B1 ."},
      {2, 3, "F0 F1 .  B0 F2 B1 .  B2 | .  F0 B0 F1 B1 F2 B2 ."},
      {2, 4, "F0 F1 .  B0 F2 B1 F3 B2 .  B3 | .  F0 B0 F1 B1 F2 B2 F3 B3 ."},
      {2, 5, "F0 F1 .  B0 F2 B1 F3 B2 F4 B3 .  B4 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 ."},
      {2, 6, "F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 ."},
      {2, 7, "F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 .  B6 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 ."},
      {2, 8, "F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 ."},
      {3, 1, "F0 .  .  .  .  B0 | .  F0 .  .  B0 . | .  .  F0 B0 .  ."},
      {3, 2, "F0 F1 .  .  .  B0 .  B1 | .  F0 F1 .  B0 .  B1 . | .  .  F0 B0 F1 B1 .  ."},
      {3, 3, "F0 F1 F2 .  .  B0 .  B1 .  B2 | .  F0 F1 .  B0 F2 B1 .  B2 . | .  .  F0 B0 F1 B1 F2 B2 .  ."},
      {3, 4, "F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  ."},
      {3, 5, "F0 F1 F2 .  .  B0 F3 B1 F4 B2 .  B3 .  B4 | .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 .  B4 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 .  ."},
      {3, 6, "F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5 | .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  ."},
      {3, 7, "F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 .  B5 .  B6 |"
             ".  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 .  B6 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .  ."},
      {3, 8, "F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 |"
             ".  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  ."},
      {4, 1, "F0 . . . . . . B0 | . F0 . . . . B0 . | . . F0 . . B0 . . | . . . F0 B0 . . ."},
      {4, 2, "F0 F1 .  .  .  .  .  B0 .  B1 | .  F0 F1 .  .  .  B0 .  B1 . | .  .  F0 F1 .  B0 .  B1 .  . |"
             ".  .  .  F0 B0 F1 B1 .  .  ."},
      {4, 3, "F0 F1 F2 .  .  .  .  B0 .  B1 .  B2 | .  F0 F1 F2 .  .  B0 .  B1 .  B2 . |"
             ".  .  F0 F1 .  B0 F2 B1 .  B2 .  . | .  .  .  F0 B0 F1 B1 F2 B2 .  .  ."},
      {4, 4, "F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3 |"
             ".  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .  |"
             ".  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  ."},
      {4, 5, "F0 F1 F2 F3 .  .  .  B0 F4 B1 .  B2 .  B3 .  B4 |"
             ".  F0 F1 F2 .  .  B0 F3 B1 F4 B2 .  B3 .  B4 .  |"
             ".  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 .  B4 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 .  .  ."},
      {4, 6, "F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5 |"
             ".  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5 .  |"
             ".  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .  ."},
      {4, 7, "F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 .  B4 .  B5 .  B6 |"
             ".  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 .  B5 .  B6 .  |"
             ".  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 .  B6 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .  .  ."},
      {4, 8, "F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7 |"
             ".  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .  |"
             ".  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  ."},
  };
  for (const HandTable& h : tables) {
    SCOPED_TRACE(::testing::Message() << "P " << h.stages << ", M " << h.micro_batches);
    const PipelineSchedule s = colocated_schedule(h.stages, h.micro_batches).value();
    EXPECT_EQ(tokens(s), parse(h.table)) << s.to_text();
  }
}

// Lockstep ticks: P - 1 forward ticks, M [forward, backward] pairs, P - 1 backward ticks; in
// forward tick t stage r runs t - r, in backward tick u it runs u - (P - 1 - r).
TEST(PipelineSchedule, CadIsTheLockstepTicksAsWorkedOutByHand) {
  const HandTable tables[] = {
      {2, 1, "F0 .  .  B0 | .  F0 B0 ."},
      {2, 2, "F0 F1 .  .  B0 B1 | .  F0 B0 F1 B1 ."},
      {2, 3, "F0 F1 .  F2 B0 .  B1 B2 | .  F0 B0 F1 B1 F2 B2 ."},
      {2, 4, "F0 F1 .  F2 B0 F3 B1 .  B2 B3 | .  F0 B0 F1 B1 F2 B2 F3 B3 ."},
      {2, 5, "F0 F1 .  F2 B0 F3 B1 F4 B2 .  B3 B4 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 ."},
      {2, 6, "F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 .  B4 B5 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 ."},
      {2, 7, "F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 .  B5 B6 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 ."},
      {2, 8, "F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 B7 | .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 ."},
      {3, 1, "F0 .  .  .  .  B0 | .  F0 .  .  B0 . | .  .  F0 B0 .  ."},
      {3, 2, "F0 F1 .  .  .  .  B0 B1 | .  F0 F1 .  .  B0 B1 . | .  .  F0 B0 F1 B1 .  ."},
      {3, 3, "F0 F1 F2 .  .  .  .  B0 B1 B2 | .  F0 F1 .  F2 B0 .  B1 B2 . | .  .  F0 B0 F1 B1 F2 B2 .  ."},
      {3, 4, "F0 F1 F2 .  F3 .  .  B0 .  B1 B2 B3 | .  F0 F1 .  F2 B0 F3 B1 .  B2 B3 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  ."},
      {3, 5, "F0 F1 F2 .  F3 .  F4 B0 .  B1 .  B2 B3 B4 | .  F0 F1 .  F2 B0 F3 B1 F4 B2 .  B3 B4 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 .  ."},
      {3, 6, "F0 F1 F2 .  F3 .  F4 B0 F5 B1 .  B2 .  B3 B4 B5 | .  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 .  B4 B5 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  ."},
      {3, 7, "F0 F1 F2 .  F3 .  F4 B0 F5 B1 F6 B2 .  B3 .  B4 B5 B6 |"
             ".  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 .  B5 B6 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .  ."},
      {3, 8, "F0 F1 F2 .  F3 .  F4 B0 F5 B1 F6 B2 F7 B3 .  B4 .  B5 B6 B7 |"
             ".  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 B7 . |"
             ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  ."},
      {4, 1, "F0 . . . . . . B0 | . F0 . . . . B0 . | . . F0 . . B0 . . | . . . F0 B0 . . ."},
      {4, 2, "F0 F1 .  .  .  .  .  .  B0 B1 | .  F0 F1 .  .  .  .  B0 B1 . | .  .  F0 F1 .  .  B0 B1 .  . |"
             ".  .  .  F0 B0 F1 B1 .  .  ."},
      {4, 3, "F0 F1 F2 .  .  .  .  .  .  B0 B1 B2 | .  F0 F1 F2 .  .  .  .  B0 B1 B2 . |"
             ".  .  F0 F1 .  F2 B0 .  B1 B2 .  . | .  .  .  F0 B0 F1 B1 F2 B2 .  .  ."},
      // Ticks F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 B4 B5 B6.
      {4, 4, "F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3 |"
             ".  F0 F1 F2 .  F3 .  .  B0 .  B1 B2 B3 .  |"
             ".  .  F0 F1 .  F2 B0 F3 B1 .  B2 B3 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  ."},
      {4, 5, "F0 F1 F2 F3 .  F4 .  .  .  .  B0 .  B1 B2 B3 B4 |"
             ".  F0 F1 F2 .  F3 .  F4 B0 .  B1 .  B2 B3 B4 .  |"
             ".  .  F0 F1 .  F2 B0 F3 B1 F4 B2 .  B3 B4 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 .  .  ."},
      {4, 6, "F0 F1 F2 F3 .  F4 .  F5 .  .  B0 .  B1 .  B2 B3 B4 B5 |"
             ".  F0 F1 F2 .  F3 .  F4 B0 F5 B1 .  B2 .  B3 B4 B5 .  |"
             ".  .  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 .  B4 B5 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .  ."},
      {4, 7, "F0 F1 F2 F3 .  F4 .  F5 .  F6 B0 .  B1 .  B2 .  B3 B4 B5 B6 |"
             ".  F0 F1 F2 .  F3 .  F4 B0 F5 B1 F6 B2 .  B3 .  B4 B5 B6 .  |"
             ".  .  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 .  B5 B6 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .  .  ."},
      {4, 8, "F0 F1 F2 F3 .  F4 .  F5 .  F6 B0 F7 B1 .  B2 .  B3 .  B4 B5 B6 B7 |"
             ".  F0 F1 F2 .  F3 .  F4 B0 F5 B1 F6 B2 F7 B3 .  B4 .  B5 B6 B7 .  |"
             ".  .  F0 F1 .  F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 B7 .  .  |"
             ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  ."},
  };
  for (const HandTable& h : tables) {
    SCOPED_TRACE(::testing::Message() << "P " << h.stages << ", M " << h.micro_batches);
    const PipelineSchedule s = cad_schedule(h.stages, h.micro_batches).value();
    EXPECT_EQ(tokens(s), parse(h.table)) << s.to_text();
  }
}

TEST(PipelineSchedule, EveryTableRunsEachMicroBatchOnceAfterItsInputs) {
  for (int P = 1; P <= 4; ++P) {
    for (int M = 1; M <= 8; ++M) {
      SCOPED_TRACE(::testing::Message() << "P " << P << ", M " << M);
      const PipelineSchedule col = colocated_schedule(P, M).value();
      const PipelineSchedule cad = cad_schedule(P, M).value();
      EXPECT_TRUE(check_schedule(col, false).is_ok()) << check_schedule(col, false).message();
      EXPECT_TRUE(check_schedule(cad, true).is_ok()) << check_schedule(cad, true).message();
      // Lockstep: 2 (M + P - 1) ticks; 1F1B with unit ticks is as long, with the textbook bubble
      // of 2 (P - 1) idle ticks on every stage.
      EXPECT_EQ(cad.ticks.size(), static_cast<size_t>(2 * (M + P - 1)));
      EXPECT_EQ(col.ticks.size(), static_cast<size_t>(2 * (M + P - 1)));
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(col.idle_ticks(r), 2 * (P - 1));
        EXPECT_EQ(cad.idle_ticks(r), 2 * (P - 1));
        // 1F1B's memory bound: stage r never holds more than min(P - r, M) micro-batches' activations.
        int held = 0, peak = 0;
        for (const auto& tick : col.ticks) {
          held += tick[r].op == PipeOp::kForward ? 1 : tick[r].op == PipeOp::kBackward ? -1 : 0;
          peak = std::max(peak, held);
        }
        EXPECT_EQ(peak, std::min(P - r, M)) << "stage " << r;
      }
      // Lockstep: every tick is one phase, and the micro-batch a stage runs is the rule's.
      for (const auto& tick : cad.ticks) {
        bool f = false, b = false;
        for (const PipeSlot& x : tick) f |= x.op == PipeOp::kForward, b |= x.op == PipeOp::kBackward;
        EXPECT_FALSE(f && b);
      }
    }
  }
  // A schedule that breaks a rule is caught.
  PipelineSchedule bad = colocated_schedule(2, 2).value();
  std::swap(bad.ticks[0], bad.ticks[1]);
  EXPECT_FALSE(check_schedule(bad, false).is_ok());
  bad = colocated_schedule(3, 3).value();
  EXPECT_NE(check_schedule(bad, true).message().find("mixes forwards and backwards"), std::string::npos);
}

TEST(PipelineSchedule, PrintsOneLinePerStageAndRefusesBadSizes) {
  EXPECT_EQ(cad_schedule(2, 2).value().to_text(), "stage 0: F0 F1 .  .  B0 B1\nstage 1: .  F0 B0 F1 B1 .\n");
  EXPECT_EQ(pipeline_schedule("cad", 2, 2).value().to_text(), cad_schedule(2, 2).value().to_text());
  EXPECT_EQ(pipeline_schedule("colocated", 3, 2).value().ticks, colocated_schedule(3, 2).value().ticks);
  auto r = pipeline_schedule("zigzag", 2, 2);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("no pipeline schedule 'zigzag' (colocated or cad)"), std::string::npos);
  for (auto [P, M, what] : {std::tuple{0, 2, "--pp must be 1..1024, got 0"}, {2, 0, "--micro-batches must be 1..65536, got 0"},
                            {2000, 2, "--pp must be 1..1024, got 2000"}}) {
    for (const char* name : {"colocated", "cad"}) {
      auto s = pipeline_schedule(name, P, M);
      ASSERT_FALSE(s.is_ok());
      EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.status().message().find(what), std::string::npos) << s.status().message();
    }
  }
}

}  // namespace
}  // namespace distca::plan
