// Routes (route.h): every owner's segments for a server are what that server expects from it,
// every server buffer row is filled exactly once (from an owner, or held from an earlier
// dispatch), K/V rows once per (document, server), and only a verified task list gets a route.
#include "distca/layout/route.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>
#include <tuple>
#include <vector>

#include "distca/plan/verify.h"
#include "layout/plans.h"

namespace distca::layout {
namespace {

using layout::testing::make_plan;

// Segments as comparable values.
std::vector<std::tuple<int64_t, int64_t, int64_t>> rows(const std::vector<Segment>& segments) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (const Segment& s : segments) out.emplace_back(s.local_row, s.server_row, s.rows);
  return out;
}

// Rows [0, n) of a server buffer, each counted once per segment that fills it.
std::vector<int> fill_count(int64_t n, const std::vector<std::vector<Segment>>& from_owner) {
  std::vector<int> count(static_cast<size_t>(n), 0);
  for (const auto& segments : from_owner) {
    for (const Segment& s : segments) {
      for (int64_t i = 0; i < s.rows; ++i) ++count.at(static_cast<size_t>(s.server_row + i));
    }
  }
  return count;
}

// The routes of every rank of one task list agree, and fill every server row once.
void expect_routes_agree(const plan::Batch& batch, const std::vector<plan::Task>& tasks, const std::string& what,
                       const std::vector<KvInterval>& held = {}) {
  std::vector<Route> routes;
  for (int32_t r = 0; r < batch.num_ranks; ++r) {
    auto route = build_partial_route(batch, tasks, r, held);
    ASSERT_TRUE(route.is_ok()) << what << ": " << route.status().to_string();
    routes.push_back(route.value());
  }
  for (int32_t o = 0; o < batch.num_ranks; ++o) {
    for (int32_t s = 0; s < batch.num_ranks; ++s) {
      EXPECT_EQ(rows(routes[o].to_server_q[s]), rows(routes[s].from_owner_q[o])) << what << ": Q " << o << " -> " << s;
      EXPECT_EQ(rows(routes[o].to_server_split_q[s]), rows(routes[s].from_owner_split_q[o])) << what << ": split Q " << o << " -> " << s;
      EXPECT_EQ(rows(routes[o].to_server_kv[s]), rows(routes[s].from_owner_kv[o])) << what << ": K/V " << o << " -> " << s;
    }
  }
  for (const Route& route : routes) {
    std::vector<std::vector<Segment>> q = route.from_owner_q;
    q.insert(q.end(), route.from_owner_split_q.begin(), route.from_owner_split_q.end());
    for (int c : fill_count(route.num_server_q_rows, q)) EXPECT_EQ(c, 1) << what << ": server " << route.rank << "'s Q";
    std::vector<std::vector<Segment>> kv = route.from_owner_kv;
    kv.push_back(route.held_kv);
    for (int c : fill_count(route.num_server_kv_rows, kv)) EXPECT_EQ(c, 1) << what << ": server " << route.rank << "'s K/V";
    // Its tasks address its buffers; their Q ranges tile the Q buffer in plan order.
    int64_t next_q = 0;
    for (const kernels::AttnTask& t : route.tasks) {
      EXPECT_EQ(t.q_offset, next_q) << what;
      next_q += t.q_len;
      EXPECT_LE(t.kv_offset + t.kv_len, route.num_server_kv_rows) << what;
    }
    EXPECT_EQ(next_q, route.num_server_q_rows) << what;
  }
}

TEST(Route, EveryOwnerSendsWhatItsServerExpectsAndEveryRowArrivesOnce) {
  for (const auto& [what, batch] : testing::mixed_and_sampled("prolong", {2, 4, 8}, 8192)) {
    for (const char* policy : {"none", "distca", "minmax", "minbytes", "minlink"}) {
      const plan::Plan p = make_plan(batch, policy).value();
      expect_routes_agree(batch, p.tasks, fmt::format("{}, {}", what, policy));
      for (int32_t r = 0; r < batch.num_ranks; ++r) EXPECT_TRUE(build_route(batch, p.tasks, r).is_ok()) << what;
    }
  }
}

// A key-range split: rank 0's document's last queries see keys [0, 256) on rank 1 (non-causal)
// and [256, 512) on rank 0 (causal); their rows are split rows, merged at their owner.
TEST(Route, KeySplitRowsTravelAsSplitQ) {
  const plan::Batch b = plan::batch_from_ranks({{512}, {64}}, 0).value();
  const std::vector<plan::Task> tasks = {
      {0, 0, 256, 0, 256, 0}, {0, 256, 512, 256, 512, 0}, {0, 256, 512, 0, 256, 1}, {1, 0, 64, 0, 64, 1}};
  ASSERT_TRUE(plan::verify_tasks(b, tasks).is_ok());
  expect_routes_agree(b, tasks, "key split");
  const Route r0 = build_route(b, tasks, 0).value();
  EXPECT_TRUE(r0.owns_split_rows());
  EXPECT_EQ(rows(r0.to_server_split_q[1]), rows({Segment{256, 0, 256}}));
  EXPECT_EQ(rows(r0.to_server_kv[1]), rows({Segment{0, 0, 256}}));
  EXPECT_FALSE(build_route(b, tasks, 1).value().owns_split_rows());
}

TEST(Route, KvLayoutIsOnePerDocumentAndServerRangeUnion) {
  const std::vector<plan::Task> tasks = {
      {0, 0, 100, 0, 100, 1}, {0, 100, 200, 50, 200, 1}, {0, 300, 400, 200, 400, 1},  // [0, 400): touching ranges join
      {0, 500, 600, 500, 600, 1},                                                   // a gap: its own interval
      {1, 0, 10, 0, 10, 1}, {0, 0, 50, 0, 50, 0}};
  const std::vector<KvInterval> want = {{0, 0, 0, 50, 0}, {1, 0, 0, 400, 0}, {1, 0, 500, 600, 400}, {1, 1, 0, 10, 500}};
  EXPECT_EQ(kv_layout(tasks), want);
}

TEST(Route, OnlyAVerifiedTaskListGetsAWholeRoute) {
  const plan::Batch b = plan::batch_from_ranks({{300}, {200}}, 0).value();
  const plan::Plan p = make_plan(b, "minlink").value();
  std::vector<plan::Task> part(p.tasks.begin(), p.tasks.end() - 1);  // a pair left out
  EXPECT_FALSE(build_route(b, part, 0).is_ok());
  EXPECT_TRUE(build_partial_route(b, part, 0).is_ok());
  EXPECT_FALSE(build_partial_route(b, p.tasks, 2).is_ok());  // no rank 2
  std::vector<plan::Task> bad = p.tasks;
  bad.front().q1 = 10'000;  // past the document's end
  EXPECT_FALSE(build_partial_route(b, bad, 0).is_ok());
}

// K/V a server holds from an earlier dispatch is not sent again: held whole, nothing travels.
TEST(Route, HeldKvRowsAreNotSentAgain) {
  const plan::Batch b = plan::pack_documents({600, 70, 120, 30, 250, 90, 54}, 2, 608).value();
  const plan::Plan p = make_plan(b, "minlink").value();
  const std::vector<KvInterval> all = kv_layout(p.tasks);
  expect_routes_agree(b, p.tasks, "all held", all);
  int64_t held = 0, server_rows = 0;
  for (int32_t r = 0; r < b.num_ranks; ++r) {
    const Route route = build_partial_route(b, p.tasks, r, all).value();
    for (const auto& segments : route.from_owner_kv) EXPECT_TRUE(segments.empty());
    for (const Segment& s : route.held_kv) held += s.rows;
    server_rows += route.num_server_kv_rows;
  }
  EXPECT_EQ(held, server_rows);
}

}  // namespace
}  // namespace distca::layout
