#include "distca/sim/auto_tolerance.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

namespace distca::sim {

using namespace distca::plan;

double linear_seconds_per_token(const ModelShape& m, const Profile& profile) {
  const double h = m.hidden, hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const double flops = 2.0 * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * m.ffn_hidden) / m.tp;
  return flops / profile.linear_flops_per_second;
}

LayerStepPrediction predicted_layer_step(const Plan& plan, const Batch& batch, const ModelShape& model,
                                    const Profile& profile, const Link& link, bool stateless) {
  const int32_t r = batch.num_ranks;
  std::vector<double> fwd(r, 0.0), bwd(r, 0.0);
  for (const Task& t : plan.tasks) {
    fwd[t.server] += profile.attention_seconds(t.q_len(), t.k1 - t.k0, t.pairs(), model.q_heads_per_rank(),
                                               model.head_dim, false);
    bwd[t.server] += profile.attention_seconds(t.q_len(), t.k1 - t.k0, t.pairs(), model.q_heads_per_rank(),
                                               model.head_dim, true);
  }
  std::vector<int64_t> tokens(r, 0);
  for (const Piece& p : batch.pieces) tokens[p.rank] += p.length();
  const double lin_f = static_cast<double>(*std::max_element(tokens.begin(), tokens.end())) *
                       linear_seconds_per_token(model, profile);
  TokenBytes tb = token_bytes(model.q_heads_per_rank(), model.kv_heads_per_rank(), model.head_dim, model.dtype_bytes);
  if (stateless) tb.bwd_dkv = tb.kv;  // the paper's system returns dK/dV in the activation dtype
  const Traffic traffic =
      count_traffic(batch, tb, plan.tasks, stateless ? BackwardMode::kStateless : BackwardMode::kStateful);
  std::array<double, kNumPhases> phase{};
  for (int k = 0; k < kNumPhases; ++k) {
    const PhaseTraffic& p = traffic.phases[k];
    phase[k] = exchange_seconds(p.send_bytes, p.recv_bytes, link);
  }
  const double attn_f = *std::max_element(fwd.begin(), fwd.end()), attn_b = *std::max_element(bwd.begin(), bwd.end());
  // As simulate prices a CAD iteration: every layer's operations last their slowest rank's time,
  // each nano-batch carries half of everything; the model's layers forward, then backward.
  const LayerOps f{lin_f / 2, phase[0] / 2, attn_f / 2, phase[1] / 2};
  const LayerOps b{2 * lin_f / 2, phase[2] / 2, attn_b / 2, phase[3] / 2};
  const auto layers = static_cast<size_t>(std::max(1, model.num_layers));
  std::vector<std::array<LayerOps, 2>> ops(layers, {f, f});
  ops.resize(2 * layers, {b, b});
  LayerStepPrediction s;
  s.seconds = pingpong_seconds(ops) / static_cast<double>(layers);
  s.linear = 3 * lin_f;
  s.attention = attn_f + attn_b;
  s.comm = phase[0] + phase[1] + phase[2] + phase[3];
  return s;
}

std::vector<double> auto_tolerance_ladder() {
  std::vector<double> ladder;
  for (int k = 0; k <= 7; ++k) ladder.push_back(0.2 / std::ldexp(1.0, k));
  return ladder;
}

nlohmann::json AutoTolerance::to_json() const {
  nlohmann::json tries = nlohmann::json::array();
  for (const ToleranceTry& t : tried) {
    tries.push_back({{"tolerance", t.tolerance},
                     {"predicted_step_seconds_per_layer", t.step.seconds},
                     {"linear_seconds", t.step.linear},
                     {"attention_seconds", t.step.attention},
                     {"comm_seconds", t.step.comm},
                     {"exposed_comm_seconds", t.step.exposed()},
                     {"is_balanced", t.is_balanced},
                     {"plan_ms", t.plan_ms}});
  }
  return {{"tolerance", tolerance},
          {"tried", tries},
          {"rule", "of eps = 0.2, 0.1, ..., 0.2/128, the plan whose predicted step (one layer, forward + backward, "
                   "two ping-pong nano-batches on the profile) is fastest of those planned; the search plans 0.05 and "
                   "0.025 first (the looser side if 0.025 is not faster) and walks on in the direction that wins while "
                   "each step is at least 0.2 % faster, two rungs at a time on two threads"}};
}

Result<AutoPlan> plan_auto_tolerance(const Batch& batch, const CostModel& cost, PlannerOptions options,
                                     PlanFn planner, const Profile& profile, const Link& link, bool stateless) {
  const std::vector<double> ladder = auto_tolerance_ladder();
  const int n = static_cast<int>(ladder.size());
  std::vector<std::optional<Plan>> plans(n);
  std::vector<ToleranceTry> tries(n);
  std::vector<Status> failed(n);
  auto plan_one = [&](int k) {
    PlannerOptions o = options;
    o.tolerance = ladder[k];
    const auto start = std::chrono::steady_clock::now();
    Result<Plan> p = planner(batch, cost, o);
    if (!p.is_ok()) {
      failed[k] = p.status();
      return;
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    tries[k] = ToleranceTry{ladder[k], predicted_layer_step(p.value(), batch, cost.model(), profile, link, stateless),
                            p.value().is_balanced, ms};
    plans[k] = std::move(p).value();
  };
  AutoTolerance chosen;
  // Plans the ladder's k and j (when in range and not planned yet) at once, on two threads.
  auto plan_two = [&](int k, int j) -> Status {
    const bool do_k = k >= 0 && k < n && !plans[k], do_j = j >= 0 && j < n && j != k && !plans[j];
    std::optional<std::thread> other;
    if (do_j) other.emplace(plan_one, j);
    if (do_k) plan_one(k);
    if (other) other->join();
    for (const int i : {k, j}) {
      if (i < 0 || i >= n || (i == k ? !do_k : !do_j)) continue;
      DISTCA_RETURN_IF_ERROR(failed[i]);
      chosen.tried.push_back(tries[i]);
    }
    return Status::ok();
  };
  auto seconds = [&](int k) { return tries[k].step.seconds; };
  const int start = static_cast<int>(std::find(ladder.begin(), ladder.end(), kAutoToleranceStart) - ladder.begin());
  int best = start;
  // The start and its tighter neighbour first (measured: the better first guess even where
  // communication is exposed, since the busiest link is the largest sender's, whose excess barely
  // grows as eps shrinks, while the slowest server's attention falls); the looser side if that is
  // not faster. Then on in the direction that won while each step is at least kAutoToleranceGain
  // faster, two rungs at a time (the second on a thread of its own, in case the first wins).
  DISTCA_RETURN_IF_ERROR(plan_two(start, start + 1));
  for (const int dir : {+1, -1}) {
    bool moved = false;
    for (int k = best + dir; k >= 0 && k < n; k += dir) {
      if (!plans[k]) DISTCA_RETURN_IF_ERROR(plan_two(k, k + dir));
      if (!(seconds(k) < seconds(best) * (1 - kAutoToleranceGain))) break;
      best = k;
      moved = true;
    }
    if (moved) break;
  }
  // The fastest of all it planned (a rung that ended the walk, or one planned ahead, included).
  for (int k = 0; k < n; ++k) {
    if (plans[k] && seconds(k) < seconds(best)) best = k;
  }
  chosen.tolerance = ladder[best];
  return AutoPlan{std::move(*plans[best]), std::move(chosen)};
}

}  // namespace distca::sim
