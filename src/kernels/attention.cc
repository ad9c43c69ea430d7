#include "distca/kernels/attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace distca::kernels {

float softmax_scale(const AttnDims& dims, std::optional<float> scale) {
  return scale ? *scale : 1.0f / std::sqrt(static_cast<float>(dims.head_dim));
}

Status validate(const AttnDims& dims, std::span<const AttnTask> tasks, RangeScratch* ranges) {
  if (dims.num_q_rows < 0 || dims.num_kv_rows < 0) {
    return invalid_argument(fmt::format("row counts must be >= 0, got Tq = {}, Tkv = {}",
                                        dims.num_q_rows, dims.num_kv_rows));
  }
  if (dims.num_q_heads <= 0 || dims.num_kv_heads <= 0 || dims.head_dim <= 0) {
    return invalid_argument(fmt::format("Hq, Hkv and D must be >= 1, got Hq = {}, Hkv = {}, D = {}",
                                        dims.num_q_heads, dims.num_kv_heads, dims.head_dim));
  }
  if (dims.num_q_heads % dims.num_kv_heads != 0) {
    return invalid_argument(fmt::format("Hq = {} is not a multiple of Hkv = {} (GQA groups)",
                                        dims.num_q_heads, dims.num_kv_heads));
  }
  RangeScratch local;
  RangeScratch& q_ranges = ranges != nullptr ? *ranges : local;
  q_ranges.clear();
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const AttnTask& t = tasks[i];
    if (t.q_len < 0 || t.kv_len < 0 || t.q_offset < 0 || t.kv_offset < 0) {
      return invalid_argument(fmt::format("task {}: offsets and lengths must be >= 0", i));
    }
    if (t.q_offset > dims.num_q_rows - t.q_len) {
      return invalid_argument(fmt::format("task {}: Q rows [{}, {}) exceed Tq = {}", i, t.q_offset,
                                          t.q_offset + t.q_len, dims.num_q_rows));
    }
    if (t.kv_offset > dims.num_kv_rows - t.kv_len) {
      return invalid_argument(fmt::format("task {}: K/V rows [{}, {}) exceed Tkv = {}", i,
                                          t.kv_offset, t.kv_offset + t.kv_len, dims.num_kv_rows));
    }
    if (t.is_causal && t.q_len > t.kv_len) {
      return invalid_argument(fmt::format(
          "task {}: a causal task needs q_len <= kv_len (bottom-right alignment), got {} > {}", i,
          t.q_len, t.kv_len));
    }
    if (t.q_len > 0) q_ranges.emplace_back(t.q_offset, t.q_offset + t.q_len);
  }
  std::sort(q_ranges.begin(), q_ranges.end());
  for (std::size_t i = 1; i < q_ranges.size(); ++i) {
    if (q_ranges[i].first < q_ranges[i - 1].second) {
      return invalid_argument(fmt::format(
          "tasks overlap in Q rows [{}, {}) and [{}, {}); each query row belongs to one task",
          q_ranges[i - 1].first, q_ranges[i - 1].second, q_ranges[i].first, q_ranges[i].second));
    }
  }
  return Status::ok();
}

namespace {
// A buffer to check: its pointer, whether it is query-sized ([Tq, Hq, D]) or key-sized, its name.
struct CheckedBuffer {
  const void* data;
  bool is_query_sized;
  const char* name;
};

Status validate_with_buffers(const AttnDims& dims, std::span<const AttnTask> tasks, RangeScratch* ranges,
                             std::initializer_list<CheckedBuffer> buffers) {
  DISTCA_RETURN_IF_ERROR(validate(dims, tasks, ranges));
  const int64_t nq = dims.num_q_rows * dims.num_q_heads;
  const int64_t nkv = dims.num_kv_rows * dims.num_kv_heads;
  for (const CheckedBuffer& b : buffers) {
    if ((b.is_query_sized ? nq : nkv) > 0 && b.data == nullptr) return invalid_argument(fmt::format("{} is null", b.name));
  }
  return Status::ok();
}
}  // namespace

template <typename T>
Status validate(const AttnFwdParams<T>& p, RangeScratch* ranges) {
  return validate_with_buffers(p.dims, p.tasks, ranges,
                               {{p.q, true, "Q"}, {p.k, false, "K"}, {p.v, false, "V"}, {p.o, true, "O"}, {p.lse, true, "LSE"}});
}

template <typename T>
Status validate(const AttnBwdParams<T>& p, RangeScratch* ranges) {
  return validate_with_buffers(p.dims, p.tasks, ranges,
                               {{p.q, true, "Q"}, {p.k, false, "K"}, {p.v, false, "V"}, {p.o, true, "O"}, {p.lse, true, "LSE"},
                                {p.d_o, true, "dO"}, {p.dq, true, "dQ"}, {p.dk, false, "dK"}, {p.dv, false, "dV"}});
}

template Status validate(const AttnFwdParams<float>&, RangeScratch*);
template Status validate(const AttnFwdParams<bf16>&, RangeScratch*);
template Status validate(const AttnBwdParams<float>&, RangeScratch*);
template Status validate(const AttnBwdParams<bf16>&, RangeScratch*);

int64_t task_pairs(const AttnTask& t) {
  if (!t.is_causal) return t.q_len * t.kv_len;
  // Query i sees kv_len - q_len + i + 1 keys.
  return t.q_len * (t.kv_len - t.q_len) + t.q_len * (t.q_len + 1) / 2;
}

int64_t total_pairs(std::span<const AttnTask> tasks) {
  int64_t sum = 0;
  for (const AttnTask& t : tasks) sum += task_pairs(t);
  return sum;
}

double forward_flops(const AttnDims& dims, std::span<const AttnTask> tasks) {
  return 4.0 * static_cast<double>(dims.head_dim) * static_cast<double>(dims.num_q_heads) *
         static_cast<double>(total_pairs(tasks));
}

double backward_flops(const AttnDims& dims, std::span<const AttnTask> tasks) {
  return 2.5 * forward_flops(dims, tasks);
}

template <typename T>
void lse_merge(int64_t num_rows, int64_t num_heads, int64_t head_dim, const T* o_part,
               const float* lse_part, T* o, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < num_rows * num_heads; ++r) {
    const float a = lse[r];
    const float b = lse_part[r];
    if (b == kNegInf) continue;
    T* out = o + r * head_dim;
    const T* part = o_part + r * head_dim;
    if (a == kNegInf) {
      std::copy(part, part + head_dim, out);
      lse[r] = b;
      continue;
    }
    const float m = std::max(a, b);
    const float merged = m + std::log(std::exp(a - m) + std::exp(b - m));
    const float wa = std::exp(a - merged);
    const float wb = std::exp(b - merged);
    for (int64_t d = 0; d < head_dim; ++d) {
      out[d] = from_float<T>(wa * to_float(out[d]) + wb * to_float(part[d]));
    }
    lse[r] = merged;
  }
}

template void lse_merge(int64_t, int64_t, int64_t, const float*, const float*, float*, float*);
template void lse_merge(int64_t, int64_t, int64_t, const bf16*, const float*, bf16*, float*);

}  // namespace distca::kernels
