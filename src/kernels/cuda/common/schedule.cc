#include "schedule.h"

#include <algorithm>
#include <cstdint>
#include <numeric>

namespace distca::kernels::cuda {
namespace {

// Items sorted by descending cost, ties in their original order.
template <typename Item>
std::vector<Item> heaviest_first(std::vector<Item> items, const std::vector<int64_t>& cost) {
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<Item> sorted;
  sorted.reserve(items.size());
  for (size_t i : order) sorted.push_back(items[i]);
  return sorted;
}

}  // namespace

std::vector<FwdItem> fwd_schedule(std::span<const AttnTask> tasks, int block_m) {
  std::vector<FwdItem> items;
  std::vector<int64_t> cost;
  for (const AttnTask& t : tasks) {
    for (int64_t m0 = 0; m0 < t.q_len; m0 += block_m) {
      FwdItem it;
      it.q_row = t.q_offset + m0;
      it.kv_row = t.kv_offset;
      it.rows = static_cast<int32_t>(std::min<int64_t>(block_m, t.q_len - m0));
      it.kv_len = static_cast<int32_t>(t.kv_len);
      it.is_causal = t.is_causal ? 1 : 0;
      it.shift = static_cast<int32_t>(t.is_causal ? t.kv_len - t.q_len + m0 : t.kv_len);
      items.push_back(it);
      cost.push_back(fwd_item_keys(it));
    }
  }
  return heaviest_first(std::move(items), cost);
}

std::vector<BwdItem> bwd_schedule(std::span<const AttnTask> tasks, int block_n) {
  std::vector<BwdItem> items;
  std::vector<int64_t> cost;
  for (const AttnTask& t : tasks) {
    if (t.q_len == 0) continue;  // keys no query reads: dK = dV = 0 from the zeroed sums
    const int64_t shift = t.kv_len - t.q_len;  // causal: query i sees keys j <= i + shift
    for (int64_t n0 = 0; n0 < t.kv_len; n0 += block_n) {
      BwdItem it;
      it.q_row = t.q_offset;
      it.kv_row = t.kv_offset + n0;
      it.q_len = static_cast<int32_t>(t.q_len);
      it.key0 = static_cast<int32_t>(n0);
      it.cols = static_cast<int32_t>(std::min<int64_t>(block_n, t.kv_len - n0));
      it.kv_len = static_cast<int32_t>(t.kv_len);
      it.is_causal = t.is_causal ? 1 : 0;
      it.q_begin = static_cast<int32_t>(t.is_causal ? std::max<int64_t>(0, n0 - shift) : 0);
      items.push_back(it);
      cost.push_back(t.q_len - it.q_begin);
    }
  }
  return heaviest_first(std::move(items), cost);
}

KvTileSchedule kv_tile_schedule(std::span<const AttnTask> tasks, int block_n) {
  // The runs: maximal unions of overlapping K/V ranges of the tasks that have queries and keys.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const AttnTask& t : tasks) {
    if (t.q_len > 0 && t.kv_len > 0) ranges.emplace_back(t.kv_offset, t.kv_offset + t.kv_len);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& [begin, end] : ranges) {
    if (!runs.empty() && begin < runs.back().second) {
      runs.back().second = std::max(runs.back().second, end);
    } else {
      runs.emplace_back(begin, end);
    }
  }
  // The tiles, run after run, and each task's entries in the tiles its keys fall in.
  std::vector<int64_t> first_tile(runs.size());
  int64_t num_tiles = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    first_tile[r] = num_tiles;
    num_tiles += (runs[r].second - runs[r].first + block_n - 1) / block_n;
  }
  std::vector<std::vector<KvTileEntry>> per_tile(static_cast<size_t>(num_tiles));
  for (const AttnTask& t : tasks) {
    if (t.q_len == 0 || t.kv_len == 0) continue;  // no queries: dK = dV = 0 from the zeroed sums
    const auto run = std::upper_bound(runs.begin(), runs.end(), std::pair<int64_t, int64_t>{t.kv_offset, INT64_MAX}) - 1;
    const int64_t run_begin = run->first, shift = t.kv_len - t.q_len;  // causal: query i sees keys j <= i + shift
    const int64_t tile0 = first_tile[static_cast<size_t>(run - runs.begin())];
    for (int64_t n = (t.kv_offset - run_begin) / block_n; n * block_n + run_begin < t.kv_offset + t.kv_len; ++n) {
      const int64_t row0 = run_begin + n * block_n;
      KvTileEntry e;
      e.q_row = t.q_offset;
      e.q_len = static_cast<int32_t>(t.q_len);
      e.key0 = static_cast<int32_t>(row0 - t.kv_offset);
      e.col_begin = static_cast<int32_t>(std::max<int64_t>(t.kv_offset - row0, 0));
      e.col_end = static_cast<int32_t>(std::min<int64_t>(t.kv_offset + t.kv_len - row0, block_n));
      e.kv_len = static_cast<int32_t>(t.kv_len);
      e.is_causal = t.is_causal ? 1 : 0;
      e.q_begin = static_cast<int32_t>(t.is_causal ? std::max<int64_t>(0, e.key0 + e.col_begin - shift) : 0);
      per_tile[static_cast<size_t>(tile0 + n)].push_back(e);
    }
  }
  KvTileSchedule s;
  std::vector<int64_t> cost;
  for (size_t r = 0; r < runs.size(); ++r) {
    for (int64_t row0 = runs[r].first; row0 < runs[r].second; row0 += block_n) {
      const auto& entries = per_tile[static_cast<size_t>(first_tile[r] + (row0 - runs[r].first) / block_n)];
      KvTileItem it;
      it.kv_row = row0;
      it.rows = static_cast<int32_t>(std::min<int64_t>(block_n, runs[r].second - row0));
      it.first_entry = static_cast<int32_t>(s.entries.size());
      it.num_entries = static_cast<int32_t>(entries.size());
      int64_t queries = 0;
      for (const KvTileEntry& e : entries) queries += e.q_len - e.q_begin;
      it.queries = static_cast<int32_t>(queries);
      s.entries.insert(s.entries.end(), entries.begin(), entries.end());
      s.items.push_back(it);
      cost.push_back(queries);
    }
  }
  s.items = heaviest_first(std::move(s.items), cost);
  return s;
}

std::vector<std::pair<int64_t, int64_t>> uncovered_rows(int64_t num_q_rows, std::span<const AttnTask> tasks) {
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (const AttnTask& t : tasks) {
    if (t.q_len > 0) covered.emplace_back(t.q_offset, t.q_offset + t.q_len);
  }
  std::sort(covered.begin(), covered.end());
  std::vector<std::pair<int64_t, int64_t>> gaps;
  int64_t next = 0;
  for (const auto& [begin, end] : covered) {
    if (begin > next) gaps.emplace_back(next, begin);
    next = std::max(next, end);
  }
  if (next < num_q_rows) gaps.emplace_back(next, num_q_rows);
  return gaps;
}

}  // namespace distca::kernels::cuda
