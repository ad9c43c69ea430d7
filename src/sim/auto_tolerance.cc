#include "distca/sim/auto_tolerance.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <optional>

#include "distca/plan/bounds.h"

namespace distca::sim {

using namespace distca::plan;

double linear_seconds_per_token(const ModelShape& m, const Profile& profile) {
  const double h = m.hidden, hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const double flops = 2.0 * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * m.ffn_hidden) / m.tp;
  return flops / profile.linear_flops_per_second;
}

namespace {

// A plan's step in the parts auto predicts for the rungs it has not planned.
struct StepParts {
  double linear_fwd = 0;                        // the fullest rank's linear layers, forward
  double attn_fwd = 0, attn_bwd = 0;            // the slowest server's attention
  std::array<double, kNumPhases> busiest{};     // bytes: each phase's busiest link
};

TokenBytes step_token_bytes(const ModelShape& model, bool stateless) {
  TokenBytes tb = token_bytes(model);
  if (stateless) tb.bwd_dkv = tb.kv;  // the paper's system returns dK/dV in the activation dtype
  return tb;
}

double fullest_rank_linear(const Batch& batch, const ModelShape& model, const Profile& profile) {
  std::vector<int64_t> tokens(batch.num_ranks, 0);
  for (const Piece& p : batch.pieces) tokens[p.rank] += p.length();
  return static_cast<double>(*std::max_element(tokens.begin(), tokens.end())) * linear_seconds_per_token(model, profile);
}

// Per server, the profile's forward and backward seconds of `tasks`.
void server_attention(const std::vector<Task>& tasks, int32_t ranks, const ModelShape& model, const Profile& profile,
                      std::vector<double>& fwd, std::vector<double>& bwd) {
  fwd.assign(ranks, 0.0);
  bwd.assign(ranks, 0.0);
  const AttentionPricer price(profile, model.q_heads_per_rank(), model.head_dim);
  for (const Task& t : tasks) {
    const auto [f, b] = price.seconds_both(t.q_len(), t.k1 - t.k0, t.pairs());
    fwd[t.server] += f;
    bwd[t.server] += b;
  }
}

// `counted_at`: the token bytes the plan's traffic was counted at (finalize_plan: its cost
// model's), if known; where they are the step's, its links are read from there, else counted.
StepParts step_parts(const Plan& plan, const Batch& batch, const ModelShape& model, const Profile& profile,
                     bool stateless, const TokenBytes* counted_at) {
  StepParts s;
  s.linear_fwd = fullest_rank_linear(batch, model, profile);
  std::vector<double> fwd, bwd;
  server_attention(plan.tasks, batch.num_ranks, model, profile, fwd, bwd);
  s.attn_fwd = *std::max_element(fwd.begin(), fwd.end());
  s.attn_bwd = *std::max_element(bwd.begin(), bwd.end());
  const BackwardMode mode = stateless ? BackwardMode::kStateless : BackwardMode::kStateful;
  const TokenBytes tb = step_token_bytes(model, stateless);
  const LinkSummary links = counted_at != nullptr && tb == *counted_at ? plan.traffic.links[static_cast<int>(mode)]
                                             : busiest_links(batch, tb, plan.tasks, mode);
  for (int k = 0; k < kNumPhases; ++k) s.busiest[k] = static_cast<double>(links.busiest[k]);
  return s;
}

// As simulate prices a CAD iteration: every layer's operations last their slowest rank's time,
// each nano-batch carries half of everything; the model's layers forward, then backward; an
// exchange lasts its busiest link (exchange_seconds).
LayerStepPrediction price_step(const StepParts& s, const ModelShape& model, const Link& link) {
  std::array<double, kNumPhases> phase{};
  for (int k = 0; k < kNumPhases; ++k) {
    phase[k] = s.busiest[k] > 0 ? link.latency_seconds + s.busiest[k] / link.bytes_per_second : 0.0;
  }
  const LayerOps f{s.linear_fwd / 2, phase[0] / 2, s.attn_fwd / 2, phase[1] / 2};
  const LayerOps b{2 * s.linear_fwd / 2, phase[2] / 2, s.attn_bwd / 2, phase[3] / 2};
  const auto layers = static_cast<size_t>(std::max(1, model.num_layers));
  std::vector<std::array<LayerOps, 2>> ops(layers, {f, f});
  ops.resize(2 * layers, {b, b});
  LayerStepPrediction p;
  p.seconds = pingpong_seconds(ops) / static_cast<double>(layers);
  p.linear = 3 * s.linear_fwd;
  p.attention = s.attn_fwd + s.attn_bwd;
  p.comm = phase[0] + phase[1] + phase[2] + phase[3];
  return p;
}

}  // namespace

LayerStepPrediction predicted_layer_step(const Plan& plan, const Batch& batch, const ModelShape& model,
                                    const Profile& profile, const Link& link, bool stateless) {
  return price_step(step_parts(plan, batch, model, profile, stateless, nullptr), model, link);
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
                     {"predicted_before_planning_seconds", t.predicted_seconds},
                     {"linear_seconds", t.step.linear},
                     {"attention_seconds", t.step.attention},
                     {"comm_seconds", t.step.comm},
                     {"exposed_comm_seconds", t.step.exposed()},
                     {"is_balanced", t.is_balanced},
                     {"moves_work", t.moves_work},
                     {"plan_ms", t.plan_ms}});
  }
  nlohmann::json ladder = nlohmann::json::array();
  for (const auto& [eps, seconds] : predicted) ladder.push_back({{"tolerance", eps}, {"predicted_step_seconds_per_layer", seconds}});
  return {{"tolerance", tolerance},
          {"moves_work", moves_work},
          {"tried", tries},
          {"ladder_predicted", ladder},
          {"rule", fmt::format("of eps = 0.2, 0.1, ..., 0.2/128, the plan whose step (one layer, forward + backward, two "
                               "ping-pong nano-batches on the profile) is fastest of those planned; auto predicts every "
                               "eps from the unplanned layout and the step link estimate (plan/bounds.h), scaled by the "
                               "plan nearest it that moved work once there is one, and plans the one predicted fastest "
                               "while it is predicted at least {0:g} % faster than the fastest plan so far (while no plan "
                               "moved work and the best misses its eps: the eps farthest from those planned); where a "
                               "plan missed its prediction by more than {2:g} %, it then walks the ladder from the "
                               "fastest plan each way while the next eps is {0:g} % faster; {1} plans at most in all",
                               100 * kAutoToleranceGain, kAutoMaxPlans, 100 * kAutoTrustedMiss)}};
}

Result<AutoPlan> plan_auto_tolerance(const Batch& batch, const CostModel& cost, PlannerOptions options,
                                     PlanFn planner, const Profile& profile, const Link& link, bool stateless,
                                     Progress* progress) {
  const std::vector<double> ladder = auto_tolerance_ladder();
  const int n = static_cast<int>(ladder.size());
  const ModelShape& model = cost.model();
  const int32_t ranks = batch.num_ranks;
  if (progress != nullptr) {
    progress->stage(fmt::format("predicting the step of each eps for {} ({} ranks; --tolerance auto)",
                                planner_name(planner), ranks));
  }

  // The unplanned layout: every piece a causal task at home. Its busiest rank's work in the
  // planners' seconds, and how the profile prices a second of that work forward and backward.
  std::vector<Task> home;
  for (const Piece& p : batch.pieces) home.push_back(Task{p.doc, p.begin, p.end, 0, p.end, p.rank});
  std::vector<double> own(ranks, 0.0), fwd, bwd;
  for (const Task& t : home) own[t.server] += cost.task_seconds(t.q_len(), t.pairs(), t.k1 - t.k0);
  server_attention(home, ranks, model, profile, fwd, bwd);
  const double heaviest = *std::max_element(own.begin(), own.end());
  double own_total = 0, fwd_total = 0, bwd_total = 0, pairs_total = 0;
  for (int32_t r = 0; r < ranks; ++r) own_total += own[r], fwd_total += fwd[r], bwd_total += bwd[r];
  for (const Task& t : home) pairs_total += static_cast<double>(t.pairs());
  // The planners' cap is (1 + eps) x the mean of every document as one task: what the busiest
  // server is held to, and the busiest link's estimate at that many pairs.
  double docs_total = 0;
  for (int32_t d = 0; d < batch.num_docs(); ++d) {
    const int64_t len = batch.doc_lengths[d];
    docs_total += cost.task_seconds(len, causal_pairs(0, len), len);
  }
  const TokenBytes tb = step_token_bytes(model, stateless);
  // An ideal block (a rows, b keys with a Q = b K over the step) costs each phase this share of
  // the step's bytes.
  const std::array<double, kNumPhases> row_bytes{static_cast<double>(tb.q), static_cast<double>(tb.out),
                                                 static_cast<double>(tb.bwd_do + tb.out), static_cast<double>(tb.bwd_dq)};
  const std::array<double, kNumPhases> key_bytes{static_cast<double>(tb.kv), 0.0, 0.0, static_cast<double>(tb.bwd_dkv)};
  const double row_total = row_bytes[0] + row_bytes[1] + row_bytes[2] + row_bytes[3];
  const double key_total = key_bytes[0] + key_bytes[3];
  std::vector<double> slowest(n);
  std::vector<int64_t> max_pairs(n);
  for (int k = 0; k < n; ++k) {
    slowest[k] = std::min(heaviest, (1 + ladder[k]) * docs_total / ranks);
    max_pairs[k] = static_cast<int64_t>(std::ceil((1 + ladder[k]) * pairs_total / ranks));
  }
  const std::vector<double> estimate = step_link_estimates(batch, tb, max_pairs);
  const double linear_fwd = fullest_rank_linear(batch, model, profile);

  std::vector<std::optional<Plan>> plans(n);
  std::vector<StepParts> parts(n);
  std::vector<ToleranceTry> tries(n);
  // Whether a planned rung's plan can set the scale of the others: it moved work and came near its
  // own eps (within kAutoTrustedMiss of its cap). A plan that moves nothing (the paper's planner
  // where every receiver is within eps of the mean) prices the unplanned layout, and one stuck
  // far above its cap (minmax where no server has room for a shard at a tight eps) prices what
  // this planner failed to do at that eps: their links and attention say nothing about another
  // rung's plan (scaled from them, every other rung looked slower, and auto kept them).
  auto moved = [&](int k) { return plans[k] && plans[k]->traffic.forward.total_bytes > 0; };
  auto informs = [&](int k) {
    return moved(k) && plans[k]->load.imbalance <= (1 + ladder[k]) * (1 + kAutoTrustedMiss);
  };
  // A rung's step: planned, as priced; else predicted, scaled by the planned rung nearest it that
  // informs (none: the estimates alone).
  auto predict = [&](int k) {
    if (plans[k]) return tries[k].step.seconds;
    int near = -1;
    for (int j = 0; j < n; ++j) {
      if (informs(j) && (near < 0 || std::abs(j - k) < std::abs(near - k))) near = j;
    }

    StepParts s;
    s.linear_fwd = linear_fwd;
    double to_fwd = own_total > 0 ? fwd_total / own_total : 0, to_bwd = own_total > 0 ? bwd_total / own_total : 0;
    if (near >= 0 && slowest[near] > 0) {
      to_fwd = parts[near].attn_fwd / slowest[near];
      to_bwd = parts[near].attn_bwd / slowest[near];
    }
    s.attn_fwd = to_fwd * slowest[k];
    s.attn_bwd = to_bwd * slowest[k];
    for (int i = 0; i < kNumPhases; ++i) {
      double per_estimate = kAutoLinkOverEstimate * (row_bytes[i] / row_total + key_bytes[i] / key_total) / 2;
      if (near >= 0 && estimate[near] > 0) per_estimate = parts[near].busiest[i] / estimate[near];
      s.busiest[i] = per_estimate * estimate[k];
    }
    return price_step(s, model, link).seconds;
  };
  AutoTolerance chosen;
  int best = -1;  // the fastest plan so far
  int num_planned = 0;
  auto plan_rung = [&](int k, double predicted) -> Status {
    options.tolerance = ladder[k];
    if (progress != nullptr) {
      progress->stage(fmt::format("planning {} at eps {:g} ({} ranks; --tolerance auto: plan {} of at most {})",
                                  planner_name(planner), ladder[k], ranks, num_planned + 1, kAutoMaxPlans));
    }
    const auto start = std::chrono::steady_clock::now();
    DISTCA_ASSIGN_OR_RETURN(Plan p, planner(batch, cost, options));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    parts[k] = step_parts(p, batch, model, profile, stateless, &cost.token_bytes());
    tries[k] = ToleranceTry{ladder[k], price_step(parts[k], model, link), p.is_balanced, ms, predicted,
                            p.traffic.forward.total_bytes > 0};
    plans[k] = std::move(p);
    chosen.tried.push_back(tries[k]);
    ++num_planned;
    if (best < 0 || tries[k].step.seconds < tries[best].step.seconds) best = k;
    return Status::ok();
  };
  auto seconds = [&](int k) { return tries[k].step.seconds; };
  // The tightest rung the balance of plan k meets (-1: none), where it misses its own eps.
  auto rung_met = [&](int k) {
    int meets = -1;
    for (int j = 0; j < n; ++j) {
      if (ladder[j] >= plans[k]->load.imbalance - 1) meets = j;  // loosest first: the last is the tightest
    }
    return meets;
  };
  // Every plan counts against kAutoMaxPlans, so auto costs at most that many plans of the
  // planner. While the best plan misses its own eps, one is kept back for the rung its balance
  // meets (below), unless that rung is planned already.
  auto may_plan = [&] {
    int reserve = 0;
    if (best >= 0 && !plans[best]->is_balanced) {
      const int meets = rung_met(best);
      reserve = meets >= 0 && !plans[meets] ? 1 : 0;
    }
    return num_planned < kAutoMaxPlans - reserve;
  };
  // 1. The rung predicted fastest, while one is predicted kAutoToleranceGain faster than the best
  //    plan. While no plan informs and the best misses its eps (it moved nothing, or got stuck),
  //    moving more may still help: the unplanned rung farthest from those planned is planned next
  //    (the paper's planner moves at a tight eps what it leaves at a loose one; minmax finds room
  //    at a loose eps that a tight one lacks), so auto keeps such a plan only where the rungs on
  //    the other side were tried and predict a slower step.
  while (may_plan()) {
    bool any_informs = false;
    for (int k = 0; k < n; ++k) any_informs = any_informs || informs(k);
    if (best >= 0 && !any_informs && !plans[best]->is_balanced) {
      int farthest = -1, distance = -1;
      for (int k = 0; k < n; ++k) {
        if (plans[k]) continue;
        int d = n;
        for (int j = 0; j < n; ++j) {
          if (plans[j]) d = std::min(d, std::abs(j - k));
        }
        if (d > distance) farthest = k, distance = d;
      }
      if (farthest < 0) break;
      DISTCA_RETURN_IF_ERROR(plan_rung(farthest, predict(farthest)));
      continue;
    }
    int next = -1;
    double next_seconds = 0;
    for (int k = 0; k < n; ++k) {
      if (plans[k]) continue;
      const double s = predict(k);
      if (next < 0 || s < next_seconds) next = k, next_seconds = s;
    }
    if (next < 0 || (best >= 0 && !(next_seconds < seconds(best) * (1 - kAutoToleranceGain)))) break;
    DISTCA_RETURN_IF_ERROR(plan_rung(next, next_seconds));
  }
  // 2. Where a plan's step missed its prediction by more than kAutoTrustedMiss, the predictions
  //    do not hold for this planner (the paper's planner: its busiest link is up to 10x the
  //    estimate, and by how much varies by rung), so auto walks the ladder from the best plan, each
  //    way while the next rung is kAutoToleranceGain faster, within the plans left.
  const bool missed = std::any_of(chosen.tried.begin(), chosen.tried.end(), [](const ToleranceTry& t) {
    return std::abs(t.step.seconds - t.predicted_seconds) > kAutoTrustedMiss * t.step.seconds;
  });
  if (missed) {
    for (const int dir : {-1, +1}) {
      for (int k = best + dir; k >= 0 && k < n; k += dir) {
        const double before = seconds(best);
        if (!plans[k]) {
          if (!may_plan()) break;
          DISTCA_RETURN_IF_ERROR(plan_rung(k, predict(k)));
        }
        if (!(seconds(k) < before * (1 - kAutoToleranceGain))) break;
      }
    }
  }
  // 3. A fastest plan that misses its own eps (a batch too small to balance finer at g) is no
  //    answer to "which eps": the tightest rung its balance meets, planned (with the plan kept
  //    back for it), is kept where it is as fast (within kAutoToleranceGain), so the eps reported
  //    is one the plan holds.
  if (!plans[best]->is_balanced) {
    const int meets = rung_met(best);
    if (meets >= 0) {
      const int was = best;
      if (!plans[meets] && num_planned < kAutoMaxPlans) DISTCA_RETURN_IF_ERROR(plan_rung(meets, predict(meets)));
      if (plans[meets] && plans[meets]->is_balanced && seconds(meets) <= seconds(was) * (1 + kAutoToleranceGain)) {
        best = meets;
      }
    }
  }
  for (int k = 0; k < n; ++k) chosen.predicted.emplace_back(ladder[k], predict(k));
  chosen.tolerance = ladder[best];
  chosen.moves_work = moved(best);
  return AutoPlan{std::move(*plans[best]), std::move(chosen)};
}

}  // namespace distca::sim
