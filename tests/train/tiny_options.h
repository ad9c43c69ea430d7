// The tiny preset as training options, for the data-parallel trainer's tests.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>

#include "distca/model/config.h"
#include "distca/train/options.h"

namespace distca::train::testing {

inline TrainOptions tiny_options(int64_t steps) {
  auto p = model::find_preset("tiny");
  EXPECT_TRUE(p.is_ok());
  TrainOptions o;
  o.model = p.value().model;
  o.optim = p.value().optim;
  o.context = p.value().context;
  o.workload = p.value().workload;
  o.steps = steps;
  return o;
}

}  // namespace distca::train::testing
