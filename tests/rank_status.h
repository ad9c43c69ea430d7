// Every rank's status of a multi-rank test run, checked at once: each failure names its rank.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "distca/core/status.h"

namespace distca::testing {

inline void expect_all_ok(const std::vector<Status>& statuses) {
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  }
}

}  // namespace distca::testing
