// The CUDA kernels' tile schedule (src/kernels/cuda/common/schedule.h), plain C++ on the host:
// every query row, key and (query, key) pair a task's mask lets through is in exactly one work
// item, heaviest first.
#include "../../src/kernels/cuda/common/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "test_util.h"

namespace distca::kernels {
namespace {

std::vector<AttnTask> mixed_tasks() {
  // Shards of two documents sharing K/V (one of 1 token), a non-causal key-split piece, a
  // non-causal task with no keys, and an uncovered gap of Q rows (rows 200..209).
  return {{0, 1, 0, 1, true},       {1, 70, 1, 70, true},    {71, 60, 1, 130, true},
          {131, 64, 131, 64, false}, {195, 5, 131, 0, false}, {210, 129, 200, 300, true}};
}

TEST(CudaSchedule, ForwardItemsCoverEveryQueryRowOnceHeaviestFirst) {
  const std::vector<AttnTask> tasks = mixed_tasks();
  const std::vector<cuda::FwdItem> items = cuda::fwd_schedule(tasks, 64);
  std::vector<int> seen(400, 0);
  for (const cuda::FwdItem& it : items) {
    ASSERT_GE(it.rows, 1);
    ASSERT_LE(it.rows, 64);
    for (int r = 0; r < it.rows; ++r) ++seen[static_cast<size_t>(it.q_row + r)];
  }
  for (const AttnTask& t : tasks) {
    for (int64_t r = t.q_offset; r < t.q_offset + t.q_len; ++r) EXPECT_EQ(seen[static_cast<size_t>(r)], 1) << r;
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 1 + 70 + 60 + 64 + 5 + 129);
  for (size_t i = 1; i < items.size(); ++i) {
    EXPECT_GE(cuda::fwd_item_keys(items[i - 1]), cuda::fwd_item_keys(items[i])) << "item " << i;
  }
  // The last tile of the 129-row shard over 300 keys: its row 0 is query 128 (shift 171 + 128).
  const auto last = std::find_if(items.begin(), items.end(), [](const cuda::FwdItem& it) { return it.q_row == 338; });
  ASSERT_NE(last, items.end());
  EXPECT_EQ(last->rows, 1);
  EXPECT_EQ(last->shift, 300 - 129 + 128);
  EXPECT_EQ(cuda::fwd_item_keys(*last), 300);
}

TEST(CudaSchedule, BackwardItemsCoverEveryKeyOfEveryTaskOnceWithTheFirstQueryThatSeesThem) {
  const std::vector<AttnTask> tasks = mixed_tasks();
  const std::vector<cuda::BwdItem> items = cuda::bwd_schedule(tasks, 64);
  int64_t keys = 0;
  for (const cuda::BwdItem& it : items) {
    ASSERT_GE(it.cols, 1);
    ASSERT_LE(it.cols, 64);
    keys += it.cols;
    // q_begin is the first query that sees the tile's first key, and the one before it does not.
    const int shift = it.kv_len - it.q_len;
    if (it.is_causal) {
      EXPECT_LE(it.key0, it.q_begin + shift);
      if (it.q_begin > 0) {
        EXPECT_GT(it.key0, it.q_begin - 1 + shift);
      }
    } else {
      EXPECT_EQ(it.q_begin, 0);
    }
  }
  EXPECT_EQ(keys, 1 + 70 + 130 + 64 + 0 + 300);
  for (size_t i = 1; i < items.size(); ++i) {
    EXPECT_GE(items[i - 1].q_len - items[i - 1].q_begin, items[i].q_len - items[i].q_begin) << "item " << i;
  }
}

// The walk of the K/V-owning backward (hopper_bwd.cuh) over a schedule: for every item, every
// entry, every query from q_begin, every tile row the entry reads. Each (task, query, key) pair the
// task's mask lets through must be visited exactly once, and no pair the mask stops; the tiles must
// be disjoint and hold every K/V row a task with queries reads.
void check_kv_tile_schedule(const std::vector<AttnTask>& tasks, int block_n) {
  const cuda::KvTileSchedule s = cuda::kv_tile_schedule(tasks, block_n);
  std::map<int64_t, const AttnTask*> by_q_row;  // the tests' tasks have distinct first Q rows
  std::map<int64_t, int> tile_of_row;
  for (const AttnTask& t : tasks) {
    if (t.q_len > 0 && t.kv_len > 0) by_q_row[t.q_offset] = &t;
  }
  std::map<std::tuple<int64_t, int64_t, int64_t>, int> visits;  // (task's Q row, query, key)
  for (size_t n = 0; n < s.items.size(); ++n) {
    const cuda::KvTileItem& it = s.items[n];
    ASSERT_GE(it.rows, 1);
    ASSERT_LE(it.rows, block_n);
    for (int r = 0; r < it.rows; ++r) {
      ASSERT_TRUE(tile_of_row.emplace(it.kv_row + r, static_cast<int>(n)).second) << "K/V row " << it.kv_row + r << " in two tiles";
    }
    int64_t queries = 0;
    for (int x = it.first_entry; x < it.first_entry + it.num_entries; ++x) {
      const cuda::KvTileEntry& e = s.entries[static_cast<size_t>(x)];
      const auto found = by_q_row.find(e.q_row);
      ASSERT_NE(found, by_q_row.end()) << "an entry of no task";
      const AttnTask& t = *found->second;
      ASSERT_EQ(t.kv_offset, it.kv_row - e.key0);
      ASSERT_LE(0, e.col_begin);
      ASSERT_LT(e.col_begin, e.col_end);
      ASSERT_LE(e.col_end, it.rows);
      const int64_t shift = t.kv_len - t.q_len;
      bool begin_sees = false, before_sees = false;
      for (int c = e.col_begin; c < e.col_end; ++c) {
        const int64_t key = e.key0 + c;
        ASSERT_TRUE(key >= 0 && key < t.kv_len) << "a tile row outside the task's keys";
        begin_sees = begin_sees || !t.is_causal || key <= e.q_begin + shift;
        before_sees = before_sees || (e.q_begin > 0 && (!t.is_causal || key <= e.q_begin - 1 + shift));
        for (int64_t i = e.q_begin; i < t.q_len; ++i) {
          if (!t.is_causal || key <= i + shift) ++visits[{t.q_offset, i, key}];
        }
      }
      EXPECT_TRUE(begin_sees) << "q_begin sees no key of the entry";
      EXPECT_FALSE(before_sees) << "a query before q_begin sees a key of the entry";
      queries += t.q_len - e.q_begin;
    }
    EXPECT_EQ(it.queries, queries);
    if (n > 0) {
      EXPECT_GE(s.items[n - 1].queries, it.queries) << "not heaviest first at item " << n;
    }
  }
  int64_t pairs = 0;
  for (const AttnTask& t : tasks) {
    if (t.q_len == 0 || t.kv_len == 0) continue;
    for (int64_t j = 0; j < t.kv_len; ++j) ASSERT_TRUE(tile_of_row.count(t.kv_offset + j)) << "K/V row in no tile";
    for (int64_t i = 0; i < t.q_len; ++i) {
      const int64_t last = t.is_causal ? std::min(i + t.kv_len - t.q_len, t.kv_len - 1) : t.kv_len - 1;
      for (int64_t j = 0; j <= last; ++j) {
        ASSERT_EQ((visits[{t.q_offset, i, j}]), 1) << "task at Q row " << t.q_offset << ", query " << i << ", key " << j;
        ++pairs;
      }
    }
  }
  EXPECT_EQ(static_cast<int64_t>(visits.size()), pairs) << "visits of pairs no task has";
}

TEST(CudaSchedule, KvTilesVisitEveryQueryKeyPairOnceAndNeverOverlap) {
  check_kv_tile_schedule(mixed_tasks(), 64);
  // The mixed tasks' K/V runs: the 1-token document, the 130 rows the two shards share (3 tiles,
  // the first two read by both shards), the key-split piece's 64 rows, the 300-row document.
  const cuda::KvTileSchedule s = cuda::kv_tile_schedule(mixed_tasks(), 64);
  EXPECT_EQ(s.items.size(), 1u + 3u + 1u + 5u);
  const auto shared = std::find_if(s.items.begin(), s.items.end(), [](const cuda::KvTileItem& it) { return it.kv_row == 1; });
  ASSERT_NE(shared, s.items.end());
  EXPECT_EQ(shared->num_entries, 2);
  std::mt19937_64 rng(29);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int64_t> docs;
    for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) docs.push_back(1 + static_cast<int64_t>(rng() % 200));
    testing::TaskSet set = testing::shard_documents(rng, docs, 1 + static_cast<int64_t>(rng() % 80), 2, 1, 64, trial % 3);
    // Key-split pieces: new query rows against a sub-range of keys anywhere in the K/V rows, causal
    // or not, and a task without queries.
    for (int i = 0; i < 3; ++i) {
      const int64_t begin = static_cast<int64_t>(rng() % static_cast<uint64_t>(set.dims.num_kv_rows));
      const int64_t len = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(set.dims.num_kv_rows - begin));
      const int64_t q = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(std::min<int64_t>(len, 50)));
      set.tasks.push_back({set.dims.num_q_rows, q, begin, len, i != 1});
      set.dims.num_q_rows += q;
    }
    set.tasks.push_back({set.dims.num_q_rows, 0, 0, set.dims.num_kv_rows, true});
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_kv_tile_schedule(set.tasks, trial % 2 ? 64 : 16);
  }
}

TEST(CudaSchedule, UncoveredRowsAreTheGapsBetweenTasks) {
  const std::vector<AttnTask> tasks = mixed_tasks();
  const auto gaps = cuda::uncovered_rows(345, tasks);
  ASSERT_EQ(gaps.size(), 2u);
  EXPECT_EQ(gaps[0], (std::pair<int64_t, int64_t>{200, 210}));
  EXPECT_EQ(gaps[1], (std::pair<int64_t, int64_t>{339, 345}));
  EXPECT_TRUE(cuda::uncovered_rows(0, {}).empty());
}

}  // namespace
}  // namespace distca::kernels
