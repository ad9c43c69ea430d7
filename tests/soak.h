// Test sizes. The suite (scripts/test.sh) runs each matrix test at its quick size; the soak size
// (more steps, more random cases) runs with DISTCA_TEST_LONG=1, which `scripts/test.sh --long` sets.
// A quick size still exercises every check of its test; the soak size only repeats them longer.
#pragma once

#include <cstdlib>
#include <string_view>

namespace distca::testing {

inline bool long_tests() {
  const char* v = std::getenv("DISTCA_TEST_LONG");
  return v != nullptr && std::string_view(v) == "1";
}

template <typename T>
T soak(T quick, T full) {
  return long_tests() ? full : quick;
}

}  // namespace distca::testing
