// Planning latency: every policy on the pretrain and prolong workloads at T = 131072 for
// R = 64, 256, 512, all measured in one run (args: R, workload 0 = pretrain / 1 = prolong). Counters carry the plan's balance and bytes so a latency is never
// read without what it bought. JSON: plan_bench --benchmark_format=json.
#include <benchmark/benchmark.h>

#include <map>

#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"

namespace distca::plan {
namespace {

const Batch& batch_for(int32_t ranks, int64_t workload) {
  static std::map<std::pair<int32_t, int64_t>, Batch> cache;
  const auto key = std::make_pair(ranks, workload);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const char* name = workload == 0 ? "pretrain" : "prolong";
    it = cache.emplace(key, sample_batch(builtin_distribution(name).value(), SamplingOptions{}, ranks, 131072).value()).first;
  }
  return it->second;
}

void run(benchmark::State& state, PlanFn fn, double tolerance) {
  const Batch& batch = batch_for(static_cast<int32_t>(state.range(0)), state.range(1));
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
  state.counters["hash24"] = static_cast<double>(plan.hash & 0xffffff);  // to compare builds' plans
}

void BM_minmax_eps002(benchmark::State& state) { run(state, plan_minmax, 0.02); }
void BM_distca_eps002(benchmark::State& state) { run(state, plan_distca, 0.02); }
void BM_distca_eps010(benchmark::State& state) { run(state, plan_distca, 0.1); }
void BM_none(benchmark::State& state) { run(state, plan_none, 0.02); }
void BM_minbytes_eps005(benchmark::State& state) { run(state, plan_minbytes, 0.05); }
void BM_minlink_eps005(benchmark::State& state) { run(state, plan_minlink, 0.05); }

#define DISTCA_PLAN_BENCH(fn) \
  BENCHMARK(fn)->ArgsProduct({{64, 256, 512}, {0, 1}})->ArgNames({"R", "prolong"})->Unit(benchmark::kMillisecond)
DISTCA_PLAN_BENCH(BM_minmax_eps002);
DISTCA_PLAN_BENCH(BM_distca_eps002);
DISTCA_PLAN_BENCH(BM_distca_eps010);
DISTCA_PLAN_BENCH(BM_none);
DISTCA_PLAN_BENCH(BM_minbytes_eps005);
DISTCA_PLAN_BENCH(BM_minlink_eps005);

}  // namespace
}  // namespace distca::plan

BENCHMARK_MAIN();
