// Planning latency: every policy on the pretrain workload at T = 131072 for R = 64, 256, 512,
// all measured in one run. Counters carry the plan's balance and bytes so a latency is never
// read without what it bought. JSON: plan_bench --benchmark_format=json.
#include <benchmark/benchmark.h>

#include <map>

#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"

namespace distca::plan {
namespace {

const Batch& batch_for(int32_t ranks) {
  static std::map<int32_t, Batch> cache;
  auto it = cache.find(ranks);
  if (it == cache.end()) {
    it = cache.emplace(ranks, sample_batch(builtin_distribution("pretrain").value(), SamplingOptions{}, ranks, 131072).value()).first;
  }
  return it->second;
}

void run(benchmark::State& state, PlanFn fn, double tolerance) {
  const Batch& batch = batch_for(static_cast<int32_t>(state.range(0)));
  const CostModel cost(model_preset("llama-8b").value(), ThroughputProfile{});
  const PlannerOptions options{tolerance, 128, 0};
  // Correctness once, before timing.
  const Plan plan = fn(batch, cost, options).value();
  if (!verify_tasks(batch, plan.tasks).is_ok()) {
    state.SkipWithError("plan fails verification");
    return;
  }
  for (auto _ : state) {
    Result<Plan> p = fn(batch, cost, options);
    benchmark::DoNotOptimize(p);
  }
  state.counters["imbalance"] = plan.load.imbalance;
  state.counters["kv_GiB"] = static_cast<double>(plan.traffic.forward.kv_bytes) / (1 << 30);
  state.counters["tasks"] = static_cast<double>(plan.tasks.size());
  state.counters["docs"] = batch.num_docs();
}

void BM_minmax_eps002(benchmark::State& state) { run(state, plan_minmax, 0.02); }
void BM_distca_eps002(benchmark::State& state) { run(state, plan_distca, 0.02); }
void BM_distca_eps010(benchmark::State& state) { run(state, plan_distca, 0.1); }
void BM_none(benchmark::State& state) { run(state, plan_none, 0.02); }

BENCHMARK(BM_minmax_eps002)->Arg(64)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_distca_eps002)->Arg(64)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_distca_eps010)->Arg(64)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_none)->Arg(64)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace distca::plan

BENCHMARK_MAIN();
