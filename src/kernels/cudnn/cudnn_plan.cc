// CudnnAttention's calls from a task list (cudnn_plan.h): plain C++, tested in every build.
#include "cudnn_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>
#include <tuple>

namespace distca::kernels::cudnn {
namespace {

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// The parts of [0, n) that no range covers.
Ranges complement(Ranges ranges, int64_t n) {
  std::sort(ranges.begin(), ranges.end());
  Ranges gaps;
  int64_t at = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin > at) gaps.emplace_back(at, begin);
    at = std::max(at, end);
  }
  if (at < n) gaps.emplace_back(at, n);
  return gaps;
}

bool has_work(const AttnTask& t) { return t.q_len > 0 && t.kv_len > 0; }

}  // namespace

size_t GraphKeyHash::operator()(const GraphKey& k) const {
  size_t h = 0;
  auto mix = [&h](int64_t v) { h ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  mix(k.backward | (k.causal << 1) | (k.bf16 << 2));
  for (int64_t v : {k.batch, k.s_q, k.s_kv, k.total_q, k.total_kv, k.h_q, k.h_kv, k.d}) mix(v);
  mix(std::bit_cast<int32_t>(k.scale));
  mix(k.top_left | (k.max_total << 1) | (k.dense << 2) | (k.head_major_lse << 3));
  return h;
}

Result<GraphVariants> parse_graph_variants(std::string_view names) {
  GraphVariants v;
  while (!names.empty()) {
    const size_t comma = names.find(',');
    const std::string_view name = names.substr(0, comma);
    if (name == "exact-batch") {
      v.exact_batch = true;
    } else if (name == "top-left") {
      v.top_left = true;
    } else if (name == "no-max-total") {
      v.max_total = false;
    } else if (name == "dense") {
      v.dense = true;
    } else if (name == "head-major-lse") {
      v.head_major_lse = true;
    } else if (!name.empty()) {
      return invalid_argument(fmt::format("DISTCA_CUDNN_GRAPH: no graph variant '{}' (known: exact-batch, top-left, "
                                          "no-max-total, dense, head-major-lse)", name));
    }
    names = comma == std::string_view::npos ? std::string_view{} : names.substr(comma + 1);
  }
  if (v.head_major_lse && !v.dense) {
    return invalid_argument("DISTCA_CUDNN_GRAPH: head-major-lse applies to dense graphs only: add dense");
  }
  return v;
}

int64_t bucket(int64_t n, int64_t floor) {
  int64_t b = std::max<int64_t>(floor, 1);
  while (b < n) b *= 2;
  return b;
}

bool kv_ranges_overlap(std::span<const AttnTask> tasks) {
  Ranges ranges;
  for (const AttnTask& t : tasks) {
    if (has_work(t)) ranges.emplace_back(t.kv_offset, t.kv_offset + t.kv_len);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return true;
  }
  return false;
}

std::vector<std::pair<AttnTask, std::vector<int>>> merge_tasks(std::span<const AttnTask> tasks) {
  std::vector<int> order;
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (has_work(tasks[i])) order.push_back(static_cast<int>(i));
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const AttnTask &x = tasks[a], &y = tasks[b];
    return std::tuple(x.is_causal, x.kv_offset, x.q_offset) < std::tuple(y.is_causal, y.kv_offset, y.q_offset);
  });
  std::vector<std::pair<AttnTask, std::vector<int>>> merged;
  for (int i : order) {
    const AttnTask& t = tasks[i];
    if (!merged.empty()) {
      AttnTask& m = merged.back().first;
      // Bottom-right causal: row r of a sequence with q queries over L keys sees keys up to L - q + r,
      // so appending t's rows keeps every row's keys exactly when t's keys end t.q_len rows later.
      const bool follows = m.is_causal == t.is_causal && m.kv_offset == t.kv_offset &&
                           m.q_offset + m.q_len == t.q_offset &&
                           (t.is_causal ? t.kv_len == m.kv_len + t.q_len : t.kv_len == m.kv_len);
      if (follows) {
        m.q_len += t.q_len;
        m.kv_len = t.kv_len;
        merged.back().second.push_back(i);
        continue;
      }
    }
    merged.push_back({t, {i}});
  }
  return merged;
}

Result<Plan> plan_calls(const AttnDims& dims, std::span<const AttnTask> tasks, const PlanOptions& options) {
  Plan plan;
  const int64_t q_row = dims.num_q_heads * dims.head_dim, kv_row = dims.num_kv_heads * dims.head_dim;
  const std::vector<std::pair<AttnTask, std::vector<int>>> merged = merge_tasks(tasks);
  Ranges q_ranges, kv_ranges;
  std::vector<AttnTask> sequences;
  for (const auto& [t, covered] : merged) {
    q_ranges.emplace_back(t.q_offset, t.q_offset + t.q_len);
    kv_ranges.emplace_back(t.kv_offset, t.kv_offset + t.kv_len);
    sequences.push_back(t);
  }
  plan.empty_q_rows = complement(q_ranges, dims.num_q_rows);
  plan.kv_scratch = options.backward && (options.dkv_fp32 || kv_ranges_overlap(sequences));
  if (options.backward && !plan.kv_scratch) plan.empty_kv_rows = complement(kv_ranges, dims.num_kv_rows);

  // cuDNN's ragged offsets are int32 elements: every row end must fit, bucketed as the graph is.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (dims.num_q_rows * q_row > kMax || dims.num_kv_rows * kv_row > kMax ||
      (options.backward && bucket(dims.num_q_rows, 64) * q_row > kMax)) {
    return invalid_argument(fmt::format(
        "cuDNN's ragged offsets are int32: {} query rows x {} and {} key rows x {} elements exceed 2^31-1; "
        "split the task list", dims.num_q_rows, q_row, dims.num_kv_rows, kv_row));
  }

  std::pair<int64_t, int64_t> longest[2] = {};  // [causal]: the longest query and key lengths
  for (const auto& [t, covered] : merged) {
    longest[t.is_causal].first = std::max(longest[t.is_causal].first, t.q_len);
    longest[t.is_causal].second = std::max(longest[t.is_causal].second, t.kv_len);
  }
  auto finish = [&](Call& call) {
    GraphKey& key = call.key;
    key.backward = options.backward;
    key.bf16 = options.bf16;
    key.h_q = dims.num_q_heads;
    key.h_kv = dims.num_kv_heads;
    key.d = dims.head_dim;
    key.scale = options.scale;
    const auto n = static_cast<int64_t>(call.slots.size());
    key.batch = options.variants.exact_batch ? n : bucket(n);
    key.top_left = options.variants.top_left && key.causal &&
                   std::all_of(call.slots.begin(), call.slots.end(), [](const AttnTask& t) { return t.q_len == t.kv_len; });
    key.max_total = !options.backward || options.variants.max_total;
    int64_t max_q = 0, max_kv = 0, q_end = 0, kv_end = 0, dkv_end = 0, scratch_rows = 0;
    for (const AttnTask& t : call.slots) {
      max_q = std::max(max_q, t.q_len);
      max_kv = std::max(max_kv, t.kv_len);
      call.seq_q.push_back(static_cast<int32_t>(t.q_len));
      call.seq_kv.push_back(static_cast<int32_t>(t.kv_len));
      call.q_off.push_back(static_cast<int32_t>(t.q_offset * q_row));
      call.stats_off.push_back(static_cast<int32_t>(t.q_offset * dims.num_q_heads));
      call.kv_off.push_back(static_cast<int32_t>(t.kv_offset * kv_row));
      q_end = std::max(q_end, t.q_offset + t.q_len);
      kv_end = std::max(kv_end, t.kv_offset + t.kv_len);
      if (options.backward) {
        int64_t dkv_row = t.kv_offset;
        if (plan.kv_scratch) {
          dkv_row = scratch_rows;
          call.add_spans.push_back({scratch_rows, t.kv_offset, t.kv_len});
          scratch_rows += t.kv_len;
        }
        call.dkv_off.push_back(static_cast<int32_t>(dkv_row * kv_row));
        dkv_end = std::max(dkv_end, dkv_row + t.kv_len);
      }
    }
    plan.kv_scratch_rows = std::max(plan.kv_scratch_rows, scratch_rows);
    // The longest lengths of the pass's sequences of this mask kind (every call of the kind shares
    // them, so the backward's calls of a pass share graphs).
    key.s_q = bucket(std::max(max_q, longest[key.causal].first), 64);
    key.s_kv = bucket(std::max(max_kv, longest[key.causal].second), 64);
    if (options.backward) {
      // The pass's bounds, not the call's: the calls of a pass share graphs.
      key.total_q = bucket(dims.num_q_rows, 64);
      key.total_kv = bucket(plan.kv_scratch ? dims.num_kv_rows : std::max(dkv_end, dims.num_kv_rows), 64);
      if (key.total_kv * kv_row > kMax) {
        return invalid_argument(fmt::format(
            "cuDNN's ragged offsets are int32: a sequence's dK/dV of {} rows x {} elements (bucketed) exceeds "
            "2^31-1; split the task list", key.total_kv, kv_row));
      }
    }
    if (options.variants.dense && call.slots.size() == 1) {  // the exact lengths; no workspace bound
      key.dense = true;
      key.batch = 1;
      key.s_q = call.slots[0].q_len;
      key.s_kv = call.slots[0].kv_len;
      key.total_q = key.total_kv = 0;
      key.max_total = false;
      key.head_major_lse = options.variants.head_major_lse;
    }
    // Empty slots: length 0, offsets at the end of what the real slots address (non-decreasing).
    call.seq_q.resize(key.batch, 0);
    call.seq_kv.resize(key.batch, 0);
    call.q_off.resize(key.batch + 1, static_cast<int32_t>(q_end * q_row));
    call.stats_off.resize(key.batch + 1, static_cast<int32_t>(q_end * dims.num_q_heads));
    call.kv_off.resize(key.batch + 1, static_cast<int32_t>(kv_end * kv_row));
    if (options.backward) call.dkv_off.resize(key.batch + 1, static_cast<int32_t>(dkv_end * kv_row));
    plan.calls.push_back(std::move(call));
    return Status::ok();
  };

  for (const bool causal : {true, false}) {
    std::vector<size_t> picked;
    for (size_t i = 0; i < merged.size(); ++i) {
      if (merged[i].first.is_causal == causal) picked.push_back(i);
    }
    // The backward's groups: sequences with pairwise disjoint K/V rows (the fewest such groups:
    // each sequence joins the group that ended earliest, if it ended before the sequence starts).
    // cuDNN's backward is only ever given a batch whose sequences do not share K/V rows: on an H100
    // (cuDNN 9.19) 128 overlapping shards of a 16K document in one call gave dK 13 % off, in
    // calls whose scratch stayed under 2^30 elements too. The forward reads shared rows correctly.
    std::vector<std::vector<size_t>> groups;
    if (options.backward && plan.kv_scratch) {
      std::sort(picked.begin(), picked.end(), [&](size_t a, size_t b) {
        return merged[a].first.kv_offset < merged[b].first.kv_offset;
      });
      using End = std::pair<int64_t, size_t>;  // (last K/V row end, group)
      std::priority_queue<End, std::vector<End>, std::greater<>> ends;
      for (size_t i : picked) {
        const AttnTask& t = merged[i].first;
        if (!ends.empty() && ends.top().first <= t.kv_offset) {
          const size_t g = ends.top().second;
          ends.pop();
          groups[g].push_back(i);
          ends.push({t.kv_offset + t.kv_len, g});
        } else {
          groups.push_back({i});
          ends.push({t.kv_offset + t.kv_len, groups.size() - 1});
        }
      }
    } else if (!picked.empty()) {
      groups.push_back(picked);
    }
    for (std::vector<size_t>& group : groups) {
      std::sort(group.begin(), group.end(),
                [&](size_t a, size_t b) { return merged[a].first.q_offset < merged[b].first.q_offset; });
      // Disjoint K/V rows: a call's scratch is at most the K/V rows, within the int32 bound above.
      Call call;
      call.key.causal = causal;
      for (size_t i : group) {
        const auto& [t, covered] = merged[i];
        call.slots.push_back(t);
        call.tasks.insert(call.tasks.end(), covered.begin(), covered.end());
      }
      DISTCA_RETURN_IF_ERROR(finish(call));
    }
  }
  return plan;
}

}  // namespace distca::kernels::cudnn
