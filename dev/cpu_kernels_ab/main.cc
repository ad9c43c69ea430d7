// Standalone timing of CpuAttention (old vs new source), one causal document, Hq 4 / Hkv 1, fp32.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "distca/kernels/cpu.h"
using namespace distca::kernels;
int main(int argc, char** argv) {
  const int64_t n = atoll(argv[1]), D = atoll(argv[2]);
  const int threads = atoi(argv[3]), reps = atoi(argv[4]);
  const int64_t shard = argc > 5 ? atoll(argv[5]) : 0;
  const int64_t hq = 4, hkv = 1;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  auto rnd = [&](int64_t k) { std::vector<float> v(k); for (auto& x : v) x = nd(rng); return v; };
  auto q = rnd(n * hq * D), k = rnd(n * hkv * D), v = rnd(n * hkv * D), d_o = rnd(n * hq * D);
  std::vector<float> o(n * hq * D), lse(n * hq), dq(n * hq * D), dk(n * hkv * D), dv(n * hkv * D);
  std::vector<AttnTask> tasks;
  if (shard == 0) tasks.push_back({0, n, 0, n, true});
  else for (int64_t s = 0; s < n; s += shard) tasks.push_back({s, std::min(shard, n - s), 0, std::min(n, s + shard), true});
  AttnDims dims{n, n, hq, hkv, D};
  CpuAttentionOptions opt; opt.num_threads = threads;
  CpuAttention cpu(opt);
  AttnFwdParams<float> fp{dims, q.data(), k.data(), v.data(), tasks, {}, o.data(), lse.data()};
  AttnBwdParams<float> bp{dims, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(), tasks, {}, dq.data(), dk.data(), dv.data()};
  std::vector<double> tf, tb;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    if (!cpu.forward(fp).is_ok()) return 1;
    auto t1 = std::chrono::steady_clock::now();
    if (!cpu.backward(bp).is_ok()) return 1;
    auto t2 = std::chrono::steady_clock::now();
    if (r) { tf.push_back(std::chrono::duration<double>(t1 - t0).count()); tb.push_back(std::chrono::duration<double>(t2 - t1).count()); }
  }
  std::sort(tf.begin(), tf.end()); std::sort(tb.begin(), tb.end());
  const double pairs = double(n) * (n + 1) / 2, ff = 4.0 * D * hq * pairs;
  printf("%s n=%lld D=%lld t=%d shard=%lld fwd %.1f GFLOP/s (%.3f s) bwd %.1f GFLOP/s (%.3f s)\n", cpu.isa().c_str(), (long long)n, (long long)D, threads, (long long)shard,
         ff / tf[tf.size() / 2] / 1e9, tf[tf.size() / 2], 2.5 * ff / tb[tb.size() / 2] / 1e9, tb[tb.size() / 2]);
}
