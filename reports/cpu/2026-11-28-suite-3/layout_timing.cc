// A rank's route and exchange layout at 512 ranks, timed in C++ (every 8th rank of the shipped
// prolong batch, planned by minlink). From the repository root, after scripts/build.sh:
//   g++ -std=c++20 -O2 -include src/plan/include/distca/plan/model_shape.h -Isrc/core/include \
//     -Isrc/plan/include -Isrc/runtime/include -Isrc/kernels/include -Isrc/comm/include \
//     reports/cpu/2026-11-28-suite-3/layout_timing.cc build/src/runtime/libdistca_route.a \
//     build/src/plan/libdistca_plan.a build/src/core/libdistca_core.a -lfmt -lpthread -o /tmp/layout_timing
//   /tmp/layout_timing ../shared/data/reference/batch_prolong_r512.json
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include "distca/plan/batch.h"
#include "distca/plan/planner.h"
#include "distca/runtime/route.h"
#include "distca/runtime/exchange.h"
using namespace distca;
int main(int argc, char** argv) {
  std::ifstream f(argv[1]); std::stringstream ss; ss << f.rdbuf();
  auto batch = plan::parse_batch_json(ss.str(), 0, argv[1]).value();
  plan::CostModel cost(plan::model_preset("llama-8b").value(), plan::ThroughputProfile{});
  plan::PlannerOptions opt;
  auto p = plan::plan_minlink(batch, cost, opt).value();
  double route_s = 0, layout_s = 0; int n = 0;
  for (int r = 0; r < batch.num_ranks; r += 8, ++n) {
    auto t0 = std::chrono::steady_clock::now();
    auto route = runtime::build_route(batch, p.tasks, r).value();
    auto t1 = std::chrono::steady_clock::now();
    auto x = runtime::exchange_layout(route);
    auto t2 = std::chrono::steady_clock::now();
    route_s += std::chrono::duration<double>(t1 - t0).count();
    layout_s += std::chrono::duration<double>(t2 - t1).count();
  }
  std::printf("tasks %zu: per rank route %.2f ms, layout %.2f ms\n", p.tasks.size(), route_s / n * 1e3, layout_s / n * 1e3);
}
