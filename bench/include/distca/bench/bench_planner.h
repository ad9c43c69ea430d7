// The planner benchmark behind `distca bench planner`: every policy on the batches the authors'
// planner was run on (shared/data/reference), beside the reference's own figures and the lower
// bounds of plan/bounds.h, with planning times measured in the same run.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "distca/core/status.h"

namespace distca::bench {

struct PlannerBenchOptions {
  std::string reference_dir;  // empty: $DISTCA_SHARED_DATA/reference, else ../shared/data/reference
  std::string tolerance = "0.02";  // eps, or auto; the reference figures are at 0.02 and 0.1 (shown where they match)
  std::vector<std::string> policies = {"distca", "minmax", "minbytes"};
  int repeats = 20;           // planning time: the median of this many runs
  int fresh_seeds = 0;        // fresh batches: seeds 1..N of each shipped sample at 64 and 512 ranks
};

Status validate(const PlannerBenchOptions& o);
// The folder the options name, after defaults.
std::string reference_dir(const PlannerBenchOptions& o);
// What a run reads, for the output guard: the reference folder (the explicit --reference-dir, or
// the default one, named so in `flag`) and, with --fresh, the two samples beside it.
struct PlannerBenchInput {
  std::string flag, path;
};
std::vector<PlannerBenchInput> planner_bench_inputs(const PlannerBenchOptions& o);
Result<nlohmann::json> run_planner_bench(const PlannerBenchOptions& o);
void print_planner_report(const nlohmann::json& report);

}  // namespace distca::bench
