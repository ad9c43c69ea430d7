// Small shapes shared by the plan tests.
#pragma once

#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/model_shape.h"

namespace distca::plan::testing {

// Hq=2, Hkv=1, D=4, bf16, 1 layer: q = 16, kv = 16, out = 16 + 8 bytes per token.
inline ModelShape tiny_model() { return ModelShape{"tiny", 1, 8, 2, 1, 4, 16, 2, 1}; }

inline CostModel tiny_cost(double overhead = 0.0, int64_t tile = 1) {
  ThroughputProfile p;
  p.flops_per_second = 1e9;
  p.tile_rows = tile;
  p.task_overhead_seconds = overhead;
  return CostModel(tiny_model(), p);
}

inline int64_t total_causal_pairs(const Batch& batch) {
  int64_t total = 0;
  for (int64_t len : batch.doc_lengths) total += causal_pairs(0, len);
  return total;
}

}  // namespace distca::plan::testing
