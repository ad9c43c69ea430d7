// `distca bench attention`: GFLOP/s (causal-aware FLOP counts) of the fused CPU attention,
// forward and backward, single-thread and all threads, on whole documents and on the same tokens
// as fused shards that share K/V; beside it, in the same run, GEMM-based attention (OpenBLAS
// sgemm, materialized scores) and OpenBLAS sgemm itself on a square 2048 problem, this machine's
// practical ceiling. Checks the kernels against the reference once before timing.
#include "distca/bench/bench_attention.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <set>

#include "distca/core/thread_pool.h"
#include "distca/kernels/cpu.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/kernels/ref.h"
#include "distca/kernels/blas_setup.h"

namespace distca::bench {
namespace {

using namespace distca::kernels;
using Clock = std::chrono::steady_clock;

// The best of `repeats` runs; runs shorter than a second get at least two, so the first call's
// workspace growth and page faults never decide a small case's time.
template <typename Fn>
double best_seconds(int repeats, Fn&& fn) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < repeats || (r < 2 && best < 1.0); ++r) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

double sgemm_gflops(int threads, int repeats) {
  const int n = 2048;
  std::vector<float> a(n * n), b(n * n), c(n * n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* m : {&a, &b})
    for (float& x : *m) x = u(rng);
  blas_set_num_threads(threads);
  auto run = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  };
  run();  // warm-up: OpenBLAS sizes its buffers and threads
  return 2.0 * n * n * n / best_seconds(std::max(repeats, 3), run) / 1e9;
}

struct Problem {
  AttnDims dims;
  std::vector<AttnTask> tasks;
};

// One document of L tokens: one causal task, or shards of `shard` queries against the shared
// prefix (exactly the same (query, key) pairs).
Problem document(const AttentionBenchOptions& o, int64_t L, int64_t shard) {
  Problem p{{L, L, o.q_heads, o.kv_heads, o.head_dim}, {}};
  if (shard <= 0) {
    p.tasks.push_back({0, L, 0, L, true});
  } else {
    for (int64_t a = 0; a < L; a += shard) {
      const int64_t b = std::min(L, a + shard);
      p.tasks.push_back({a, b - a, 0, b, true});
    }
  }
  return p;
}

struct Buffers {
  std::vector<float> q, k, v, o, lse, d_o, dq, dk, dv;
  explicit Buffers(const AttnDims& n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const int64_t nq = n.num_q_rows * n.num_q_heads * n.head_dim;
    const int64_t nkv = n.num_kv_rows * n.num_kv_heads * n.head_dim;
    auto fill = [&](std::vector<float>& x, int64_t size) {
      x.resize(size);
      for (float& e : x) e = dist(rng);
    };
    fill(q, nq);
    fill(k, nkv);
    fill(v, nkv);
    fill(d_o, nq);
    o.resize(nq);
    dq.resize(nq);
    dk.resize(nkv);
    dv.resize(nkv);
    lse.resize(n.num_q_rows * n.num_q_heads);
  }
  AttnFwdParams<float> fwd(const Problem& p) {
    return {p.dims, q.data(), k.data(), v.data(), p.tasks, {}, o.data(), lse.data()};
  }
  AttnBwdParams<float> bwd(const Problem& p) {
    return {p.dims, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(), p.tasks, {}, dq.data(), dk.data(), dv.data()};
  }
};

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// The fused kernel (forward and backward) and the GEMM baseline against the double reference on
// a small sharded document. Returns the largest error of each, or an error past 1e-3.
Result<nlohmann::json> check_correctness(const AttentionBenchOptions& o, CpuAttention& fused, GemmAttention& gemm) {
  const Problem p = document(o, 700, 128);
  Buffers got(p.dims, o.seed), want(p.dims, o.seed), base(p.dims, o.seed);
  DISTCA_RETURN_IF_ERROR(fused.forward(got.fwd(p)));
  DISTCA_RETURN_IF_ERROR(fused.backward(got.bwd(p)));
  DISTCA_RETURN_IF_ERROR(ref::attention_forward(want.fwd(p)));
  DISTCA_RETURN_IF_ERROR(ref::attention_backward(want.bwd(p)));
  blas_set_num_threads(1);
  DISTCA_RETURN_IF_ERROR(gemm.forward(base.fwd(p)));
  nlohmann::json check = {
      {"tokens", 700},
      {"shard", 128},
      {"fused_o", max_abs_diff(got.o, want.o)},
      {"fused_dq", max_abs_diff(got.dq, want.dq)},
      {"fused_dk", max_abs_diff(got.dk, want.dk)},
      {"fused_dv", max_abs_diff(got.dv, want.dv)},
      {"gemm_o", max_abs_diff(base.o, want.o)},
  };
  for (const auto& [name, err] : check.items()) {
    if (name != "tokens" && name != "shard" && !(err.get<double>() <= 1e-3)) {
      return internal_error(fmt::format("correctness check failed before timing: {} differs from the reference by {}", name, err.get<double>()));
    }
  }
  return check;
}

}  // namespace

Status validate(const AttentionBenchOptions& o) {
  if (o.docs.empty()) return invalid_argument("--docs needs at least one document length");
  for (int64_t L : o.docs) {
    if (L < 1 || L > (1 << 20)) return invalid_argument(fmt::format("--docs: length {} is outside [1, 1048576]", L));
  }
  if (o.shard_doc < 1 || o.shard_doc > (1 << 20)) return invalid_argument(fmt::format("--shard-doc {} is outside [1, 1048576]", o.shard_doc));
  for (int64_t s : o.shards) {
    if (s < 1 || s > o.shard_doc) {
      return invalid_argument(fmt::format("--shards: size {} is outside [1, --shard-doc {}]", s, o.shard_doc));
    }
  }
  if (o.head_dim != 32 && o.head_dim != 64 && o.head_dim != 128 && o.head_dim != 256) {
    return invalid_argument(fmt::format("--head-dim {}: the CPU kernels are built for 32, 64, 128 and 256", o.head_dim));
  }
  if (o.q_heads < 1 || o.kv_heads < 1 || o.q_heads % o.kv_heads != 0) {
    return invalid_argument(fmt::format("--heads {} must be a positive multiple of --kv-heads {}", o.q_heads, o.kv_heads));
  }
  if (o.threads < 0 || o.threads > 1024) return invalid_argument(fmt::format("--threads {} is outside [0, 1024]", o.threads));
  if (o.repeats < 1 || o.repeats > 100) return invalid_argument(fmt::format("--repeats {} is outside [1, 100]", o.repeats));
  return Status::ok();
}

Result<nlohmann::json> run_attention_bench(const AttentionBenchOptions& o, const ProgressLine& progress) {
  DISTCA_RETURN_IF_ERROR(validate(o));
  const int all = o.threads > 0 ? o.threads : ThreadPool::hardware_threads();
  CpuAttention fused1({.num_threads = 1}), fused_all({.num_threads = all});
  GemmAttention gemm1(1), gemm_all(all);

  nlohmann::json out;
  out["format"] = "distca-bench-attention";
  out["version"] = 1;
  // The sgemm ceiling is the machine's only if OpenBLAS runs the kernels of the CPU's widest
  // vector unit (kernels/blas_setup.h).
  const kernels::BlasCheck blas = kernels::blas_check();
  out["machine"] = {{"threads", all}, {"isa", fused1.isa()}, {"cpu_isa", blas.cpu_isa},
                    {"openblas_coretype", blas.coretype}, {"coretype_set_by_distca", blas.is_set_by_distca}};
  out["blas_core"] = blas.core;
  out["ceiling_trusted"] = blas.is_trusted;
  if (!blas.is_trusted) {
    out["blas_warning"] = blas.warning;
    progress(blas.warning);
  }
  out["config"] = {{"head_dim", o.head_dim}, {"q_heads", o.q_heads}, {"kv_heads", o.kv_heads}, {"dtype", "fp32"},
                   {"docs", o.docs}, {"shard_doc", o.shard_doc}, {"shards", o.shards}, {"repeats", o.repeats}};
  DISTCA_ASSIGN_OR_RETURN(out["check"], check_correctness(o, fused1, gemm1));
  progress("correctness check against the reference passed");

  const double sgemm1 = sgemm_gflops(1, o.repeats);
  const double sgemm_all = sgemm_gflops(all, o.repeats);
  out["sgemm_gflops"] = sgemm1;
  out["sgemm_gflops_all_threads"] = sgemm_all;
  progress(fmt::format("sgemm 2048: {:.1f} GFLOP/s on 1 thread, {:.1f} on {}", sgemm1, sgemm_all, all));

  out["results"] = nlohmann::json::array();
  auto record = [&](const std::string& kase, int64_t L, int64_t shard, const char* impl, const char* pass,
                    int threads, double flops, double seconds) {
    const double gflops = flops / seconds / 1e9;
    out["results"].push_back({{"case", kase}, {"tokens", L}, {"shard", shard}, {"impl", impl}, {"pass", pass},
                              {"threads", threads}, {"seconds", seconds}, {"gflops", gflops}});
    progress(fmt::format("{:<14} {:>7} tokens  {:<6} {:<4} {} thread{}: {:8.1f} GFLOP/s ({:.3f} s)", kase, L, impl, pass,
                         threads, threads == 1 ? "" : "s", gflops, seconds));
    return gflops;
  };
  auto measure = [&](const std::string& kase, int64_t L, int64_t shard, bool with_baseline) -> Status {
    const Problem p = document(o, L, shard);
    Buffers b(p.dims, o.seed);
    const double ff = forward_flops(p.dims, p.tasks), bf = backward_flops(p.dims, p.tasks);
    for (auto [fused, threads] : {std::pair{&fused1, 1}, std::pair{&fused_all, all}}) {
      Status st;
      const double fs = best_seconds(o.repeats, [&] { st = fused->forward(b.fwd(p)); });
      DISTCA_RETURN_IF_ERROR(st);
      record(kase, L, shard, "fused", "fwd", threads, ff, fs);
      const double bs = best_seconds(o.repeats, [&] { st = fused->backward(b.bwd(p)); });
      DISTCA_RETURN_IF_ERROR(st);
      record(kase, L, shard, "fused", "bwd", threads, bf, bs);
    }
    if (with_baseline) {
      for (auto [g, threads] : {std::pair{&gemm1, 1}, std::pair{&gemm_all, all}}) {
        Status st;
        const double gs = best_seconds(o.repeats, [&] { st = g->forward(b.fwd(p)); });
        DISTCA_RETURN_IF_ERROR(st);
        record(kase, L, shard, "gemm", "fwd", threads, ff, gs);
      }
    }
    return Status::ok();
  };
  std::set<int64_t> docs(o.docs.begin(), o.docs.end());
  docs.insert(o.shard_doc);
  for (int64_t L : docs) DISTCA_RETURN_IF_ERROR(measure("whole", L, 0, true));
  for (int64_t s : o.shards) DISTCA_RETURN_IF_ERROR(measure(fmt::format("shards of {}", s), o.shard_doc, s, false));

  // Headline numbers: the shard document, one thread.
  auto find = [&](int64_t L, int64_t shard, const char* impl, const char* pass, int threads) {
    for (const auto& r : out["results"]) {
      if (r["tokens"] == L && r["shard"] == shard && r["impl"] == impl && r["pass"] == pass && r["threads"] == threads)
        return r["gflops"].get<double>();
    }
    return 0.0;
  };
  const double fwd = find(o.shard_doc, 0, "fused", "fwd", 1);
  const double bwd = find(o.shard_doc, 0, "fused", "bwd", 1);
  const double gemm_fwd = find(o.shard_doc, 0, "gemm", "fwd", 1);
  out["headline"] = {{"tokens", o.shard_doc}, {"threads", 1}};
  out["fwd_gflops"] = fwd;
  out["bwd_gflops"] = bwd;
  out["gemm_attention_gflops"] = gemm_fwd;
  out["fwd_gflops_all_threads"] = find(o.shard_doc, 0, "fused", "fwd", all);
  out["bwd_gflops_all_threads"] = find(o.shard_doc, 0, "fused", "bwd", all);
  out["gemm_attention_gflops_all_threads"] = find(o.shard_doc, 0, "gemm", "fwd", all);
  out["shard_fwd_gflops"] = nlohmann::json::object();
  out["shard_bwd_gflops"] = nlohmann::json::object();
  for (int64_t s : o.shards) {
    out["shard_fwd_gflops"][std::to_string(s)] = find(o.shard_doc, s, "fused", "fwd", 1);
    out["shard_bwd_gflops"][std::to_string(s)] = find(o.shard_doc, s, "fused", "bwd", 1);
  }
  out["ratios"] = {{"fwd_over_sgemm", fwd / sgemm1}, {"bwd_over_sgemm", bwd / sgemm1}, {"fwd_over_gemm_attention", fwd / gemm_fwd}};
  for (int64_t s : o.shards) {
    out["ratios"][fmt::format("shard{}_fwd_over_whole", s)] = find(o.shard_doc, s, "fused", "fwd", 1) / fwd;
  }
  return out;
}

void print_attention_report(const nlohmann::json& r) {
  const auto& c = r["config"];
  const int all = r["machine"]["threads"];
  const bool is_trusted = r["ceiling_trusted"].get<bool>();
  const std::string coretype = r["machine"]["openblas_coretype"].get<std::string>();
  fmt::print("attention benchmark: D={} Hq={} Hkv={} fp32, kernels {}, {} threads, OpenBLAS {} core ({})\n",
             c["head_dim"].get<int>(), c["q_heads"].get<int>(), c["kv_heads"].get<int>(),
             r["machine"]["isa"].get<std::string>(), all, r["blas_core"].get<std::string>(),
             coretype.empty() ? "detected by OpenBLAS"
                              : fmt::format("OPENBLAS_CORETYPE={}{}", coretype,
                                            r["machine"]["coretype_set_by_distca"].get<bool>() ? ", set by distca" : ""));
  if (!is_trusted) fmt::print("{}\n", r["blas_warning"].get<std::string>());
  fmt::print("sgemm 2048x2048x2048: {:.1f} GFLOP/s on 1 thread, {:.1f} on {}{}\n\n", r["sgemm_gflops"].get<double>(),
             r["sgemm_gflops_all_threads"].get<double>(), all, is_trusted ? "" : " (NOT this machine's ceiling)");
  fmt::print("{:<16} {:>7} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}   GFLOP/s\n", "case", "tokens", "fwd 1t",
             fmt::format("fwd {}t", all), "bwd 1t", fmt::format("bwd {}t", all), "gemm 1t", fmt::format("gemm {}t", all));
  std::vector<std::pair<std::string, int64_t>> rows;
  for (const auto& x : r["results"]) {
    std::pair<std::string, int64_t> key{x["case"], x["tokens"]};
    if (std::find(rows.begin(), rows.end(), key) == rows.end()) rows.push_back(key);
  }
  for (const auto& [kase, L] : rows) {
    auto cell = [&](const char* impl, const char* pass, int threads) -> std::string {
      for (const auto& x : r["results"]) {
        if (x["case"] == kase && x["tokens"] == L && x["impl"] == impl && x["pass"] == pass && x["threads"] == threads)
          return fmt::format("{:.1f}", x["gflops"].get<double>());
      }
      return "-";
    };
    fmt::print("{:<16} {:>7} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}\n", kase, L, cell("fused", "fwd", 1),
               cell("fused", "fwd", all), cell("fused", "bwd", 1), cell("fused", "bwd", all), cell("gemm", "fwd", 1),
               cell("gemm", "fwd", all));
  }
  const auto& q = r["ratios"];
  fmt::print("\n{} tokens, one thread: forward {:.2f}x sgemm, backward {:.2f}x sgemm, forward {:.2f}x GEMM attention{}\n",
             r["headline"]["tokens"].get<int64_t>(), q["fwd_over_sgemm"].get<double>(), q["bwd_over_sgemm"].get<double>(),
             q["fwd_over_gemm_attention"].get<double>(),
             is_trusted ? "" : fmt::format(" (both baselines on OpenBLAS's {} kernels: see the warning)",
                                           r["blas_core"].get<std::string>()));
  for (const auto& [name, v] : q.items()) {
    if (name.rfind("shard", 0) == 0) fmt::print("  {}: {:.3f}\n", name, v.get<double>());
  }
}

}  // namespace distca::bench
