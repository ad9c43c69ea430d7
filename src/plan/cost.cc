#include "distca/plan/cost.h"

#include <fmt/format.h>

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
  return Status::ok();
}

TokenBytes token_bytes(int64_t hq, int64_t hkv, int64_t head_dim, int64_t dtype_bytes) {
  const int64_t row = hq * head_dim * dtype_bytes;
  const int64_t lse = 4 * hq;  // fp32 per query head
  TokenBytes b;
  b.q = row;
  b.kv = 2 * hkv * head_dim * dtype_bytes;
  b.out = row + lse;
  b.bwd_q = 3 * row + lse;
  b.bwd_do = row;
  b.bwd_dq = row;
  b.bwd_dkv = 2 * hkv * head_dim * 4;
  return b;
}

CostModel::CostModel(ModelShape model, ThroughputProfile profile)
    : model_(std::move(model)), profile_(std::move(profile)) {
  DISTCA_CHECK(model_.validate().is_ok()) << model_.validate().to_string();
  DISTCA_CHECK(profile_.validate().is_ok()) << profile_.validate().to_string();
  token_bytes_ = plan::token_bytes(model_.q_heads_per_rank(), model_.kv_heads_per_rank(),
                             model_.head_dim, model_.dtype_bytes);
  seconds_per_pair_ = model_.num_layers * (fwd_flops_per_pair() + bwd_flops_per_pair()) /
                      profile_.flops_per_second;
}

double CostModel::task_seconds(int64_t q_len, int64_t pairs) const {
  DISTCA_CHECK(q_len > 0 && pairs >= 0) << "task of " << q_len << " rows and " << pairs << " pairs";
  double seconds = pair_seconds(pairs);
  if (q_len < profile_.tile_rows) {
    seconds *= static_cast<double>(profile_.tile_rows) / static_cast<double>(q_len);
  }
  return seconds + model_.num_layers * profile_.task_overhead_seconds;
}

}  // namespace distca::plan
