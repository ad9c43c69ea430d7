#include "distca/plan/cost.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "distca/core/check.h"

namespace distca::plan {

Status ThroughputProfile::validate() const {
  if (!(flops_per_second > 0) || !std::isfinite(flops_per_second)) {
    return invalid_argument(fmt::format("profile: flops_per_second must be positive, got {}",
                                        flops_per_second));
  }
  if (tile_rows <= 0) {
    return invalid_argument(fmt::format("profile: tile_rows must be positive, got {}", tile_rows));
  }
  if (!(task_overhead_seconds >= 0) || !std::isfinite(task_overhead_seconds)) {
    return invalid_argument(fmt::format("profile: task_overhead_seconds must be >= 0, got {}",
                                        task_overhead_seconds));
  }
  for (size_t i = 0; i < rate_by_keys.size(); ++i) {
    const RatePoint& r = rate_by_keys[i];
    if (r.keys <= 0 || (i > 0 && r.keys <= rate_by_keys[i - 1].keys)) {
      return invalid_argument(fmt::format("profile: rate_by_keys must have keys > 0, ascending; point {} has {}", i, r.keys));
    }
    if (!(r.flops_per_second > 0) || !(r.flops_per_second <= flops_per_second * (1 + 1e-9))) {
      return invalid_argument(fmt::format("profile: rate_by_keys point {} has {} FLOP/s, not in (0, flops_per_second = {}]",
                                          i, r.flops_per_second, flops_per_second));
    }
  }
  return Status::ok();
}

ThroughputProfile cpu_throughput_profile() {
  ThroughputProfile p;
  p.source = "CPU estimate: 30 GFLOP/s per rank, 16-row tiles, 20 us per task per layer";
  p.flops_per_second = 30e9;
  p.tile_rows = 16;
  p.task_overhead_seconds = 20e-6;
  return p;
}

double ThroughputProfile::rate(int64_t keys) const {
  if (rate_by_keys.empty()) return flops_per_second;
  if (keys <= rate_by_keys.front().keys) return rate_by_keys.front().flops_per_second;
  if (keys >= rate_by_keys.back().keys) return rate_by_keys.back().flops_per_second;
  size_t i = 1;
  while (rate_by_keys[i].keys < keys) ++i;
  const RatePoint &a = rate_by_keys[i - 1], &b = rate_by_keys[i];
  const double w = std::log(static_cast<double>(keys) / a.keys) / std::log(static_cast<double>(b.keys) / a.keys);
  return a.flops_per_second * (1 - w) + b.flops_per_second * w;
}

double ThroughputProfile::slowest_rate() const {
  double slowest = flops_per_second;
  for (const RatePoint& r : rate_by_keys) slowest = std::min(slowest, r.flops_per_second);
  return slowest;
}

TokenBytes token_bytes(int64_t hq, int64_t hkv, int64_t head_dim, int64_t dtype_bytes, GradReturn grad_return) {
  const int64_t row = hq * head_dim * dtype_bytes;
  const int64_t lse = 4 * hq;  // fp32 per query head
  TokenBytes b;
  b.q = row;
  b.kv = 2 * hkv * head_dim * dtype_bytes;
  b.out = row + lse;
  b.bwd_q = 3 * row + lse;
  b.bwd_do = row;
  b.bwd_dq = row;
  b.bwd_dkv = 2 * hkv * head_dim * grad_return_bytes(grad_return);
  return b;
}

TokenBytes token_bytes(const ModelShape& m) {
  return token_bytes(m.q_heads_per_rank(), m.kv_heads_per_rank(), m.head_dim, m.dtype_bytes, m.grad_return);
}

CostModel::CostModel(ModelShape model, ThroughputProfile profile)
    : model_(std::move(model)), profile_(std::move(profile)) {
  DISTCA_CHECK(model_.validate().is_ok()) << model_.validate().to_string();
  DISTCA_CHECK(profile_.validate().is_ok()) << profile_.validate().to_string();
  token_bytes_ = plan::token_bytes(model_);
  const double flops_per_pair = model_.num_layers * (fwd_flops_per_pair() + bwd_flops_per_pair());
  seconds_per_pair_ = flops_per_pair / profile_.flops_per_second;
  slowest_seconds_per_pair_ = flops_per_pair / profile_.slowest_rate();
  task_overhead_ = model_.num_layers * profile_.task_overhead_seconds;
}

}  // namespace distca::plan
