// CudnnAttention (distca/kernels/cudnn.h): the calls planned by cudnn_plan.h, each one cuDNN SDPA
// graph (cudnn-frontend) over a ragged batch whose sequences are the tasks. Graphs are cached by
// their bucketed key; per-call device memory (the offsets, the workspace, the dK/dV scratch) comes
// from the stream-ordered pool (../cuda/common/scratch.h), as CudaAttention's does.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <nvrtc.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../cuda/common/device.h"
#include "../cuda/common/elementwise.h"
#include "../cuda/common/scratch.h"
#include "cudnn_plan.h"
#include "engine_tuning.h"
#include "distca/core/cuda_status.h"
#include "distca/core/knobs.h"
#include "distca/kernels/cudnn.h"

// cudnn-frontend's experimental engines (an sm_100 RMSNorm, not attention) compile kernels at run
// time with NVRTC. SDPA never reaches them, and linking libnvrtc (110 MB) would map it into every
// process of distca's, including those run under a memory limit; so its seven entry points are
// defined here, hidden in this library, answering that NVRTC is not available.
extern "C" {
nvrtcResult nvrtcCreateProgram(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*) {
  return NVRTC_ERROR_INTERNAL_ERROR;
}
nvrtcResult nvrtcDestroyProgram(nvrtcProgram*) { return NVRTC_ERROR_INTERNAL_ERROR; }
nvrtcResult nvrtcCompileProgram(nvrtcProgram, int, const char* const*) { return NVRTC_ERROR_INTERNAL_ERROR; }
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram, size_t*) { return NVRTC_ERROR_INTERNAL_ERROR; }
nvrtcResult nvrtcGetCUBIN(nvrtcProgram, char*) { return NVRTC_ERROR_INTERNAL_ERROR; }
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram, size_t*) { return NVRTC_ERROR_INTERNAL_ERROR; }
nvrtcResult nvrtcGetProgramLog(nvrtcProgram, char*) { return NVRTC_ERROR_INTERNAL_ERROR; }
}

namespace distca::kernels {
namespace {

namespace fe = cudnn_frontend;
using cuda::Scratch;
using cudnn::Call;
using cudnn::GraphKey;
using cudnn::Plan;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor uids of the graphs (the variant pack binds pointers to them).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kSeqQ, kSeqKv, kQOff, kKvOff, kStatsOff, kDkvOff,
};

Status fe_status(fe::error_t e, const char* what) {
  if (e.is_good()) return Status::ok();
  return internal_error(fmt::format("cuDNN {} failed: {}", what, e.get_message()));
}

Status cudnn_status(cudnnStatus_t s, const char* what) {
  if (s == CUDNN_STATUS_SUCCESS) return Status::ok();
  return internal_error(fmt::format("{} failed: {}", what, cudnnGetErrorString(s)));
}

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;  // autotuning: the largest of every candidate's
  // Autotuning: the execution plan that runs (-1: the heuristics' first, graph->execute).
  int64_t plan_index = -1;
  bool tuned = false;
};

Result<Built> build_graph(cudnnHandle_t handle, const GraphKey& k, bool every_engine) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(k.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t b = k.batch;
  auto index = [&](const char* name, int64_t uid, int64_t n) {
    return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({n, 1, 1, 1})
                         .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
  };
  // [b, h, s, d] over packed THD rows: a token's heads are adjacent, its own offset per sequence
  // (none in a dense graph: its pointers are moved to the sequence's rows).
  auto shape = [&](const TensorPtr& t, int64_t h, int64_t s, int64_t d, const TensorPtr& offsets) {
    t->set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
    if (!k.dense) t->set_ragged_offset(offsets);
  };
  auto input = [&](const char* name, int64_t uid, int64_t h, int64_t s, const TensorPtr& offsets) {
    TensorPtr t = g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid));
    shape(t, h, s, k.d, offsets);
    return t;
  };
  // LSE [Tq, Hq] fp32: [b, h, s, 1] with the token stride h (head-major-lse: the head stride s).
  auto stats_shape = [&](const TensorPtr& t, const TensorPtr& offsets) {
    t->set_dim({b, k.h_q, k.s_q, 1}).set_data_type(fe::DataType_t::FLOAT);
    if (k.head_major_lse) {
      t->set_stride({k.h_q * k.s_q, k.s_q, 1, 1});
    } else {
      t->set_stride({k.s_q * k.h_q, 1, k.h_q, 1});
    }
    if (!k.dense) t->set_ragged_offset(offsets);
  };
  TensorPtr q_off, kv_off, stats_off, seq_q, seq_kv, dkv_off;
  if (!k.dense) {
    q_off = index("q_offsets", kQOff, b + 1);
    kv_off = index("kv_offsets", kKvOff, b + 1);
    stats_off = index("stats_offsets", kStatsOff, b + 1);
    seq_q = index("seq_q", kSeqQ, b);
    seq_kv = index("seq_kv", kSeqKv, b);
    if (k.backward) dkv_off = index("dkv_offsets", kDkvOff, b + 1);
  }
  const TensorPtr q = input("Q", kQ, k.h_q, k.s_q, q_off), kk = input("K", kK, k.h_kv, k.s_kv, kv_off),
                  v = input("V", kV, k.h_kv, k.s_kv, kv_off);
  if (!k.backward) {
    fe::graph::SDPA_attributes opts;
    opts.set_name("distca_sdpa").set_generate_stats(true).set_attn_scale(k.scale);
    if (!k.dense) opts.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    if (k.causal) k.top_left ? opts.set_causal_mask(true) : opts.set_causal_mask_bottom_right(true);
    auto [o, stats] = g->sdpa(q, kk, v, opts);
    o->set_output(true).set_uid(kO);
    shape(o, k.h_q, k.s_q, k.d, q_off);
    stats->set_output(true).set_uid(kStats);
    stats_shape(stats, stats_off);
  } else {
    const TensorPtr o = input("O", kO, k.h_q, k.s_q, q_off), d_o = input("dO", kDO, k.h_q, k.s_q, q_off);
    TensorPtr stats = g->tensor(fe::graph::Tensor_attributes().set_name("Stats").set_uid(kStats));
    stats_shape(stats, stats_off);
    fe::graph::SDPA_backward_attributes opts;
    opts.set_name("distca_sdpa_backward").set_attn_scale(k.scale);
    if (!k.dense) opts.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    if (k.max_total) opts.set_max_total_seq_len_q(k.total_q).set_max_total_seq_len_kv(k.total_kv);
    if (k.causal) k.top_left ? opts.set_causal_mask(true) : opts.set_causal_mask_bottom_right(true);
    auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, d_o, stats, opts);
    dq->set_output(true).set_uid(kDQ);
    shape(dq, k.h_q, k.s_q, k.d, q_off);
    dk->set_output(true).set_uid(kDK);
    shape(dk, k.h_kv, k.s_kv, k.d, dkv_off);
    dv->set_output(true).set_uid(kDV);
    shape(dv, k.h_kv, k.s_kv, k.d, dkv_off);
  }
  DISTCA_RETURN_IF_ERROR(fe_status(g->validate(), "graph validation"));
  DISTCA_RETURN_IF_ERROR(fe_status(g->build_operation_graph(handle), "operation graph"));
  // Autotuning builds every configuration the heuristics' modes A and FALLBACK return (some may
  // fail to build: they are skipped when timed); else plan 0 of mode A.
  if (every_engine) {
    DISTCA_RETURN_IF_ERROR(
        fe_status(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "execution plans"));
  } else {
    DISTCA_RETURN_IF_ERROR(fe_status(g->create_execution_plans({fe::HeurMode_t::A}), "execution plans"));
  }
  DISTCA_RETURN_IF_ERROR(fe_status(g->check_support(handle), "support check"));
  DISTCA_RETURN_IF_ERROR(fe_status(
      g->build_plans(handle, every_engine ? fe::BuildPlanPolicy_t::ALL : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE),
      "plan build"));
  Built built;
  built.graph = std::move(g);
  DISTCA_RETURN_IF_ERROR(fe_status(built.graph->get_workspace_size(built.workspace), "workspace size"));
  if (every_engine) {
    for (int64_t i = 0; i < built.graph->get_execution_plan_count(); ++i) {
      int64_t w = 0;
      if (built.graph->get_workspace_size_plan_at_index(i, w).is_good()) built.workspace = std::max(built.workspace, w);
    }
  }
  return built;
}

// Times one execution plan on the handle's stream: a warm-up, then the fastest of three runs.
Result<double> time_plan(cudnnHandle_t handle, const fe::graph::Graph& g, std::unordered_map<int64_t, void*>& ptrs,
                         void* workspace, int64_t index) {
  cudaStream_t stream = nullptr;
  if (cudnnGetStream(handle, &stream) != CUDNN_STATUS_SUCCESS) return internal_error("cudnnGetStream failed");
  if (fe::error_t e = g.execute_plan_at_index(handle, ptrs, workspace, index); !e.is_good()) {
    return internal_error(e.get_message());
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  DISTCA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  DISTCA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  double best = -1;
  Status failed = Status::ok();
  for (int run = 0; run < 3 && failed.is_ok(); ++run) {
    float ms = 0;
    if (cudaEventRecord(start, stream) != cudaSuccess) failed = internal_error("cudaEventRecord failed");
    if (failed.is_ok()) {
      if (fe::error_t e = g.execute_plan_at_index(handle, ptrs, workspace, index); !e.is_good()) failed = internal_error(e.get_message());
    }
    if (failed.is_ok() && (cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess ||
                           cudaEventElapsedTime(&ms, start, stop) != cudaSuccess)) {
      failed = internal_error("timing with CUDA events failed");
    }
    if (failed.is_ok() && (best < 0 || ms < best)) best = ms;
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  if (!failed.is_ok()) return failed;
  return best;
}

std::string key_text(const GraphKey& k) {
  return fmt::format("{}{} {} {} batch {} s_q {} s_kv {} heads {}/{} d {}{}{}",
                     k.dense ? (k.head_major_lse ? "dense (head-major LSE) " : "dense ") : "",
                     k.backward ? "backward" : "forward",
                     k.causal ? (k.top_left ? "causal (top-left)" : "causal") : "non-causal", k.bf16 ? "bf16" : "fp16",
                     k.batch, k.s_q, k.s_kv, k.h_q, k.h_kv, k.d, k.backward ? " total " : "",
                     k.backward ? (k.max_total ? fmt::format("{}/{}", k.total_q, k.total_kv) : std::string("unset")) : "");
}

}  // namespace

bool cudnn_built() { return true; }

std::string cudnn_version() {
  const size_t v = cudnnGetVersion();  // e.g. 91900
  return fmt::format("cuDNN {}.{}.{} (frontend {}.{}.{})", v / 10000, v / 100 % 100, v % 100,
                     CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION, CUDNN_FRONTEND_PATCH_VERSION);
}

struct CudnnAttention::State {
  int device = 0;
  std::string name;
  cudnnHandle_t handle = nullptr;
  cudnn::GraphVariants variants;  // DISTCA_CUDNN_GRAPH
  mutable std::mutex mutex;  // the handle, the cache and the stats
  std::unordered_map<GraphKey, Built, cudnn::GraphKeyHash> graphs;
  CudnnGraphStats stats;
  // DISTCA_CUDNN_AUTOTUNE: every engine configuration timed on a key's first use (engine_tuning.h).
  bool autotune = false;
  double autotune_cap_seconds = 0.5;  // DISTCA_CUDNN_AUTOTUNE_MS
  cudnn::EngineCache engines;         // DISTCA_CUDNN_ENGINE_CACHE (no path: remembered in this process only)

  ~State() {
    if (handle) (void)cudnnDestroy(handle);
  }

  Result<Built*> graph(const GraphKey& key) {
    if (auto it = graphs.find(key); it != graphs.end()) return &it->second;
    const auto start = std::chrono::steady_clock::now();
    Result<Built> built = build_graph(handle, key, autotune);
    if (!built.is_ok()) {
      return Status(built.status().code(), fmt::format("{} (graph: {})", built.status().message(), key_text(key)));
    }
    stats.build_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++stats.graphs_built;
    return &graphs.emplace(key, std::move(built).value()).first->second;
  }

  // Runs one planned call: `ptrs` binds the data tensors; the call's lengths and offsets are uploaded
  // (a dense call's pointers move to its one sequence's rows instead).
  Status run(const Call& call, std::unordered_map<int64_t, void*> ptrs, Scratch& scratch) {
    Result<Built*> built = graph(call.key);
    if (!built.is_ok()) return built.status();
    void* workspace = nullptr;
    if (built.value()->workspace > 0) {
      Result<char*> ws = scratch.alloc<char>(built.value()->workspace);
      if (!ws.is_ok()) return ws.status();
      workspace = ws.value();
    }
    ++stats.calls;
    if (call.key.dense) {
      auto move = [&ptrs](int64_t uid, int64_t elements, int64_t bytes) {
        if (auto it = ptrs.find(uid); it != ptrs.end()) it->second = static_cast<char*>(it->second) + elements * bytes;
      };
      for (int64_t uid : {kQ, kO, kDO, kDQ}) move(uid, call.q_off[0], 2);
      for (int64_t uid : {kK, kV}) move(uid, call.kv_off[0], 2);
      if (call.key.backward) {
        for (int64_t uid : {kDK, kDV}) move(uid, call.dkv_off[0], 2);
      }
      move(kStats, call.stats_off[0], 4);
      if (!call.key.head_major_lse) return execute(*built.value(), call.key, ptrs, workspace);
      // The LSE rows [s, h] of the sequence through an [h, s] buffer: in before the backward, out
      // after the forward.
      auto* rows = static_cast<float*>(ptrs[kStats]);
      const int64_t s = call.key.s_q, h = call.key.h_q;
      Result<float*> head_major = scratch.alloc<float>(s * h);
      if (!head_major.is_ok()) return head_major.status();
      if (call.key.backward) {
        DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_transpose_f32(rows, head_major.value(), s, h, scratch.stream()));
      }
      ptrs[kStats] = head_major.value();
      DISTCA_RETURN_IF_ERROR(execute(*built.value(), call.key, ptrs, workspace));
      if (!call.key.backward) {
        DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_transpose_f32(head_major.value(), rows, h, s, scratch.stream()));
      }
      return Status::ok();
    }
    std::vector<int32_t> ints;
    for (const auto* part : {&call.seq_q, &call.seq_kv, &call.q_off, &call.kv_off, &call.stats_off, &call.dkv_off}) {
      ints.insert(ints.end(), part->begin(), part->end());
    }
    Result<const int32_t*> device_ints = scratch.upload(ints);
    if (!device_ints.is_ok()) return device_ints.status();
    auto* at = const_cast<int32_t*>(device_ints.value());
    const int64_t b = call.key.batch;
    ptrs[kSeqQ] = at;
    ptrs[kSeqKv] = at + b;
    ptrs[kQOff] = at + 2 * b;
    ptrs[kKvOff] = at + 3 * b + 1;
    ptrs[kStatsOff] = at + 4 * b + 2;
    if (call.key.backward) ptrs[kDkvOff] = at + 5 * b + 3;
    return execute(*built.value(), call.key, ptrs, workspace);
  }

  // Runs the graph: the heuristics' plan, or with autotuning the key's chosen one (from the cache,
  // when its name there is the name of the plan at that index; else timed now on these tensors,
  // whose outputs the real run below then writes again).
  Status execute(Built& built, const GraphKey& key, std::unordered_map<int64_t, void*>& ptrs, void* workspace) {
    if (autotune && !built.tuned) {
      built.tuned = true;
      const std::string text = key_text(key);
      const int64_t count = built.graph->get_execution_plan_count();
      auto name = [&](int64_t i) {
        std::string n;
        return built.graph->get_plan_name_at_index(i, n).is_good() ? n : fmt::format("plan {}", i);
      };
      std::optional<cudnn::EngineChoice> choice = engines.find(text);
      if (choice && (choice->index >= count || name(choice->index) != choice->name)) choice.reset();
      if (!choice) {
        const auto start = std::chrono::steady_clock::now();
        auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
        Result<cudnn::EngineChoice> timed = cudnn::choose_engine(
            count, name, [&](int64_t i) { return time_plan(handle, *built.graph, ptrs, workspace, i); },
            autotune_cap_seconds, seconds);
        stats.autotune_seconds += seconds();
        if (!timed.is_ok()) return Status(timed.status().code(), fmt::format("{} (graph: {})", timed.status().message(), text));
        choice = timed.value();
        engines.put(text, *choice);
        if (Status saved = engines.save(); !saved.is_ok()) fmt::print(stderr, "distca: {}\n", saved.message());
      }
      built.plan_index = choice->index;
      stats.engines.emplace_back(text, choice->name);
    }
    if (built.plan_index >= 0) {
      return fe_status(built.graph->execute_plan_at_index(handle, ptrs, workspace, built.plan_index), "SDPA execution");
    }
    return fe_status(built.graph->execute(handle, ptrs, workspace), "SDPA execution");
  }
};

CudnnAttention::CudnnAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudnnAttention::~CudnnAttention() = default;

Result<std::unique_ptr<CudnnAttention>> CudnnAttention::create(int device) {
  Result<cuda::DeviceInfo> opened = cuda::open_device(device, "cuDNN's fused attention needs");
  if (!opened.is_ok()) return opened.status();
  device = opened.value().device;
  CudaDeviceScope scope(device);
  if (!scope.status().is_ok()) return scope.status();
  auto state = std::make_unique<State>();
  state->device = device;
  state->name = opened.value().name;
  const char* variants = knob("DISTCA_CUDNN_GRAPH");
  Result<cudnn::GraphVariants> parsed = cudnn::parse_graph_variants(variants ? variants : "");
  if (!parsed.is_ok()) return parsed.status();
  state->variants = parsed.value();
  DISTCA_ASSIGN_OR_RETURN(state->autotune, cudnn::parse_autotune(knob("DISTCA_CUDNN_AUTOTUNE")));
  DISTCA_ASSIGN_OR_RETURN(state->autotune_cap_seconds, cudnn::parse_autotune_ms(knob("DISTCA_CUDNN_AUTOTUNE_MS")));
  if (state->autotune) {
    const char* path = knob("DISTCA_CUDNN_ENGINE_CACHE");
    std::string warning;
    state->engines = cudnn::EngineCache::load(path ? path : "", state->name, cudnn_version(), &warning);
    if (!warning.empty()) fmt::print(stderr, "distca: {}\n", warning);
  }
  DISTCA_RETURN_IF_ERROR(cudnn_status(cudnnCreate(&state->handle), "cudnnCreate"));
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(state)));
}

int CudnnAttention::device() const { return state_->device; }
std::string CudnnAttention::device_name() const { return state_->name; }
CudnnGraphStats CudnnAttention::graph_stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->stats;
}

Status CudnnAttention::forward(const CudaFwdArgs& a, void* stream_ptr) {
  DISTCA_RETURN_IF_ERROR(validate(a));
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const AttnDims& d = a.dims;
  const bool bf16 = a.dtype == CudaDType::kBf16;
  cudnn::PlanOptions options;
  options.bf16 = bf16;
  options.scale = softmax_scale(d, a.scale);
  options.variants = state_->variants;
  Result<Plan> plan = cudnn::plan_calls(d, a.tasks, options);
  if (!plan.is_ok()) return plan.status();
  std::lock_guard lock(state_->mutex);
  CudaDeviceScope scope(state_->device);
  if (!scope.status().is_ok()) return scope.status();
  auto* o = static_cast<uint16_t*>(a.o);
  for (const auto& [begin, end] : plan.value().empty_q_rows) {
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_fill_rows(o, a.lse, begin, end, d.num_q_heads * d.head_dim,
                                                       static_cast<int>(d.num_q_heads), stream));
  }
  if (plan.value().calls.empty()) return Status::ok();
  DISTCA_RETURN_IF_ERROR(cudnn_status(cudnnSetStream(state_->handle, stream), "cudnnSetStream"));
  Scratch scratch(stream);
  for (const Call& call : plan.value().calls) {
    DISTCA_RETURN_IF_ERROR(state_->run(call,
                                       {{kQ, const_cast<void*>(a.q)}, {kK, const_cast<void*>(a.k)},
                                        {kV, const_cast<void*>(a.v)}, {kO, a.o}, {kStats, a.lse}},
                                       scratch));
  }
  return Status::ok();
}

Status CudnnAttention::backward(const CudaBwdArgs& a, void* stream_ptr) {
  DISTCA_RETURN_IF_ERROR(validate(a));
  if (a.d_lse) {
    return invalid_argument("the cudnn kernel takes no d_lse (cuDNN's backward has no LSE gradient input): pass the "
                            "merged O and LSE, or use the distca kernel");
  }
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const AttnDims& d = a.dims;
  const bool bf16 = a.dtype == CudaDType::kBf16;
  const int64_t q_row = d.num_q_heads * d.head_dim, kv_row = d.num_kv_heads * d.head_dim;
  const int64_t kv_elems = d.num_kv_rows * kv_row;
  cudnn::PlanOptions options;
  options.backward = true;
  options.bf16 = bf16;
  options.scale = softmax_scale(d, a.scale);
  options.dkv_fp32 = a.dkv_fp32;
  options.variants = state_->variants;
  Result<Plan> planned = cudnn::plan_calls(d, a.tasks, options);
  if (!planned.is_ok()) return planned.status();
  const Plan& plan = planned.value();
  std::lock_guard lock(state_->mutex);
  CudaDeviceScope scope(state_->device);
  if (!scope.status().is_ok()) return scope.status();
  // Rows no call writes get 0: dQ of empty query rows, dK/dV of unread rows (in place) or all of
  // the fp32 sums (through scratch).
  for (const auto& [begin, end] : plan.empty_q_rows) {
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(static_cast<uint16_t*>(a.dq) + begin * q_row, 0,
                                                static_cast<size_t>((end - begin) * q_row) * 2, stream));
  }
  for (const auto& [begin, end] : plan.empty_kv_rows) {
    for (void* out : {a.dk, a.dv}) {
      DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(static_cast<uint16_t*>(out) + begin * kv_row, 0,
                                                  static_cast<size_t>((end - begin) * kv_row) * 2, stream));
    }
  }
  Scratch scratch(stream);
  void* dk_rows = a.dk;
  void* dv_rows = a.dv;
  if (plan.kv_scratch) {
    Result<uint16_t*> k_rows = scratch.alloc<uint16_t>(plan.kv_scratch_rows * kv_row),
                      v_rows = scratch.alloc<uint16_t>(plan.kv_scratch_rows * kv_row);
    if (!k_rows.is_ok()) return k_rows.status();
    if (!v_rows.is_ok()) return v_rows.status();
    dk_rows = k_rows.value();
    dv_rows = v_rows.value();
  }
  // The fp32 sums of the tasks' dK/dV rows: the caller's buffers when it wants fp32, else scratch
  // rounded once into them. Each call's scratch rows are added right after it (stream order), so
  // the next call may reuse them.
  float* k_acc = a.dkv_fp32 ? static_cast<float*>(a.dk) : nullptr;
  float* v_acc = a.dkv_fp32 ? static_cast<float*>(a.dv) : nullptr;
  const bool sums = plan.kv_scratch && kv_elems > 0;
  if (sums) {
    if (!a.dkv_fp32) {
      Result<float*> k = scratch.alloc<float>(kv_elems), v = scratch.alloc<float>(kv_elems);
      if (!k.is_ok()) return k.status();
      if (!v.is_ok()) return v.status();
      k_acc = k.value();
      v_acc = v.value();
    }
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(k_acc, 0, static_cast<size_t>(kv_elems) * 4, stream));
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(v_acc, 0, static_cast<size_t>(kv_elems) * 4, stream));
  }
  if (!plan.calls.empty()) DISTCA_RETURN_IF_ERROR(cudnn_status(cudnnSetStream(state_->handle, stream), "cudnnSetStream"));
  for (const Call& call : plan.calls) {
    DISTCA_RETURN_IF_ERROR(state_->run(
        call,
        {{kQ, const_cast<void*>(a.q)}, {kK, const_cast<void*>(a.k)}, {kV, const_cast<void*>(a.v)},
         {kO, const_cast<void*>(a.o)}, {kDO, const_cast<void*>(a.d_o)}, {kStats, const_cast<float*>(a.lse)},
         {kDQ, a.dq}, {kDK, dk_rows}, {kDV, dv_rows}},
        scratch));
    if (!sums || call.add_spans.empty()) continue;
    std::vector<int64_t> spans;
    int64_t max_rows = 0;
    for (const cudnn::AddSpan& s : call.add_spans) {
      spans.insert(spans.end(), {s.src_row, s.dst_row, s.rows});
      max_rows = std::max(max_rows, s.rows);
    }
    Result<const int64_t*> device_spans = scratch.upload(spans);
    if (!device_spans.is_ok()) return device_spans.status();
    const auto n = static_cast<int64_t>(call.add_spans.size());
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_add_rows(static_cast<const uint16_t*>(dk_rows), k_acc, device_spans.value(), n,
                                                      max_rows, kv_row, bf16, stream));
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_add_rows(static_cast<const uint16_t*>(dv_rows), v_acc, device_spans.value(), n,
                                                      max_rows, kv_row, bf16, stream));
  }
  if (!sums) return Status::ok();
  if (!a.dkv_fp32) {
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_finalize(k_acc, static_cast<uint16_t*>(a.dk), 1.f, kv_elems, bf16, stream));
    DISTCA_CUDA_RETURN_IF_ERROR(cuda::launch_finalize(v_acc, static_cast<uint16_t*>(a.dv), 1.f, kv_elems, bf16, stream));
  }
  return Status::ok();
}

}  // namespace distca::kernels
