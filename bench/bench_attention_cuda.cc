#include "distca/bench/bench_attention_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <random>

#include "distca/core/file.h"
#include "distca/kernels/attention.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/ref.h"
#include "distca/sim/profile.h"

#if defined(DISTCA_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace distca::bench {

Status validate(const CudaAttentionBenchOptions& o) {
  if (o.docs.empty()) return invalid_argument("--docs needs at least one length");
  for (int64_t L : o.docs) {
    if (L < 1 || L > (int64_t{1} << 20)) return invalid_argument(fmt::format("--docs: {} is outside [1, 1048576]", L));
  }
  if (o.shard_doc < 1 || o.shard_doc > (int64_t{1} << 20)) {
    return invalid_argument(fmt::format("--shard-doc {} is outside [1, 1048576]", o.shard_doc));
  }
  for (int64_t s : o.shards) {
    if (s < 1 || s > o.shard_doc) return invalid_argument(fmt::format("--shards: {} is outside [1, --shard-doc]", s));
  }
  if (o.head_dim != 64 && o.head_dim != 128) {
    return invalid_argument(fmt::format("--head-dim {}: the CUDA kernels are built for 64 and 128", o.head_dim));
  }
  if (o.q_heads < 1 || o.kv_heads < 1 || o.q_heads % o.kv_heads != 0 || o.q_heads > 1024) {
    return invalid_argument(fmt::format("--heads {} must be a multiple of --kv-heads {} (at most 1024)", o.q_heads, o.kv_heads));
  }
  if (o.dtype != "bfloat16" && o.dtype != "float16") {
    return invalid_argument(fmt::format("--dtype {}: bfloat16 or float16", o.dtype));
  }
  if (o.repeats < 1 || o.repeats > 100) return invalid_argument(fmt::format("--repeats {} is outside [1, 100]", o.repeats));
  if (!o.profile_out.empty()) {
    if (Status s = check_output_path("--profile-out", o.profile_out); !s.is_ok()) return s;
  }
  return Status::ok();
}

nlohmann::json measured_cuda_profile(const CudaAttentionBenchOptions& o, const std::string& device,
                                     const std::string& date, const std::vector<MeasuredPoint>& whole_documents,
                                     double device_memory_bytes) {
  sim::Profile profile = sim::default_h200_profile();
  if (device_memory_bytes > 0) {
    profile.device_memory_bytes = device_memory_bytes;
    profile.device_memory_source = fmt::format("{:.1f} GB ({:.1f} GiB): the total memory CUDA reports for {}",
                                               device_memory_bytes / 1e9, device_memory_bytes / (1 << 30), device);
  }
  sim::AttentionProfile ap;
  ap.num_q_heads = o.q_heads;
  ap.num_kv_heads = o.kv_heads;
  ap.head_dim = o.head_dim;
  ap.tile_rows = kernels::kCudaFwdBlockM;
  for (const MeasuredPoint& m : whole_documents) ap.points.push_back({m.tokens, m.tokens, m.fwd_seconds, m.bwd_seconds});
  std::sort(ap.points.begin(), ap.points.end(),
            [](const sim::AttentionPoint& a, const sim::AttentionPoint& b) { return a.kv_tokens < b.kv_tokens; });
  // No per-task overhead on top: one fused call serves every task of a server, and a call's
  // launch and schedule upload are inside the measured times (a whole document prices at exactly
  // what was measured).
  ap.task_overhead_seconds = 0;
  profile.attention = {ap};
  profile.name = device;
  profile.source = fmt::format("attention measured by `distca bench attention --device cuda` on {} on {} ({}); links "
                               "and linear layers from the published-number H200 profile{}",
                               device, date, o.dtype, device_memory_bytes > 0 ? "" : ", and its memory");
  nlohmann::json j = sim::to_json(profile);
  j["measured"] = true;
  j["device"] = device;
  j["date"] = date;
  return j;
}

#if !defined(DISTCA_HAVE_CUDA)

Result<nlohmann::json> run_cuda_attention_bench(const CudaAttentionBenchOptions&,
                                                const std::function<void(const std::string&)>&) {
  return not_found("this build of distca has no CUDA kernels (nvcc was not found at configure time)");
}

#else

namespace {

using namespace distca::kernels;

#define BENCH_CUDA_TRY(call)                                                                                  \
  do {                                                                                                        \
    const cudaError_t bench_error = (call);                                                                   \
    if (bench_error != cudaSuccess) {                                                                         \
      return internal_error(fmt::format("{} failed: {}", #call, cudaGetErrorString(bench_error)));            \
    }                                                                                                         \
  } while (0)

// Device memory that frees itself.
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p) (void)cudaFree(p);
  }
  Status alloc(int64_t bytes) {
    BENCH_CUDA_TRY(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 16))));
    return Status::ok();
  }
};

// A task list and its dimensions: what one timed call runs.
struct TaskProblem {
  AttnDims dims;
  std::vector<AttnTask> tasks;
};

// One document of L tokens: one causal task, or shards of `shard` queries against the shared prefix.
TaskProblem document(const CudaAttentionBenchOptions& o, int64_t L, int64_t shard) {
  TaskProblem p{{L, L, o.q_heads, o.kv_heads, o.head_dim}, {}};
  for (int64_t a = 0; a < L; a += shard > 0 ? shard : L) {
    const int64_t b = shard > 0 ? std::min(L, a + shard) : L;
    p.tasks.push_back({a, b - a, 0, b, true});
  }
  return p;
}

// The tensors of one problem in the storage type, random N(0, 1): a pool of 2^20 values is made
// once and tiled (timing does not depend on the values).
struct Tensors {
  DeviceBuffer q, k, v, o, lse, d_o, dq, dk, dv;
};

Status fill_random(void* dst, int64_t n, CudaDType dtype, uint64_t seed) {
  constexpr int64_t kPool = int64_t{1} << 20;
  std::vector<float> host(static_cast<size_t>(std::min(n, kPool)));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (float& x : host) x = dist(rng);
  DeviceBuffer f32;
  if (Status s = f32.alloc(static_cast<int64_t>(host.size()) * 4); !s.is_ok()) return s;
  BENCH_CUDA_TRY(cudaMemcpy(f32.p, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  if (Status s = cuda_convert_from_f32(static_cast<float*>(f32.p), dst, dtype, static_cast<int64_t>(host.size()), nullptr);
      !s.is_ok()) {
    return s;
  }
  const int64_t chunk = static_cast<int64_t>(host.size());
  for (int64_t at = chunk; at < n; at += chunk) {
    BENCH_CUDA_TRY(cudaMemcpy(static_cast<char*>(dst) + at * 2, dst, static_cast<size_t>(std::min(chunk, n - at)) * 2,
                              cudaMemcpyDeviceToDevice));
  }
  BENCH_CUDA_TRY(cudaDeviceSynchronize());
  return Status::ok();
}

Status make_tensors(const AttnDims& d, CudaDType dtype, uint64_t seed, Tensors& t) {
  const int64_t nq = d.num_q_rows * d.num_q_heads * d.head_dim, nkv = d.num_kv_rows * d.num_kv_heads * d.head_dim;
  for (auto [buffer, bytes] : {std::pair<DeviceBuffer*, int64_t>{&t.q, nq * 2}, {&t.k, nkv * 2}, {&t.v, nkv * 2},
                               {&t.o, nq * 2}, {&t.lse, d.num_q_rows * d.num_q_heads * 4}, {&t.d_o, nq * 2},
                               {&t.dq, nq * 2}, {&t.dk, nkv * 4}, {&t.dv, nkv * 4}}) {
    if (Status s = buffer->alloc(bytes); !s.is_ok()) return s;
  }
  for (auto [buffer, n, salt] : {std::tuple<DeviceBuffer*, int64_t, uint64_t>{&t.q, nq, 1}, {&t.k, nkv, 2}, {&t.v, nkv, 3},
                                 {&t.d_o, nq, 4}}) {
    if (Status s = fill_random(buffer->p, n, dtype, seed * 16 + salt); !s.is_ok()) return s;
  }
  return Status::ok();
}

CudaFwdArgs fwd_args(const TaskProblem& p, CudaDType dtype, Tensors& t) {
  CudaFwdArgs a;
  a.dims = p.dims;
  a.dtype = dtype;
  a.q = t.q.p;
  a.k = t.k.p;
  a.v = t.v.p;
  a.tasks = p.tasks;
  a.o = t.o.p;
  a.lse = static_cast<float*>(t.lse.p);
  return a;
}

CudaBwdArgs bwd_args(const TaskProblem& p, CudaDType dtype, Tensors& t) {
  CudaBwdArgs a;
  a.dims = p.dims;
  a.dtype = dtype;
  a.q = t.q.p;
  a.k = t.k.p;
  a.v = t.v.p;
  a.o = t.o.p;
  a.lse = static_cast<const float*>(t.lse.p);
  a.d_o = t.d_o.p;
  a.tasks = p.tasks;
  a.dq = t.dq.p;
  a.dk = t.dk.p;
  a.dv = t.dv.p;
  a.dkv_fp32 = true;
  return a;
}

struct Timing {
  double median_seconds = 0;
  double min_seconds = 0;
  double max_seconds = 0;
};

// The median of `repeats` runs after one warm-up, each timed with CUDA events around the call.
template <typename Fn>
Result<Timing> time_calls(int repeats, Fn&& call) {
  cudaEvent_t start, stop;
  BENCH_CUDA_TRY(cudaEventCreate(&start));
  BENCH_CUDA_TRY(cudaEventCreate(&stop));
  std::vector<double> seconds;
  Status failed = Status::ok();
  for (int r = -1; r < repeats && failed.is_ok(); ++r) {
    (void)cudaEventRecord(start, nullptr);
    failed = call();
    (void)cudaEventRecord(stop, nullptr);
    if (const cudaError_t e = cudaEventSynchronize(stop); e != cudaSuccess && failed.is_ok()) {
      failed = internal_error(fmt::format("the timed kernels failed: {}", cudaGetErrorString(e)));
    }
    float ms = 0;
    (void)cudaEventElapsedTime(&ms, start, stop);
    if (r >= 0) seconds.push_back(ms / 1e3);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  if (!failed.is_ok()) return failed;
  std::sort(seconds.begin(), seconds.end());
  return Timing{seconds[seconds.size() / 2], seconds.front(), seconds.back()};
}

// Reads a device array of the storage type back as floats.
Result<std::vector<float>> read_back(const void* src, CudaDType dtype, int64_t n) {
  DeviceBuffer f32;
  if (Status s = f32.alloc(n * 4); !s.is_ok()) return s;
  if (Status s = cuda_convert_to_f32(src, dtype, static_cast<float*>(f32.p), n, nullptr); !s.is_ok()) return s;
  std::vector<float> host(static_cast<size_t>(n));
  BENCH_CUDA_TRY(cudaMemcpy(host.data(), f32.p, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost));
  return host;
}

// Before timing: the kernels against the reference on a small problem (shards of a 300-token
// document sharing K/V and a whole one of 77, GQA), every output element finite. The tolerance is
// the storage type's: O within 2 eps max|V| (P and O rounded), LSE within 1e-4 relative, dQ/dK/dV
// within 8 eps max|ref| (dS and P rounded before their products).
Result<nlohmann::json> check_against_reference(CudaAttention& attn, const CudaAttentionBenchOptions& o, CudaDType dtype) {
  TaskProblem p = document(o, 300, 128);
  p.dims = {377, 377, std::min<int64_t>(o.q_heads, 4 * (o.q_heads / o.kv_heads)), 0, o.head_dim};
  p.dims.num_kv_heads = p.dims.num_q_heads / (o.q_heads / o.kv_heads);
  p.tasks.push_back({300, 77, 300, 77, true});
  Tensors t;
  if (Status s = make_tensors(p.dims, dtype, o.seed + 99, t); !s.is_ok()) return s;
  if (Status s = attn.forward(fwd_args(p, dtype, t), nullptr); !s.is_ok()) return s;
  if (Status s = attn.backward(bwd_args(p, dtype, t), nullptr); !s.is_ok()) return s;
  BENCH_CUDA_TRY(cudaDeviceSynchronize());
  const int64_t nq = p.dims.num_q_rows * p.dims.num_q_heads * p.dims.head_dim;
  const int64_t nkv = p.dims.num_kv_rows * p.dims.num_kv_heads * p.dims.head_dim;
  const int64_t nl = p.dims.num_q_rows * p.dims.num_q_heads;
  DISTCA_ASSIGN_OR_RETURN(std::vector<float> q, read_back(t.q.p, dtype, nq));
  DISTCA_ASSIGN_OR_RETURN(std::vector<float> k, read_back(t.k.p, dtype, nkv));
  DISTCA_ASSIGN_OR_RETURN(std::vector<float> v, read_back(t.v.p, dtype, nkv));
  DISTCA_ASSIGN_OR_RETURN(std::vector<float> o_gpu, read_back(t.o.p, dtype, nq));
  DISTCA_ASSIGN_OR_RETURN(std::vector<float> d_o, read_back(t.d_o.p, dtype, nq));
  DISTCA_ASSIGN_OR_RETURN(std::vector<float> dq_gpu, read_back(t.dq.p, dtype, nq));
  std::vector<float> lse_gpu(static_cast<size_t>(nl)), dk_gpu(static_cast<size_t>(nkv)), dv_gpu(static_cast<size_t>(nkv));
  BENCH_CUDA_TRY(cudaMemcpy(lse_gpu.data(), t.lse.p, lse_gpu.size() * 4, cudaMemcpyDeviceToHost));
  BENCH_CUDA_TRY(cudaMemcpy(dk_gpu.data(), t.dk.p, dk_gpu.size() * 4, cudaMemcpyDeviceToHost));
  BENCH_CUDA_TRY(cudaMemcpy(dv_gpu.data(), t.dv.p, dv_gpu.size() * 4, cudaMemcpyDeviceToHost));

  std::vector<float> o_ref(o_gpu.size()), lse_ref(lse_gpu.size());
  AttnFwdParams<float> f;
  f.dims = p.dims;
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  f.tasks = p.tasks;
  f.o = o_ref.data();
  f.lse = lse_ref.data();
  if (Status s = ref::attention_forward(f); !s.is_ok()) return s;
  std::vector<float> dq_ref(dq_gpu.size()), dk_ref(dk_gpu.size()), dv_ref(dv_gpu.size());
  AttnBwdParams<float> b;
  b.dims = p.dims;
  b.q = q.data();
  b.k = k.data();
  b.v = v.data();
  b.o = o_gpu.data();  // the gradient at the O the kernel produced (as the kernel computes it)
  b.lse = lse_gpu.data();
  b.d_o = d_o.data();
  b.tasks = p.tasks;
  b.dq = dq_ref.data();
  b.dk = dk_ref.data();
  b.dv = dv_ref.data();
  if (Status s = ref::attention_backward(b, true); !s.is_ok()) return s;

  const double eps = dtype == CudaDType::kBf16 ? 1.0 / 256 : 1.0 / 2048;
  auto worst = [](const std::vector<float>& got, const std::vector<float>& want, bool relative) {
    double w = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
      const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
      w = std::max(w, relative ? diff / (1 + std::abs(want[i])) : diff);
    }
    return w;
  };
  auto max_abs = [](const std::vector<float>& x) {
    double m = 0;
    for (float e : x) m = std::max(m, static_cast<double>(std::abs(e)));
    return m;
  };
  nlohmann::json check = {{"problem", "a 300-token document in shards of 128 sharing K/V, plus a whole 77-token one"}};
  bool ok = true;
  auto add = [&](const char* name, double error, double tolerance) {
    check[name] = {{"max_error", error}, {"tolerance", tolerance}};
    ok = ok && error <= tolerance;
  };
  add("o", worst(o_gpu, o_ref, false), 2 * eps * max_abs(v));
  add("lse", worst(lse_gpu, lse_ref, true), 1e-4);
  add("dq", worst(dq_gpu, dq_ref, false), 8 * eps * max_abs(dq_ref));
  add("dk", worst(dk_gpu, dk_ref, false), 8 * eps * max_abs(dk_ref));
  add("dv", worst(dv_gpu, dv_ref, false), 8 * eps * max_abs(dv_ref));
  check["passed"] = ok;
  if (!ok) return internal_error(fmt::format("the CUDA kernels disagree with the reference: {}", check.dump()));
  return check;
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char text[16];
  std::strftime(text, sizeof text, "%Y-%m-%d", std::gmtime(&now));
  return text;
}

}  // namespace

Result<nlohmann::json> run_cuda_attention_bench(const CudaAttentionBenchOptions& o,
                                                const std::function<void(const std::string&)>& progress) {
  DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<CudaAttention> attn, CudaAttention::create(o.device));
  const CudaDType dtype = o.dtype == "float16" ? CudaDType::kFp16 : CudaDType::kBf16;
  nlohmann::json report = {{"format", "distca-bench-attention-cuda"},
                           {"device", attn->device_name()},
                           {"date", today()},
                           {"dtype", o.dtype},
                           {"heads", o.q_heads},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"repeats", o.repeats},
                           {"flops", "causal-aware: 4 D Hq per (query, key) pair forward; backward 2.5x forward"},
                           {"timing", "CUDA events around each call, median of the repeats after one warm-up"}};
  DISTCA_ASSIGN_OR_RETURN(nlohmann::json check, check_against_reference(*attn, o, dtype));
  report["check"] = check;
  progress(fmt::format("checked against the reference on {}: o {:.2e}, dq {:.2e}, dk {:.2e}, dv {:.2e}",
                       attn->device_name(), check["o"]["max_error"].get<double>(), check["dq"]["max_error"].get<double>(),
                       check["dk"]["max_error"].get<double>(), check["dv"]["max_error"].get<double>()));

  std::vector<std::pair<int64_t, int64_t>> cases;  // (document, shard; 0 = whole)
  for (int64_t L : o.docs) cases.emplace_back(L, 0);
  if (std::find(o.docs.begin(), o.docs.end(), o.shard_doc) == o.docs.end()) cases.emplace_back(o.shard_doc, 0);
  for (int64_t s : o.shards) cases.emplace_back(o.shard_doc, s);
  nlohmann::json results = nlohmann::json::array();
  std::map<int64_t, nlohmann::json> whole;
  for (const auto& [L, shard] : cases) {
    const TaskProblem p = document(o, L, shard);
    Tensors t;
    if (Status s = make_tensors(p.dims, dtype, o.seed, t); !s.is_ok()) return s;
    const CudaFwdArgs fa = fwd_args(p, dtype, t);
    const CudaBwdArgs ba = bwd_args(p, dtype, t);
    DISTCA_ASSIGN_OR_RETURN(Timing fwd, time_calls(o.repeats, [&] { return attn->forward(fa, nullptr); }));
    DISTCA_ASSIGN_OR_RETURN(Timing bwd, time_calls(o.repeats, [&] { return attn->backward(ba, nullptr); }));
    const double fwd_flops = forward_flops(p.dims, p.tasks), bwd_flops = backward_flops(p.dims, p.tasks);
    nlohmann::json r = {{"case", shard ? fmt::format("{} tokens as {}-token shards", L, shard) : fmt::format("{} tokens whole", L)},
                        {"tokens", L},
                        {"shard", shard},
                        {"tasks", p.tasks.size()},
                        {"fwd_seconds", fwd.median_seconds},
                        {"bwd_seconds", bwd.median_seconds},
                        {"fwd_tflops", fwd_flops / fwd.median_seconds / 1e12},
                        {"bwd_tflops", bwd_flops / bwd.median_seconds / 1e12},
                        {"fwd_spread", fwd.max_seconds / fwd.min_seconds - 1},
                        {"bwd_spread", bwd.max_seconds / bwd.min_seconds - 1}};
    if (shard == 0) {
      whole[L] = r;
    } else {
      r["fwd_vs_whole"] = r["fwd_tflops"].get<double>() / whole[L]["fwd_tflops"].get<double>();
      r["bwd_vs_whole"] = r["bwd_tflops"].get<double>() / whole[L]["bwd_tflops"].get<double>();
    }
    progress(fmt::format("{}: forward {:.1f} TFLOP/s, backward {:.1f} TFLOP/s", r["case"].get<std::string>(),
                         r["fwd_tflops"].get<double>(), r["bwd_tflops"].get<double>()));
    results.push_back(r);
  }
  report["results"] = results;

  if (!o.profile_out.empty()) {
    std::vector<MeasuredPoint> points;
    for (const auto& [L, r] : whole) points.push_back({L, r["fwd_seconds"].get<double>(), r["bwd_seconds"].get<double>()});
    int device = o.device;
    if (device < 0) BENCH_CUDA_TRY(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    BENCH_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    const nlohmann::json j =
        measured_cuda_profile(o, attn->device_name(), today(), points, static_cast<double>(prop.totalGlobalMem));
    if (Status s = write_file_atomic(o.profile_out, j.dump(2) + "\n"); !s.is_ok()) return s;
    report["profile_out"] = o.profile_out;
  }
  return report;
}

#endif

void print_cuda_attention_report(const nlohmann::json& r) {
  fmt::print("distca CUDA attention on {} ({}, Hq {} Hkv {} D {}; {}; {})\n", r["device"].get<std::string>(),
             r["dtype"].get<std::string>(), r["heads"].get<int64_t>(), r["kv_heads"].get<int64_t>(),
             r["head_dim"].get<int64_t>(), r["flops"].get<std::string>(), r["timing"].get<std::string>());
  fmt::print("checked against the reference: passed\n");
  fmt::print("{:<34} {:>10} {:>10} {:>12} {:>12}\n", "case", "fwd TF/s", "bwd TF/s", "fwd vs whole", "bwd vs whole");
  for (const auto& x : r["results"]) {
    auto ratio = [&](const char* key) { return x.contains(key) ? fmt::format("{:.2f}", x[key].get<double>()) : std::string("-"); };
    fmt::print("{:<34} {:>10.1f} {:>10.1f} {:>12} {:>12}\n", x["case"].get<std::string>(), x["fwd_tflops"].get<double>(),
               x["bwd_tflops"].get<double>(), ratio("fwd_vs_whole"), ratio("bwd_vs_whole"));
  }
  if (r.contains("profile_out")) fmt::print("profile written to {}\n", r["profile_out"].get<std::string>());
}

}  // namespace distca::bench
