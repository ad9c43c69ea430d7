// The median and the range of a benchmark's repeated measurements.
#pragma once

#include <algorithm>
#include <vector>

namespace distca::bench {

struct Spread {
  double median = 0, min = 0, max = 0;
};

// Of no values: all zero.
inline Spread spread_of(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return {n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v.front(), v.back()};
}

}  // namespace distca::bench
