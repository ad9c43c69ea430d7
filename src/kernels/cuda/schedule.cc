#include "schedule.h"

#include <algorithm>
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
