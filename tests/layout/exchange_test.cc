// Exchange layouts (exchange.h): what each rank sends a server is what that server receives from
// it, every sent Q entry is copied or merged back exactly once, and the server's varlen layout
// reads every received Q row once, causal tasks first, with cu_seqlens matching the tasks.
#include "distca/layout/exchange.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "layout/plans.h"

namespace distca::layout {
namespace {

using layout::testing::make_plan;

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

void expect_layouts_agree(const plan::Batch& batch, const std::vector<plan::Task>& tasks, const std::string& what) {
  std::vector<Route> routes;
  std::vector<ExchangeLayout> xs;
  for (int32_t r = 0; r < batch.num_ranks; ++r) {
    routes.push_back(build_route(batch, tasks, r).value());
    xs.push_back(exchange_layout(routes.back()));
  }
  for (int32_t r = 0; r < batch.num_ranks; ++r) {
    const ExchangeLayout& x = xs[r];
    const Route& route = routes[r];
    EXPECT_EQ(x.num_local_rows, route.num_local_rows) << what;
    // Owner side.
    EXPECT_EQ(sum(x.q_send_splits), static_cast<int64_t>(x.q_send_index.size())) << what;
    EXPECT_EQ(sum(x.kv_send_splits), static_cast<int64_t>(x.kv_send_index.size())) << what;
    for (int64_t row : x.q_send_index) EXPECT_TRUE(row >= 0 && row < x.num_local_rows) << what;
    for (int64_t row : x.kv_send_index) EXPECT_TRUE(row >= 0 && row < x.num_local_rows) << what;
    std::vector<int64_t> entries = x.copy_entries;
    entries.insert(entries.end(), x.merge_entries.begin(), x.merge_entries.end());
    std::sort(entries.begin(), entries.end());
    std::vector<int64_t> every(x.q_send_index.size());
    std::iota(every.begin(), every.end(), int64_t{0});
    EXPECT_EQ(entries, every) << what << ": each Q entry copied or merged once";
    for (size_t i = 0; i < x.copy_entries.size(); ++i) EXPECT_EQ(x.copy_rows[i], x.q_send_index[x.copy_entries[i]]) << what;
    for (size_t i = 0; i < x.merge_entries.size(); ++i) EXPECT_EQ(x.merge_rows[i], x.q_send_index[x.merge_entries[i]]) << what;
    // Server side: the splits match the owners', and the varlen layout reads every Q row once.
    for (int32_t o = 0; o < batch.num_ranks; ++o) {
      EXPECT_EQ(x.q_recv_splits[o], xs[o].q_send_splits[r]) << what << ": Q " << o << " -> " << r;
      EXPECT_EQ(x.kv_recv_splits[o], xs[o].kv_send_splits[r]) << what << ": K/V " << o << " -> " << r;
    }
    std::vector<int64_t> q = x.q_gather;
    std::sort(q.begin(), q.end());
    std::vector<int64_t> all_q(static_cast<size_t>(sum(x.q_recv_splits)));
    std::iota(all_q.begin(), all_q.end(), int64_t{0});
    EXPECT_EQ(q, all_q) << what << ": server " << r << " reads each received Q row once";
    for (int64_t pos : x.kv_gather) EXPECT_TRUE(pos >= 0 && pos < sum(x.kv_recv_splits)) << what;
    // Causal tasks first, each group's cu_seqlens the tasks' lengths in plan order.
    std::vector<int64_t> want_q{0}, want_k{0};
    for (const bool causal : {true, false}) {
      want_q = {0}, want_k = {0};
      int64_t max_q = 0, max_k = 0;
      for (const kernels::AttnTask& t : route.tasks) {
        if (t.is_causal != causal) continue;
        want_q.push_back(want_q.back() + t.q_len);
        want_k.push_back(want_k.back() + t.kv_len);
        max_q = std::max(max_q, t.q_len), max_k = std::max(max_k, t.kv_len);
      }
      const VarlenGroup& g = causal ? x.causal : x.noncausal;
      EXPECT_EQ(g.cu_seqlens_q, want_q) << what;
      EXPECT_EQ(g.cu_seqlens_k, want_k) << what;
      EXPECT_EQ(g.max_seqlen_q, max_q) << what;
      EXPECT_EQ(g.max_seqlen_k, max_k) << what;
      if (causal) {
        EXPECT_EQ(x.causal_q_rows, want_q.back()) << what;
        EXPECT_EQ(x.causal_kv_rows, want_k.back()) << what;
      }
    }
    EXPECT_EQ(x.causal_q_rows + x.noncausal.cu_seqlens_q.back(), static_cast<int64_t>(x.q_gather.size())) << what;
    EXPECT_EQ(x.causal_kv_rows + x.noncausal.cu_seqlens_k.back(), static_cast<int64_t>(x.kv_gather.size())) << what;
  }
}

TEST(ExchangeLayout, EveryRankSendsWhatItsServersReceiveAndEveryRowComesBackOnce) {
  for (const auto& [what, batch] : testing::mixed_and_sampled("pretrain", {2, 4}, 8192)) {
    for (const char* policy : {"none", "distca", "minmax", "minbytes", "minlink"}) {
      expect_layouts_agree(batch, make_plan(batch, policy).value().tasks, fmt::format("{}, {}", what, policy));
    }
  }
}

// A key-range split: rank 0's last queries are served by both ranks, so their entries are merged
// (not copied), and the non-causal task comes after the causal ones in the server's varlen layout.
TEST(ExchangeLayout, KeySplitRowsAreMergedAndNonCausalTasksComeLast) {
  const plan::Batch b = plan::batch_from_ranks({{512}, {64}}, 0).value();
  const std::vector<plan::Task> tasks = {
      {0, 0, 256, 0, 256, 0}, {0, 256, 512, 256, 512, 0}, {0, 256, 512, 0, 256, 1}, {1, 0, 64, 0, 64, 1}};
  expect_layouts_agree(b, tasks, "key split");
  const ExchangeLayout x0 = exchange_layout(build_route(b, tasks, 0).value());
  EXPECT_EQ(x0.merge_entries.size(), 512u);  // rows [256, 512), sent to each server once
  EXPECT_EQ(x0.copy_entries.size(), 256u);
  const ExchangeLayout x1 = exchange_layout(build_route(b, tasks, 1).value());
  EXPECT_EQ(x1.causal.cu_seqlens_q, (std::vector<int64_t>{0, 64}));
  EXPECT_EQ(x1.noncausal.cu_seqlens_q, (std::vector<int64_t>{0, 256}));
  EXPECT_EQ(x1.noncausal.cu_seqlens_k, (std::vector<int64_t>{0, 256}));
}

}  // namespace
}  // namespace distca::layout
