// Shared helpers of the kernel tests: random problems built from documents cut into shards (the
// shape of what an attention server receives), and comparisons that report the worst coordinate.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "distca/kernels/attention.h"

namespace distca::kernels::testing {

template <typename T>
std::vector<T> random_values(std::mt19937_64& rng, int64_t n, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<T> out(n);
  for (auto& x : out) x = from_float<T>(dist(rng));
  return out;
}

template <typename T>
std::vector<float> to_floats(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_float(v[i]);
  return out;
}

// Documents of the given lengths, cut into shards; each shard is a causal task whose keys are
// the document's prefix (tasks of one document share its K/V rows, stored once). Q rows follow
// the task order, with `gap` uncovered rows after each task.
struct TaskSet {
  AttnDims dims;
  std::vector<AttnTask> tasks;
};

inline TaskSet shard_documents(std::mt19937_64& rng, const std::vector<int64_t>& doc_lengths,
                               int64_t max_shard, int64_t hq, int64_t hkv, int64_t d,
                               int64_t gap = 0) {
  TaskSet set;
  int64_t q_row = 0, kv_row = 0;
  for (int64_t len : doc_lengths) {
    for (int64_t a = 0; a < len;) {
      const int64_t b = std::min(len, a + std::uniform_int_distribution<int64_t>(1, max_shard)(rng));
      set.tasks.push_back({q_row, b - a, kv_row, b, true});
      q_row += b - a + gap;
      a = b;
    }
    kv_row += len;
  }
  set.dims = {q_row, kv_row, hq, hkv, d};
  return set;
}

// The largest |a - b|.
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && a[i] == b[i]) continue;
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
}
inline double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float x : a)
    if (!std::isinf(x)) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

// Expects |got - want| <= atol + rtol * |want| everywhere (equal infinities pass); on failure
// names the worst coordinate as (row, head, d) of a [rows, heads, inner] tensor.
inline void expect_close(const std::string& name, const std::vector<float>& got,
                         const std::vector<float>& want, int64_t heads, int64_t inner, double atol,
                         double rtol = 0.0) {
  ASSERT_EQ(got.size(), want.size()) << name;
  double worst = 0;
  std::size_t worst_i = 0;
  bool is_bad = false;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) {
      worst_i = i;
      is_bad = true;
      worst = std::numeric_limits<double>::infinity();
      break;
    }
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) {
        worst_i = i;
        is_bad = true;
        worst = std::numeric_limits<double>::infinity();
        break;
      }
      continue;
    }
    const double excess = std::abs(static_cast<double>(got[i]) - want[i]) - (atol + rtol * std::abs(want[i]));
    if (excess > worst || (!is_bad && excess > 0)) {
      worst = excess;
      worst_i = i;
      is_bad = is_bad || excess > 0;
    }
  }
  if (is_bad) {
    const int64_t i = static_cast<int64_t>(worst_i);
    ADD_FAILURE() << name << ": worst at (row " << i / (heads * inner) << ", head "
                  << (i / inner) % heads << ", d " << i % inner << "): got " << got[worst_i]
                  << ", want " << want[worst_i] << ", |diff| " << std::abs(got[worst_i] - want[worst_i])
                  << " > tolerance " << atol + rtol * std::abs(want[worst_i]) << " (atol " << atol
                  << ", rtol " << rtol << ")";
  }
}

// Every element written: no NaN left from a NaN-filled output.
inline bool all_finite_or_neg_inf(const std::vector<float>& v) {
  return std::none_of(v.begin(), v.end(), [](float x) { return std::isnan(x) || x == std::numeric_limits<float>::infinity(); });
}

}  // namespace distca::kernels::testing
