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

CostModel::CostModel(ModelShape model, ThroughputProfile profile)
    : model_(std::move(model)), profile_(std::move(profile)) {
  DISTCA_CHECK(model_.validate().is_ok()) << model_.validate().to_string();
  DISTCA_CHECK(profile_.validate().is_ok()) << profile_.validate().to_string();
  const int64_t hq = model_.q_heads_per_rank();
  const int64_t hkv = model_.kv_heads_per_rank();
  const int64_t d = model_.head_dim;
  const int64_t b = model_.dtype_bytes;
  const int64_t lse = 4 * hq;  // fp32 per query head
  token_bytes_.q = hq * d * b;
  token_bytes_.kv = 2 * hkv * d * b;
  token_bytes_.out = hq * d * b + lse;
  token_bytes_.bwd_q = 3 * hq * d * b + lse;
  token_bytes_.bwd_dq = hq * d * b;
  token_bytes_.bwd_dkv = 2 * hkv * d * 4;
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
