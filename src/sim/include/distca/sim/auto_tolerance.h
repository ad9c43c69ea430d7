// --tolerance auto: the balance target eps picked per batch by the step it predicts.
//
// A low eps balances attention more tightly but moves more work, so more bytes; a high eps moves
// less but leaves the busiest server up to eps above the mean. Which is faster depends on how
// much communication the linear layers and attention can hide, which the profile prices. A plan's
// step is priced as the simulator does (one layer, forward and backward, two ping-pong
// nano-batches: predicted_layer_step).
//
// The ladder: 0.2, 0.1, 0.05, ..., 0.2 / 128. Planning every rung costs eight plans, so auto
// predicts the rungs it has not planned and plans only where the prediction says to:
//   - The slowest server's attention at eps: the busiest rank's own work (every piece at home),
//     down to the planner's cap (1 + eps) x mean at most, priced as the profile prices that work.
//   - Each phase's busiest link at eps: plan::step_link_estimates at a cap of (1 + eps) x the mean
//     pairs (the step's link bound where no document spans ranks), split over the four phases as
//     an ideal block's rows and keys cost them, times kAutoLinkOverEstimate.
//   - Once a rung is planned, the predictions of the others take their scale from the planned
//     rung nearest them: its slowest server's attention over the predicted, and each phase's
//     busiest link over the estimate.
//   - A planned rung that moved no work scales nothing: its links (none) and its attention (the
//     busiest rank's own) say nothing about what another rung's plan would move.
// It plans the rung predicted fastest, then, while some rung it has not planned is predicted at
// least kAutoToleranceGain faster than the fastest plan so far, that one. While no plan has moved
// work and the best misses its eps, it plans the rung farthest from those planned instead (the
// paper's planner leaves everything in place at a loose eps where every receiver is within eps of
// the mean, and moves at a tight one), so a plan that moves nothing is kept only where the plans
// that moved work predict a slower step. Where a plan missed its prediction by more than
// kAutoTrustedMiss (a planner whose links stray far from the estimate, as the paper's does), it
// then walks the ladder from the fastest plan, each way while the next rung is
// kAutoToleranceGain faster. It keeps the fastest plan it made; where that plan misses its own
// eps (a batch its cuts cannot balance finer), the tightest rung its balance meets, planned,
// where that is as fast, so the eps reported is one the plan holds.
// All of it within kAutoMaxPlans plans of the planner, so that auto costs at most that many
// fixed-eps plans (plus the predictions, one pass over the batch): the same plans on every run,
// whatever the machine's speed.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

#include "distca/core/progress.h"
#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/cost.h"
#include "distca/plan/plan.h"
#include "distca/plan/planner.h"
#include "distca/sim/profile.h"
#include "distca/sim/timing.h"

namespace distca::sim {

// Forward seconds of the linear layers per token per layer on one GPU (QKV and output
// projections, gated MLP; 2 FLOPs per multiply-add, split over tp) at the profile's linear rate,
// as the simulator prices them; backward is twice that.
double linear_seconds_per_token(const plan::ModelShape& m, const Profile& profile);

// One layer's predicted step (forward and backward) of a plan, as `distca simulate` prices a CAD
// iteration: the fullest rank's linear layers, the slowest server's attention and the busiest
// rank's link per phase, in two ping-pong nano-batches that hide what they can. `stateless`: the
// paper's backward (Q, O, dO and LSE dispatched again; dK/dV returned in the activation dtype).
struct LayerStepPrediction {
  double seconds = 0;             // the layer's forward + backward, overlapped
  double linear = 0;              // forward + backward of the fullest rank
  double attention = 0;           // forward + backward of the slowest server
  double comm = 0;                // the four phases' busiest links, latency included
  double exposed() const { return seconds - linear - attention; }  // communication not hidden
};
LayerStepPrediction predicted_layer_step(const plan::Plan& plan, const plan::Batch& batch, const plan::ModelShape& model,
                                    const Profile& profile, const Link& link, bool stateless);

// The ladder of eps auto picks from, loosest first; the eps a plan request that names none starts
// from where auto does not apply (policy none).
std::vector<double> auto_tolerance_ladder();
inline constexpr double kAutoToleranceStart = 0.05;
inline constexpr double kAutoToleranceGain = 0.002;
inline constexpr int kAutoMaxPlans = 3;  // plans of the planner in all
inline constexpr double kAutoLinkOverEstimate = 1.1;  // before any plan: the busiest link over its estimate
inline constexpr double kAutoTrustedMiss = 0.03;      // a best plan missed by more: walk the ladder from it

struct ToleranceTry {
  double tolerance = 0;
  LayerStepPrediction step;
  bool is_balanced = false;
  double plan_ms = 0;
  double predicted_seconds = 0;  // what auto predicted for this rung before it planned it
  bool moves_work = true;        // whether its plan moves any work
};

struct AutoTolerance {
  double tolerance = 0;            // the one picked
  bool moves_work = true;          // whether its plan moves any work (false: none planned did, or moving was slower)
  std::vector<ToleranceTry> tried;  // in the order planned
  std::vector<std::pair<double, double>> predicted;  // (eps, step seconds) of every rung, as last predicted
  nlohmann::json to_json() const;
};

struct AutoPlan {
  plan::Plan plan;  // planned at auto.tolerance
  AutoTolerance auto_tolerance;
};

// Plans `batch` with `planner` at the ladder's eps (options.tolerance is ignored) as above and
// returns the plan whose step is fastest of those planned. `progress` (may be null) is told each
// rung before it is planned.
Result<AutoPlan> plan_auto_tolerance(const plan::Batch& batch, const plan::CostModel& cost,
                                     plan::PlannerOptions options, plan::PlanFn planner, const Profile& profile,
                                     const Link& link, bool stateless, Progress* progress = nullptr);

}  // namespace distca::sim
