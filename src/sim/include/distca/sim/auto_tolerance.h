// --tolerance auto: the balance target eps picked per batch by the step it predicts.
//
// A low eps balances attention more tightly but moves more work, so more bytes; a high eps moves
// less but leaves the busiest server up to eps above the mean. Which is faster depends on how
// much communication the linear layers and attention can hide, which the profile prices. So the
// planner plans at eps from a ladder, prices each plan's step as the simulator does (one layer,
// forward and backward, two ping-pong nano-batches: predicted_layer_step), and keeps the fastest.
//
// The ladder: 0.2, 0.1, 0.05, ..., 0.2 / 128. The search plans 0.05 and its tighter neighbour
// first, the looser side if that one is not faster, and walks on in the direction that wins while
// each rung predicts a step at least kAutoToleranceGain faster (a smaller gain is within what the
// profile can tell, and costs one more plan); so it assumes one valley. It plans two rungs at a
// time on two threads (the second in case the first wins), 4 to 6 plans in 2 or 3 rounds, and
// keeps the fastest of all it planned.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

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

// The ladder of eps auto picks from, loosest first, and where its search starts.
std::vector<double> auto_tolerance_ladder();
inline constexpr double kAutoToleranceStart = 0.05;
inline constexpr double kAutoToleranceGain = 0.002;

struct ToleranceTry {
  double tolerance = 0;
  LayerStepPrediction step;
  bool is_balanced = false;
  double plan_ms = 0;
};

struct AutoTolerance {
  double tolerance = 0;            // the one picked
  std::vector<ToleranceTry> tried;  // in the order planned
  nlohmann::json to_json() const;
};

struct AutoPlan {
  plan::Plan plan;  // planned at auto.tolerance
  AutoTolerance auto_tolerance;
};

// Plans `batch` with `planner` at the ladder's eps (options.tolerance is ignored) as above and
// returns the plan whose predicted step is fastest of those planned.
Result<AutoPlan> plan_auto_tolerance(const plan::Batch& batch, const plan::CostModel& cost,
                                     plan::PlannerOptions options, plan::PlanFn planner, const Profile& profile,
                                     const Link& link, bool stateless);

}  // namespace distca::sim
