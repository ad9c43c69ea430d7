// The C++ trainer's split of a micro-batch into two nano-batches (step_split.h): by whole
// documents, and one plan split at positions in its documents.
#include "distca/layout/step_split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "distca/plan/model_shape.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"
#include "layout/plans.h"

namespace distca::layout {
namespace {

using layout::testing::make_plan;

TEST(SplitStepByDocuments, SplitWholeDocumentsKeepingRanksAndHalvingTheWork) {
  auto batch = plan::pack_documents({500, 20, 300, 1, 77, 260, 90, 9, 400, 33}, 3, 560);
  ASSERT_TRUE(batch.is_ok());
  const plan::Batch& b = batch.value();
  auto split = split_step_by_documents(b);
  ASSERT_TRUE(split.is_ok()) << split.status().to_string();
  const NanoBatches& s = split.value();
  std::vector<int> seen(b.num_docs(), 0);
  std::array<int64_t, 2> pairs{0, 0};
  for (int n = 0; n < 2; ++n) {
    ASSERT_TRUE(s.batches[n].validate().is_ok());
    for (size_t i = 0; i < s.docs[n].size(); ++i) {
      const int32_t doc = s.docs[n][i];
      ++seen[doc];
      EXPECT_EQ(s.batches[n].doc_lengths[i], b.doc_lengths[doc]);
      pairs[n] += plan::causal_pairs(0, b.doc_lengths[doc]);
    }
    for (const plan::Piece& p : s.batches[n].pieces) {  // the same rank holds the same tokens
      const int32_t doc = s.docs[n][p.doc];
      bool found = false;
      for (int32_t i : b.doc_pieces[doc]) found |= b.pieces[i].rank == p.rank && b.pieces[i].begin == p.begin && b.pieces[i].end == p.end;
      EXPECT_TRUE(found) << "doc " << doc << " [" << p.begin << ", " << p.end << ") on rank " << p.rank;
    }
  }
  for (int c : seen) EXPECT_EQ(c, 1);
  // Rows: each rank's rows split exactly between the two halves.
  for (int r = 0; r < b.num_ranks; ++r) {
    std::vector<int64_t> all = s.rows[0][r];
    all.insert(all.end(), s.rows[1][r].begin(), s.rows[1][r].end());
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i));
  }
  // Longest first to the lighter half: the halves differ by at most the longest document's work.
  EXPECT_LE(std::abs(pairs[0] - pairs[1]), plan::causal_pairs(0, 500));
  EXPECT_LT(std::abs(pairs[0] - pairs[1]), (pairs[0] + pairs[1]) / 10);
}

TEST(SplitStepByDocuments, OneDocumentLeavesAnEmptyHalf) {
  auto split = split_step_by_documents(plan::pack_documents({64}, 2, 32).value());
  ASSERT_TRUE(split.is_ok()) << split.status().to_string();
  EXPECT_EQ(split.value().batches[1].num_docs(), 0);
  EXPECT_TRUE(split.value().rows[1][0].empty());
}

// One plan, split at positions in its documents (split_step): the nano-batches hold exactly the
// plan's tasks, B's layout begins with A's last rows, and together they move the plan's bytes.
TEST(SplitStep, OnePlanSplitAtDocumentPositionsMovesThePlansBytes) {
  struct Case {
    std::string what;
    plan::Batch batch;
  };
  std::vector<Case> cases;
  // The demo's shape: one long document on one rank, short ones on the other.
  cases.push_back({"one long document", plan::pack_documents({6144, 700, 1200, 300, 2500, 900, 544}, 2, 6144).value()});
  cases.push_back({"mixed, 4 ranks", plan::pack_documents({500, 20, 300, 1, 77, 260, 90, 9, 400, 33, 1800, 96}, 4, 900).value()});
  for (const char* workload : {"pretrain", "prolong"}) {
    for (int ranks : {2, 4, 8}) {
      plan::SamplingOptions so;
      so.seed = static_cast<uint64_t>(ranks);
      auto dist = plan::builtin_distribution(workload);
      ASSERT_TRUE(dist.is_ok());
      auto b = plan::sample_batch(dist.value(), so, ranks, 16384);
      ASSERT_TRUE(b.is_ok()) << b.status().to_string();
      cases.push_back({fmt::format("{}, {} ranks", workload, ranks), b.value()});
    }
  }
  // K/V rows each server receives from other ranks, per layer, over every rank's route.
  auto remote_kv_rows = [](const plan::Batch& b, const std::vector<plan::Task>& tasks,
                           const std::vector<KvInterval>& held) {
    int64_t rows = 0;
    for (int r = 0; r < b.num_ranks; ++r) {
      auto route = build_partial_route(b, tasks, r, held);
      EXPECT_TRUE(route.is_ok()) << route.status().to_string();
      for (int s = 0; s < b.num_ranks; ++s) {
        for (const Segment& g : route.value().to_server_kv[s]) rows += s == r ? 0 : g.rows;
      }
    }
    return rows;
  };
  for (const bool hold_kv : {false, true}) {
  int split_documents = 0, cut_tasks = 0, both_carry = 0;
  for (const Case& c : cases) {
    const plan::Batch& b = c.batch;
    auto whole = make_plan(b, "distca", 128);
    ASSERT_TRUE(whole.is_ok()) << c.what << ": " << whole.status().to_string();
    const plan::CostModel cost(plan::model_preset("llama-8b").value(), plan::ThroughputProfile{});
    auto split = split_step(b, whole.value(), cost, {.hold_kv = hold_kv});
    ASSERT_TRUE(split.is_ok()) << c.what << ": " << split.status().to_string();
    const NanoSplit& s = split.value();
    ASSERT_EQ(s.nano.context_rows.size(), static_cast<size_t>(b.num_ranks));
    EXPECT_EQ(s.held_kv.empty(), !hold_kv || s.plans[0].tasks.empty() || s.plans[1].tasks.empty()) << c.what;
    // The tasks: the plan's, each in one nano-batch, in the micro-batch's numbering; with held
    // K/V some are cut in two, and together they still compute every pair exactly once.
    std::vector<plan::Task> got;
    for (int n = 0; n < 2; ++n) {
      ASSERT_TRUE(s.nano.batches[n].validate().is_ok()) << c.what;
      for (plan::Task t : s.plans[n].tasks) {
        t.doc = s.nano.docs[n].at(t.doc);
        got.push_back(t);
      }
    }
    EXPECT_TRUE(plan::verify_tasks(b, got).is_ok()) << c.what;
    cut_tasks += static_cast<int>(got.size() - whole.value().tasks.size());
    if (!hold_kv) {
      auto key = [](const plan::Task& t) { return std::tie(t.doc, t.q0, t.q1, t.k0, t.k1, t.server); };
      std::vector<plan::Task> want = whole.value().tasks;
      std::sort(got.begin(), got.end(), [&](auto& x, auto& y) { return key(x) < key(y); });
      std::sort(want.begin(), want.end(), [&](auto& x, auto& y) { return key(x) < key(y); });
      EXPECT_EQ(got, want) << c.what;
    }
    // A's documents are prefixes: A's tasks end at or before where B's begin.
    for (size_t i = 0; i < s.nano.docs[0].size(); ++i) {
      const int32_t doc = s.nano.docs[0][i];
      const int64_t at = s.nano.batches[0].doc_lengths[i];
      EXPECT_LE(at, b.doc_lengths[doc]);
      if (at < b.doc_lengths[doc]) ++split_documents;
      for (const plan::Task& t : s.plans[1].tasks) {
        if (s.nano.docs[1][t.doc] == doc) EXPECT_GE(t.q0, at) << c.what << ": doc " << doc;
      }
    }
    // Rows: each rank's split exactly between the two; B's layout starts with A's last rows.
    for (int r = 0; r < b.num_ranks; ++r) {
      std::vector<int64_t> all = s.nano.rows[0][r];
      all.insert(all.end(), s.nano.rows[1][r].begin(), s.nano.rows[1][r].end());
      std::sort(all.begin(), all.end());
      for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i)) << c.what;
      const int64_t ctx = s.nano.context_rows[r];
      ASSERT_LE(ctx, static_cast<int64_t>(s.nano.rows[0][r].size()));
      int64_t b_rows = 0;
      for (const plan::Piece& p : s.nano.batches[1].pieces) b_rows += p.rank == r ? p.length() : 0;
      EXPECT_EQ(b_rows, ctx + static_cast<int64_t>(s.nano.rows[1][r].size())) << c.what << ", rank " << r;
    }
    // Bytes (stateful, every phase): at most 1.05x the plan's (two planned halves moved ~1.9x).
    // The held rows' K/V and dK/dV do not travel: what B's routes send less with them.
    constexpr int kStateful = static_cast<int>(plan::BackwardMode::kStateful);
    const plan::TokenBytes& tb = cost.token_bytes();
    int64_t held_bytes = 0;
    if (!s.held_kv.empty()) {
      const int64_t saved = remote_kv_rows(s.nano.batches[1], s.plans[1].tasks, {}) -
                            remote_kv_rows(s.nano.batches[1], s.plans[1].tasks, s.held_kv);
      EXPECT_GE(saved, 0) << c.what;
      held_bytes = saved * (tb.kv + tb.bwd_dkv);
    }
    const int64_t a_bytes = s.plans[0].traffic.all_phases_bytes[kStateful];
    const int64_t b_bytes = s.plans[1].traffic.all_phases_bytes[kStateful] - held_bytes;
    const int64_t split_bytes = a_bytes + b_bytes;
    const int64_t whole_bytes = whole.value().traffic.all_phases_bytes[kStateful];
    EXPECT_LE(static_cast<double>(split_bytes), 1.05 * static_cast<double>(whole_bytes)) << c.what;
    // Work on both sides: each nano-batch has between a fifth and four fifths of the attention
    // and of the tokens (small documents move whole).
    double attention[2] = {0, 0};
    int64_t tokens[2] = {0, 0};
    for (int n = 0; n < 2; ++n) {
      for (double x : s.plans[n].server_seconds) attention[n] += x;
      for (const auto& rows : s.nano.rows[n]) tokens[n] += static_cast<int64_t>(rows.size());
    }
    const double share = attention[0] / (attention[0] + attention[1]);
    const double token_share = static_cast<double>(tokens[0]) / static_cast<double>(tokens[0] + tokens[1]);
    const double byte_share = split_bytes > 0 ? static_cast<double>(a_bytes) / static_cast<double>(split_bytes) : 0.5;
    if (byte_share > 0.2 && byte_share < 0.8) ++both_carry;
    // Per server (rank): A's share of its attention (tokens), the range over servers (ranks).
    double lo_att = 1, hi_att = 0, lo_tok = 1, hi_tok = 0;
    for (int r = 0; r < b.num_ranks; ++r) {
      const double a = s.plans[0].server_seconds[r], all = a + s.plans[1].server_seconds[r];
      if (all > 0) lo_att = std::min(lo_att, a / all), hi_att = std::max(hi_att, a / all);
      const double ta = static_cast<double>(s.nano.rows[0][r].size()),
                   tall = ta + static_cast<double>(s.nano.rows[1][r].size());
      if (tall > 0) lo_tok = std::min(lo_tok, ta / tall), hi_tok = std::max(hi_tok, ta / tall);
    }
    std::printf("%s%s: A holds %.2f of the attention (%.2f..%.2f by server), %.2f of the tokens (%.2f..%.2f by rank), "
                "%.2f of the bytes; bytes %.4fx the plan's\n",
                c.what.c_str(), hold_kv ? " (held K/V)" : "", share, lo_att, hi_att, token_share, lo_tok, hi_tok, byte_share,
                static_cast<double>(split_bytes) / static_cast<double>(whole_bytes));
    EXPECT_GT(share, 0.2) << c.what;
    EXPECT_LT(share, 0.8) << c.what;
    EXPECT_GT(token_share, 0.2) << c.what;
    EXPECT_LT(token_share, 0.8) << c.what;
  }
  EXPECT_GT(split_documents, 0);  // the long documents are cut, not only moved whole
  if (hold_kv) {
    EXPECT_GT(cut_tasks, 0);  // held K/V lets the split cut inside a server's share
    // and then both nano-batches carry bytes (a fifth to four fifths) on most batches.
    EXPECT_GE(both_carry, static_cast<int>(cases.size()) - 2) << both_carry << " of " << cases.size();
  }
  }
}

TEST(SplitStep, AMismatchedPlanIsRefused) {
  const plan::Batch b = plan::pack_documents({300, 200}, 2, 256).value();
  plan::Plan p = make_plan(b, "distca").value();
  p.tasks.front().doc = 7;
  auto s = split_step(b, p, plan::CostModel(plan::model_preset("llama-8b").value(), plan::ThroughputProfile{}));
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("document 7"), std::string::npos) << s.status().to_string();
}

}  // namespace
}  // namespace distca::layout
