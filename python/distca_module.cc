// The distca Python module's native part (_distca): thin bindings over the plan, layout and sim
// layers and the CPU and CUDA attention kernels (on raw addresses, and for CUDA a stream handle: no
// PyTorch or CUDA headers here). Every check, plan, layout and report is the C++ one (docs/design.md §3:
// python adds no logic of its own); this file only converts: Python lists and NumPy arrays in,
// NumPy arrays and JSON text out, and a Status that is not ok into ValueError (bad input) or
// RuntimeError (a broken invariant). Long calls run without the GIL, and the planner and the
// simulator can be interrupted (run_interruptible).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "distca/core/file.h"
#include "distca/core/json.h"
#include "distca/core/knobs.h"
#include "distca/kernels/cpu.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"
#include "distca/kernels/registry.h"
#include "distca/plan/batch.h"
#include "distca/plan/pipeline_schedule.h"
#include "distca/plan/plan_io.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/layout/exchange.h"
#include "distca/layout/route.h"
#include "distca/layout/task_split.h"
#include "distca/facade/plan_request.h"
#include "distca/sim/profile.h"
#include "distca/facade/sim_request.h"

namespace py = pybind11;
using namespace distca;

namespace {

// Bad input (what the command line answers with exit 2: malformed, out of range, not found, a
// request no plan or configuration can satisfy) is ValueError; kInternal, a broken invariant or a
// failed dependency, RuntimeError.
[[noreturn]] void raise(const Status& s) {
  if (s.code() == StatusCode::kInternal) throw std::runtime_error(s.message());
  throw py::value_error(s.message());
}
void check(const Status& s) {
  if (!s.is_ok()) raise(s);
}
template <typename T>
T take(Result<T> r) {
  if (!r.is_ok()) raise(r.status());
  return std::move(r).value();
}

py::array_t<int64_t> array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}
py::array_t<double> array(const std::vector<double>& v) {
  py::array_t<double> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}
// The same without a copy: the array takes over `v`'s memory (a capsule owns the vector). A
// rank's exchange layout at 512 ranks holds about a million rows.
py::array_t<int64_t> array(std::vector<int64_t>&& v) {
  if (v.empty()) return py::array_t<int64_t>(0);
  auto* owned = new std::vector<int64_t>(std::move(v));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  return py::array_t<int64_t>(static_cast<py::ssize_t>(owned->size()), owned->data(), owner);
}
// rows x cols int64, row-major.
py::array_t<int64_t> matrix(const std::vector<int64_t>& v, py::ssize_t cols) {
  const py::ssize_t rows = cols > 0 ? static_cast<py::ssize_t>(v.size()) / cols : 0;
  py::array_t<int64_t> a({rows, cols});
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

std::string dump(const nlohmann::json& j) { return j.dump(); }

// (tasks, 6): doc, q0, q1, k0, k1, server.
py::array_t<int64_t> task_matrix(const std::vector<plan::Task>& tasks) {
  std::vector<int64_t> v;
  v.reserve(tasks.size() * 6);
  for (const plan::Task& t : tasks) v.insert(v.end(), {t.doc, t.q0, t.q1, t.k0, t.k1, t.server});
  return matrix(v, 6);
}

using TaskRows = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// (n, 6) rows of doc, q0, q1, k0, k1, server as plan tasks (a doc or server past int32 is refused
// here; every other check is the C++ callee's).
std::vector<plan::Task> plan_tasks(const TaskRows& tasks) {
  if (tasks.ndim() != 2 || tasks.shape(1) != 6) {
    throw py::value_error("tasks must be an (n, 6) array of (doc, q0, q1, k0, k1, server) rows");
  }
  std::vector<plan::Task> list(static_cast<size_t>(tasks.shape(0)));
  const int64_t* t = tasks.data();
  for (plan::Task& task : list) {
    if (t[0] < 0 || t[0] > INT32_MAX || t[5] < 0 || t[5] > INT32_MAX) {
      throw py::value_error(fmt::format("task doc {} or server {} out of range", t[0], t[5]));
    }
    task = {static_cast<int32_t>(t[0]), t[1], t[2], t[3], t[4], static_cast<int32_t>(t[5])};
    t += 6;
  }
  return list;
}

// Runs `work` on a thread of its own while this one waits without the GIL, waking every 20 ms to
// run Python's signal handlers: Ctrl-C raises KeyboardInterrupt at once (or whatever a handler
// raises). The C++ planners and simulator have no cancellation point, so interrupted work runs on
// to its end on its detached thread and its result is dropped: `work` must own everything it
// touches (captures by value and shared_ptr, no Python object). Its exceptions (py::value_error
// from take()) are raised here.
template <typename Work>
std::invoke_result_t<Work> run_interruptible(Work work) {
  using R = std::invoke_result_t<Work>;
  auto task = std::make_shared<std::packaged_task<R()>>(std::move(work));
  std::future<R> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  while (true) {
    {
      py::gil_scoped_release release;
      if (done.wait_for(std::chrono::milliseconds(20)) == std::future_status::ready) break;
    }
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
  return done.get();
}

// A rank argument: ValueError outside [0, num_ranks) (a Python int of any size arrives here).
int32_t rank_in(int64_t rank, int32_t num_ranks) {
  if (rank < 0 || rank >= num_ranks) {
    throw py::value_error(fmt::format("rank {} outside the plan's {} ranks", rank, num_ranks));
  }
  return static_cast<int32_t>(rank);
}

// The plan of one policy on one batch, as distca plan makes it. The report's extras (the
// colocated baseline, verification, layer times) are computed when first asked for, so that a
// training loop that plans every step pays for the planner alone.
struct PyPlan {
  std::shared_ptr<const plan::Batch> batch;
  sim::Profile profile;
  facade::PlanRun run;
  bool is_complete = false;
  double native_ms = 0;  // the C++ side of the call: checks, cost model, link, planning

  const plan::Plan& plan() const { return run.runs.front().plan; }
  const facade::PlanRun& complete() {
    if (!is_complete) {
      facade::complete_plan_run(run, *batch, profile);
      is_complete = true;
    }
    return run;
  }
};

// A plan file read back (load_plan): its batch and its plan, re-verified and hash-checked.
struct PyLoadedPlan {
  std::shared_ptr<plan::Batch> batch;
  plan::Plan plan;
  std::string model;
};

PyPlan make_plan(std::shared_ptr<plan::Batch> batch, const facade::PlanRequest& request, const std::string& profile_path) {
  const auto start = std::chrono::steady_clock::now();
  if (request.policy == "all") {
    throw py::value_error("distca.plan makes one plan: pick one policy (none, distca, minmax, minbytes or minlink), not all");
  }
  check(request.validate());
  sim::Profile profile = profile_path.empty() ? sim::default_h200_profile() : take(sim::load_profile(profile_path));
  facade::PlanRun run = take(facade::prepare_plan_run(request, *batch, profile));
  run.runs.push_back(facade::plan_policy(run, *batch, take(plan::find_planner(request.policy)), profile));
  PyPlan p{std::move(batch), std::move(profile), std::move(run)};
  p.native_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return p;
}

// The plan's traffic, with each phase's flows counted again (plans do not hold them: plan.h).
py::dict traffic_dict(const plan::Batch& batch, const plan::CostModel& cost, const plan::Plan& plan) {
  const plan::Traffic& t = plan.traffic;
  py::dict phases;
  for (int i = 0; i < plan::kNumPhases; ++i) {
    const plan::PhaseTraffic& p = t.phases[i];
    std::vector<int64_t> flows;
    for (const plan::Flow& f : plan::count_flows(batch, cost.token_bytes(), plan.tasks, static_cast<plan::Phase>(i))) {
      flows.insert(flows.end(), {f.src, f.dst, f.bytes});
    }
    py::dict d;
    d["flows"] = matrix(flows, 3);
    d["total_bytes"] = p.total_bytes;
    d["send_bytes"] = array(p.send_bytes);
    d["recv_bytes"] = array(p.recv_bytes);
    phases[plan::phase_name(static_cast<plan::Phase>(i))] = d;
  }
  return phases;
}

py::dict layout_dict(layout::ExchangeLayout&& x) {
  py::dict d;
  d["rank"] = x.rank;
  d["num_ranks"] = x.num_ranks;
  d["num_local_rows"] = x.num_local_rows;
  d["q_send_index"] = array(std::move(x.q_send_index));
  d["q_send_splits"] = array(std::move(x.q_send_splits));
  d["kv_send_index"] = array(std::move(x.kv_send_index));
  d["kv_send_splits"] = array(std::move(x.kv_send_splits));
  d["copy_entries"] = array(std::move(x.copy_entries));
  d["copy_rows"] = array(std::move(x.copy_rows));
  d["merge_entries"] = array(std::move(x.merge_entries));
  d["merge_rows"] = array(std::move(x.merge_rows));
  d["q_recv_splits"] = array(std::move(x.q_recv_splits));
  d["kv_recv_splits"] = array(std::move(x.kv_recv_splits));
  d["q_gather"] = array(std::move(x.q_gather));
  d["kv_gather"] = array(std::move(x.kv_gather));
  d["causal_q_rows"] = x.causal_q_rows;
  d["causal_kv_rows"] = x.causal_kv_rows;
  for (const auto& [name, g] : {std::pair{"causal", &x.causal}, std::pair{"noncausal", &x.noncausal}}) {
    py::dict v;
    v["cu_seqlens_q"] = array(std::move(g->cu_seqlens_q));
    v["cu_seqlens_k"] = array(std::move(g->cu_seqlens_k));
    v["max_seqlen_q"] = g->max_seqlen_q;
    v["max_seqlen_k"] = g->max_seqlen_k;
    d[name] = v;
  }
  return d;
}

// The exchange layout of the route `build()` makes, as a dict; the route and the layout are built
// without the GIL.
template <typename Build>
py::dict layout_of(Build build) {
  std::optional<layout::ExchangeLayout> exchange;
  Status status;
  {
    py::gil_scoped_release release;
    Result<layout::Route> route = build();
    if (route.is_ok()) {
      exchange = layout::exchange_layout(route.value());
    } else {
      status = route.status();
    }
  }
  if (!exchange) raise(status);
  return layout_dict(std::move(*exchange));
}

// distca.torch's nano-batch split (layout/task_split.h), computed without the GIL: parts as
// (n, 6) task matrices, the rest as numbers.
py::dict attention_task_split(const plan::Batch& batch, const TaskRows& tasks, double tolerance, double kv_budget) {
  const std::vector<plan::Task> list = plan_tasks(tasks);
  const layout::TaskSplit s = take([&] {
    py::gil_scoped_release release;
    return layout::split_attention_tasks(batch, list, {.tolerance = tolerance, .kv_budget = kv_budget});
  }());
  py::list parts, travel_rows;
  for (const std::vector<plan::Task>& part : s.parts) parts.append(task_matrix(part));
  for (const auto& [q, kv] : s.travel_rows) travel_rows.append(py::make_tuple(q, kv));
  py::dict d;
  d["parts"] = parts;
  d["cap"] = s.cap;
  d["level"] = s.level;
  d["num_cuts"] = s.num_cuts;
  d["extra_kv_rows"] = s.extra_kv_rows;
  d["remote_kv_rows"] = s.remote_kv_rows;
  d["travel_rows"] = py::tuple(travel_rows);
  d["busiest"] = py::make_tuple(s.busiest[0], s.busiest[1]);
  d["over"] = s.over;
  return d;
}

// Rank `rank`'s exchange layout of a plan's tasks.
py::dict rank_layout(const plan::Batch& batch, const std::vector<plan::Task>& tasks, int64_t rank) {
  const int32_t r = rank_in(rank, batch.num_ranks);
  return layout_of([&] { return layout::build_route(batch, tasks, r); });
}

plan::Batch batch_from_pieces(const std::vector<int64_t>& doc_lengths, py::array_t<int64_t, py::array::c_style | py::array::forcecast> pieces,
                              int64_t tokens_per_rank, int64_t num_ranks) {
  if (pieces.ndim() != 2 || pieces.shape(1) != 4) {
    throw py::value_error("pieces must be an (n, 4) array of (doc, begin, end, rank) rows");
  }
  if (pieces.shape(0) == 0) throw py::value_error("pieces: a batch needs at least one piece");
  if (tokens_per_rank < 0 || tokens_per_rank > plan::kMaxTokens) {
    throw py::value_error(fmt::format("tokens_per_rank must be in [0, {}] (0: the fullest rank's tokens), got {}",
                                      plan::kMaxTokens, tokens_per_rank));
  }
  if (num_ranks < 0 || num_ranks > 1'000'001) {
    throw py::value_error(fmt::format("num_ranks must be in [0, 1000001] (0: one past the highest rank a piece names), got {}",
                                      num_ranks));
  }
  plan::Batch b;
  b.doc_lengths = doc_lengths;
  const int64_t* p = pieces.data();
  int64_t max_rank = -1;
  for (py::ssize_t i = 0; i < pieces.shape(0); ++i, p += 4) {
    if (p[0] < 0 || p[0] >= static_cast<int64_t>(doc_lengths.size()) || p[3] < 0 || p[3] > 1'000'000) {
      throw py::value_error(fmt::format("piece {}: doc {} must be in [0, {}) and rank {} in [0, 1000000]", i, p[0],
                                        doc_lengths.size(), p[3]));
    }
    // Positions within a document's possible length, so that summing them cannot overflow.
    if (p[1] < 0 || p[2] <= p[1] || p[2] > plan::kMaxTokens) {
      throw py::value_error(fmt::format("piece {}: [begin, end) = [{}, {}) must be a non-empty range within [0, {}]", i,
                                        p[1], p[2], plan::kMaxTokens));
    }
    if (num_ranks > 0 && p[3] >= num_ranks) {
      throw py::value_error(fmt::format("piece {}: rank {} is outside the batch's {} ranks (num_ranks)", i, p[3], num_ranks));
    }
    b.pieces.push_back({static_cast<int32_t>(p[0]), p[1], p[2], static_cast<int32_t>(p[3])});
    max_rank = std::max(max_rank, p[3]);
  }
  // num_ranks > 0: ranks past the last that holds a piece hold nothing (they serve only).
  b.num_ranks = static_cast<int32_t>(num_ranks > 0 ? num_ranks : max_rank + 1);
  std::vector<int64_t> held(b.num_ranks, 0);
  for (const plan::Piece& piece : b.pieces) held[piece.rank] += piece.length();
  b.tokens_per_rank = tokens_per_rank > 0 ? tokens_per_rank : std::max<int64_t>(1, *std::max_element(held.begin(), held.end()));
  b.index();
  check(b.validate());
  return b;
}

py::dict batch_dict(const plan::Batch& b) {
  std::vector<int64_t> pieces;
  for (const plan::Piece& p : b.pieces) pieces.insert(pieces.end(), {p.doc, p.begin, p.end, p.rank});
  py::dict d;
  d["num_ranks"] = b.num_ranks;
  d["tokens_per_rank"] = b.tokens_per_rank;
  d["doc_lengths"] = array(b.doc_lengths);
  d["pieces"] = matrix(pieces, 4);
  return d;
}

// The CPU attention kernels on caller-owned memory: addresses (Python ints, e.g. a tensor's
// data_ptr()) of packed THD arrays whose sizes the dims imply. The C++ side checks the dims, the
// tasks and non-null addresses (kernels::validate); that each address holds the elements the dims
// imply, of the dtype named, contiguous, is the caller's promise (distca.torch checks its tensors
// before it calls). The GIL is released while the kernel runs; calls on one object serialize.
struct PyCpuAttention {
  explicit PyCpuAttention(int num_threads, std::string isa) : attn({.num_threads = num_threads, .isa = std::move(isa)}) {}
  kernels::CpuAttention attn;
  std::mutex mu;
};

using TaskArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Dims = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

// (n, 5) rows of q_offset, q_len, kv_offset, kv_len, is_causal (0 or 1).
std::vector<kernels::AttnTask> attn_tasks(const TaskArray& tasks) {
  if (tasks.ndim() != 2 || tasks.shape(1) != 5) {
    throw py::value_error("tasks must be an (n, 5) int64 array of (q_offset, q_len, kv_offset, kv_len, is_causal) rows");
  }
  std::vector<kernels::AttnTask> list(static_cast<size_t>(tasks.shape(0)));
  const int64_t* t = tasks.data();
  for (size_t i = 0; i < list.size(); ++i, t += 5) {
    if (t[4] != 0 && t[4] != 1) throw py::value_error(fmt::format("task {}: is_causal must be 0 or 1, got {}", i, t[4]));
    list[i] = {t[0], t[1], t[2], t[3], t[4] == 1};
  }
  return list;
}

kernels::AttnDims attn_dims(const Dims& d) {
  return {std::get<0>(d), std::get<1>(d), std::get<2>(d), std::get<3>(d), std::get<4>(d)};
}

bool is_bf16(const std::string& dtype) {
  if (dtype == "float32") return false;
  if (dtype == "bfloat16") return true;
  throw py::value_error(fmt::format("dtype must be float32 or bfloat16, got {:?}", dtype));
}

template <typename T>
const T* in(uintptr_t address) { return reinterpret_cast<const T*>(address); }
template <typename T>
T* out(uintptr_t address) { return reinterpret_cast<T*>(address); }

template <typename T>
Status attention_forward(PyCpuAttention& self, const kernels::AttnDims& dims, std::span<const kernels::AttnTask> tasks,
                         std::optional<float> scale, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse) {
  kernels::AttnFwdParams<T> p;
  p.dims = dims;
  p.q = in<T>(q);
  p.k = in<T>(k);
  p.v = in<T>(v);
  p.tasks = tasks;
  p.scale = scale;
  p.o = out<T>(o);
  p.lse = out<float>(lse);
  std::lock_guard<std::mutex> lock(self.mu);
  return self.attn.forward(p);
}

template <typename T>
Status attention_backward(PyCpuAttention& self, const kernels::AttnDims& dims, std::span<const kernels::AttnTask> tasks,
                          std::optional<float> scale, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse,
                          uintptr_t d_o, uintptr_t dq, uintptr_t dk, uintptr_t dv) {
  kernels::AttnBwdParams<T> p;
  p.dims = dims;
  p.q = in<T>(q);
  p.k = in<T>(k);
  p.v = in<T>(v);
  p.o = in<T>(o);
  p.lse = in<float>(lse);
  p.d_o = in<T>(d_o);
  p.tasks = tasks;
  p.scale = scale;
  p.dq = out<T>(dq);
  p.dk = out<T>(dk);
  p.dv = out<T>(dv);
  std::lock_guard<std::mutex> lock(self.mu);
  return self.attn.backward(p);
}

// Converts the arguments (under the GIL), runs `pass(dims, tasks, is_bf16)` with the GIL released,
// and raises its Status.
template <typename Pass>
void run_attention(const TaskArray& tasks, const Dims& dims, const std::string& dtype, const Pass& pass) {
  const std::vector<kernels::AttnTask> list = attn_tasks(tasks);
  const kernels::AttnDims d = attn_dims(dims);
  const bool is_b16 = is_bf16(dtype);
  Status st;
  {
    py::gil_scoped_release release;
    st = pass(d, std::span<const kernels::AttnTask>(list), is_b16);
  }
  check(st);
}

// The CUDA attention kernels (kernels::CudaAttention) on caller-owned device memory: addresses of
// packed THD arrays on the object's device and a cudaStream_t as an int (a torch stream's
// cuda_stream; 0 is the legacy default stream). The call only enqueues work: outputs are ready when
// the stream reaches them. The C++ side checks dims, tasks, head dim, null and misaligned
// addresses before it launches anything; that each address holds what the dims imply on the
// current device is the caller's promise. The GIL is released while it launches; calls on one
// object serialize (its schedule buffers are per object).
struct PyCudaAttention {
  std::unique_ptr<kernels::CudaAttention> attn;
  std::mutex mu;
};

kernels::CudaDType cuda_dtype(const std::string& dtype) {
  if (dtype == "bfloat16") return kernels::CudaDType::kBf16;
  if (dtype == "float16") return kernels::CudaDType::kFp16;
  throw py::value_error(fmt::format("dtype must be bfloat16 or float16 (the CUDA kernels' storage types), got {:?}", dtype));
}

// Converts the arguments (under the GIL), runs `pass(dims, tasks, dtype)` with the GIL released
// and the object's lock held, and raises its Status.
template <typename Pass>
void run_cuda_attention(PyCudaAttention& self, const TaskArray& tasks, const Dims& dims, const std::string& dtype,
                        const Pass& pass) {
  const std::vector<kernels::AttnTask> list = attn_tasks(tasks);
  const kernels::AttnDims d = attn_dims(dims);
  const kernels::CudaDType t = cuda_dtype(dtype);
  Status st;
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mu);
    st = pass(d, std::span<const kernels::AttnTask>(list), t);
  }
  check(st);
}

}  // namespace

PYBIND11_MODULE(_distca, m) {
  m.doc() = "distca's native part: planners, plan verifier, exchange layouts, the cluster simulator and the CPU and CUDA attention kernels";

  py::class_<plan::Batch, std::shared_ptr<plan::Batch>>(m, "Batch")
      .def_property_readonly("num_ranks", [](const plan::Batch& b) { return b.num_ranks; })
      .def_property_readonly("tokens_per_rank", [](const plan::Batch& b) { return b.tokens_per_rank; })
      .def_property_readonly("num_docs", &plan::Batch::num_docs)
      .def("to_dict", &batch_dict);
  m.def("batch_from_json", [](const std::string& text, int64_t tokens_per_rank, const std::string& origin) {
    return take(plan::parse_batch_json(text, tokens_per_rank, origin));
  }, py::call_guard<py::gil_scoped_release>());
  // A file may be a FIFO that no one writes: the read can be interrupted.
  m.def("batch_from_file", [](const std::string& path, int64_t tokens_per_rank) {
    return run_interruptible([path, tokens_per_rank] {
      const std::string text = take(read_text_file(path));
      return std::make_shared<plan::Batch>(take(plan::parse_batch_json(text, tokens_per_rank, path)));
    });
  });
  m.def("pack_documents", [](const std::vector<int64_t>& lengths, int32_t num_ranks, int64_t tokens_per_rank,
                             bool is_cut_allowed) {
    plan::Batch b = take(plan::pack_documents(lengths, num_ranks, tokens_per_rank));
    // plan::pack_documents stops when the ranks are full: it cuts the document that fills the last
    // rank and drops the rest, which is what a data loader drawing documents wants (and asks for
    // with is_cut_allowed). A caller that names its documents wants every one of them, whole.
    if (is_cut_allowed) return b;
    int64_t total = 0;
    for (size_t d = 0; d < lengths.size(); ++d) {
      if (lengths[d] <= 0) throw py::value_error(fmt::format("pack: lengths[{}] must be positive, got {}", d, lengths[d]));
      total = lengths[d] > std::numeric_limits<int64_t>::max() - total ? std::numeric_limits<int64_t>::max()
                                                                       : total + lengths[d];
    }
    if (total > b.total_tokens()) {
      throw py::value_error(fmt::format(
          "pack: {} tokens do not fit {} rank{} x {} tokens ({} tokens); give more ranks, a larger tokens_per_rank or "
          "fewer documents (pack cuts and drops no document)",
          total, num_ranks, num_ranks == 1 ? "" : "s", tokens_per_rank, int64_t{num_ranks} * tokens_per_rank));
    }
    return b;
  }, py::arg("lengths"), py::arg("num_ranks"), py::arg("tokens_per_rank"), py::arg("is_cut_allowed") = false);
  m.def("batch_from_pieces", &batch_from_pieces, py::arg("doc_lengths"), py::arg("pieces"), py::arg("tokens_per_rank"),
        py::arg("num_ranks") = 0);

  py::class_<facade::PlanRequest>(m, "PlanRequest")
      .def(py::init<>())
      .def_readwrite("policy", &facade::PlanRequest::policy)
      .def_readwrite("tolerance", &facade::PlanRequest::tolerance)
      .def_readwrite("granularity", &facade::PlanRequest::granularity)
      .def_readwrite("max_rank_bytes", &facade::PlanRequest::max_rank_bytes)
      .def_readwrite("max_server_bytes", &facade::PlanRequest::max_server_bytes)
      .def_readwrite("model", &facade::PlanRequest::model)
      .def_readwrite("layers", &facade::PlanRequest::layers)
      .def_readwrite("hidden", &facade::PlanRequest::hidden)
      .def_readwrite("heads", &facade::PlanRequest::heads)
      .def_readwrite("kv_heads", &facade::PlanRequest::kv_heads)
      .def_readwrite("head_dim", &facade::PlanRequest::head_dim)
      .def_readwrite("ffn_hidden", &facade::PlanRequest::ffn_hidden)
      .def_readwrite("dtype_bytes", &facade::PlanRequest::dtype_bytes)
      .def_readwrite("tp", &facade::PlanRequest::tp)
      .def_readwrite("grad_return", &facade::PlanRequest::grad_return)
      .def_readwrite("gpus_per_node", &facade::PlanRequest::gpus_per_node)
      .def("set_throughput",
           [](facade::PlanRequest& r, double flops_per_second, int64_t tile_rows, double task_overhead_seconds,
              const std::string& source) {
             plan::ThroughputProfile t;
             t.flops_per_second = flops_per_second;
             t.tile_rows = tile_rows;
             t.task_overhead_seconds = task_overhead_seconds;
             t.source = source;
             check(t.validate());
             r.throughput = t;
           });
  m.def("cpu_throughput_profile", [] {
    const plan::ThroughputProfile t = plan::cpu_throughput_profile();
    py::dict d;
    d["flops_per_second"] = t.flops_per_second;
    d["tile_rows"] = t.tile_rows;
    d["task_overhead_seconds"] = t.task_overhead_seconds;
    d["source"] = t.source;
    return d;
  });

  py::class_<PyPlan>(m, "NativePlan")
      .def_property_readonly("policy", [](const PyPlan& p) { return p.plan().policy; })
      .def_property_readonly("tolerance", [](const PyPlan& p) { return p.plan().tolerance; })
      .def_property_readonly("hash", [](const PyPlan& p) { return p.plan().hash; })
      .def_property_readonly("plan_ms", [](const PyPlan& p) { return p.run.runs.front().plan_ms; })
      .def_property_readonly("native_ms", [](const PyPlan& p) { return p.native_ms; })
      .def_property_readonly("note", [](const PyPlan& p) { return p.plan().note; })
      .def_property_readonly("is_balanced", [](const PyPlan& p) { return p.plan().is_balanced; })
      .def_property_readonly("is_guaranteed", [](const PyPlan& p) { return p.plan().is_guaranteed; })
      .def_property_readonly("is_within_budget", [](const PyPlan& p) { return p.plan().is_within_budget; })
      .def_property_readonly("batch", [](const PyPlan& p) { return std::const_pointer_cast<plan::Batch>(p.batch); })
      .def("tasks", [](const PyPlan& p) { return task_matrix(p.plan().tasks); })
      .def("server_seconds", [](const PyPlan& p) { return array(p.plan().server_seconds); })
      .def("server_pairs", [](const PyPlan& p) { return array(p.plan().server_pairs); })
      .def("load", [](const PyPlan& p) {
        const plan::LoadSummary& l = p.plan().load;
        return py::dict(py::arg("max") = l.max, py::arg("mean") = l.mean, py::arg("imbalance") = l.imbalance,
                        py::arg("pairs_imbalance") = l.pairs_imbalance);
      })
      .def("traffic", [](const PyPlan& p) { return traffic_dict(*p.batch, p.run.cost, p.plan()); })
      .def("report_json", [](PyPlan& p) { return dump(facade::plan_run_json(p.complete(), *p.batch)); })
      .def("plan_json", [](const PyPlan& p) { return dump(plan::plan_to_json(p.plan(), *p.batch, p.run.cost)); })
      .def("verify", [](const PyPlan& p) { check(plan::verify_tasks(*p.batch, p.plan().tasks)); })
      .def("layout", [](const PyPlan& p, int64_t rank) { return rank_layout(*p.batch, p.plan().tasks, rank); });

  // Planning runs without the GIL (a data loader or a planner prefetching the next step on
  // another Python thread keeps running while C++ plans) and can be interrupted with Ctrl-C.
  m.def("make_plan",
        [](std::shared_ptr<plan::Batch> batch, const facade::PlanRequest& request, const std::string& profile_path) {
          if (batch == nullptr) throw py::type_error("batch must be a Batch, got None");
          return run_interruptible([batch, request, profile_path] { return make_plan(batch, request, profile_path); });
        },
        py::arg("batch"), py::arg("request"), py::arg("profile_path") = "");

  // The layout of a part of a plan's tasks (a ping-pong nano-batch), checked for well-formed
  // tasks only: rows whose tasks are all in the other part get no entry.
  m.def("partial_layout", [](std::shared_ptr<plan::Batch> batch, const TaskRows& tasks, int32_t rank) {
    if (batch == nullptr) throw py::type_error("batch must be a Batch, got None");
    const std::vector<plan::Task> list = plan_tasks(tasks);
    return layout_of([&] { return layout::build_partial_route(*batch, list, rank); });
  });
  m.attr("task_split_kv_budget") = layout::kKvBudget;
  m.def("split_attention_tasks",
        [](std::shared_ptr<plan::Batch> batch, const TaskRows& tasks, double tolerance, double kv_budget) {
          if (batch == nullptr) throw py::type_error("batch must be a Batch, got None");
          return attention_task_split(*batch, tasks, tolerance, kv_budget);
        },
        py::arg("batch"), py::arg("tasks"), py::arg("tolerance"), py::arg("kv_budget"));

  // A plan file (distca plan --out): its batch, model and tasks, every field checked, the tasks
  // re-verified and the hash re-checked; layout() gives each rank what the plan it was written
  // from gives (a plan made on one rank, broadcast as text, drives the exchange on every rank).
  py::class_<PyLoadedPlan>(m, "NativeLoadedPlan")
      .def_property_readonly("policy", [](const PyLoadedPlan& p) { return p.plan.policy; })
      .def_property_readonly("tolerance", [](const PyLoadedPlan& p) { return p.plan.tolerance; })
      .def_property_readonly("hash", [](const PyLoadedPlan& p) { return p.plan.hash; })
      .def_property_readonly("model", [](const PyLoadedPlan& p) { return p.model; })
      .def_property_readonly("batch", [](const PyLoadedPlan& p) { return p.batch; })
      .def("tasks", [](const PyLoadedPlan& p) { return task_matrix(p.plan.tasks); })
      .def("layout", [](const PyLoadedPlan& p, int64_t rank) { return rank_layout(*p.batch, p.plan.tasks, rank); });
  m.def("load_plan_json", [](std::string text) {
    return run_interruptible([text = std::move(text)] {
      plan::LoadedPlan loaded = take(plan::plan_from_text(text, "plan file"));
      return PyLoadedPlan{std::make_shared<plan::Batch>(std::move(loaded.batch)), std::move(loaded.plan),
                          loaded.model.name};
    });
  });

  py::class_<facade::SimRequest>(m, "SimRequest")
      .def(py::init<>())
      .def_readwrite("model", &facade::SimRequest::model)
      .def_readwrite("gpus", &facade::SimRequest::gpus)
      .def_readwrite("gpus_per_node", &facade::SimRequest::gpus_per_node)
      .def_readwrite("tp", &facade::SimRequest::tp)
      .def_readwrite("pp", &facade::SimRequest::pp)
      .def_readwrite("cp", &facade::SimRequest::cp)
      .def_readwrite("wlb_cp", &facade::SimRequest::wlb_cp)
      .def_readwrite("context", &facade::SimRequest::context)
      .def_readwrite("batch", &facade::SimRequest::batch)
      .def_readwrite("workload", &facade::SimRequest::workload)
      .def_readwrite("system", &facade::SimRequest::system)
      .def_readwrite("seed", &facade::SimRequest::seed)
      .def_readwrite("tolerance", &facade::SimRequest::tolerance)
      .def_readwrite("tolerance_sweep", &facade::SimRequest::tolerance_sweep)
      .def_readwrite("iterations", &facade::SimRequest::iterations)
      .def_property("keep_short", [](const facade::SimRequest& r) { return r.sampling.keep_short; },
                    [](facade::SimRequest& r, double v) { r.sampling.keep_short = v; })
      .def_property("upsample", [](const facade::SimRequest& r) { return r.sampling.upsample; },
                    [](facade::SimRequest& r, double v) { r.sampling.upsample = v; })
      .def_property("elongation", [](const facade::SimRequest& r) { return r.sampling.elongation; },
                    [](facade::SimRequest& r, double v) { r.sampling.elongation = v; })
      .def_property("full_context_share", [](const facade::SimRequest& r) { return r.sampling.full_context_share; },
                    [](facade::SimRequest& r, double v) { r.sampling.full_context_share = v; });

  m.def("simulate_json", [](const facade::SimRequest& request, const std::string& profile_json) {
    sim::Profile profile = sim::default_h200_profile();
    if (!profile_json.empty()) profile = take(sim::profile_from_json(take(parse_json(profile_json, "profile")), "profile"));
    return run_interruptible([request, profile = std::move(profile)] { return dump(take(facade::run_simulation(request, profile))); });
  });

  // Profiles as JSON text: the built-in one, one read from a file (checked), one checked.
  m.def("default_profile_json", [] { return dump(sim::to_json(sim::default_h200_profile())); });
  m.def("load_profile_json", [](const std::string& path) {
    return run_interruptible([path] { return dump(sim::to_json(take(sim::load_profile(path)))); });
  });
  m.def("check_profile_json", [](const std::string& text, const std::string& origin) {
    return dump(sim::to_json(take(sim::profile_from_json(take(parse_json(text, origin)), origin))));
  });
  // An output that cannot be written (a directory, a device or FIFO, a missing or read-only
  // folder, a full disk) is ValueError naming the path, whatever the Status code: nothing was
  // written, and the path is what the caller must change.
  m.def("write_file_atomic", [](const std::string& path, const std::string& text) {
    Status s;
    {
      py::gil_scoped_release release;
      s = write_file_atomic(path, text);
    }
    if (!s.is_ok()) throw py::value_error(s.message());
  });
  // The table of DISTCA_* environment variables (core/knobs.h), which distca.knobs reads.
  m.def(
      "knobs",
      [] {
        py::list table;
        for (const Knob& k : knobs()) {
          py::dict entry;
          entry["name"] = k.name;
          entry["default"] = k.default_text;
          entry["meaning"] = k.meaning;
          entry["used_by"] = knob_user_names(k.users);
          table.append(entry);
        }
        return table;
      },
      "The DISTCA_* environment variables distca, its scripts and its tests read, in the order distca --help-env "
      "prints them: dicts with name, default, meaning and used_by.");
  m.def(
      "unknown_knobs_warning", [](const std::vector<std::string>& names) { return unknown_knobs_warning(names); },
      py::arg("names"),
      "One warning line naming those of `names` that are DISTCA_* and not in the table, each with the nearest known "
      "name where one is close; \"\" when all are known.");
  m.def("cpu_isas_built", &kernels::cpu_isas_built,
        "The builds of the CPU attention kernels compiled in, fastest first (avx512, avx2, portable on x86-64).");
  m.def("cpu_isas_supported", &kernels::cpu_isas_supported,
        "The builds of the CPU attention kernels this CPU runs, fastest first.");
  m.def(
      "cpu_isa",
      [] {
        const Result<std::string> isa = kernels::resolve_cpu_isa("");
        if (!isa.is_ok()) throw py::value_error(isa.status().message());
        return isa.value();
      },
      "The build of the CPU attention kernels an object made now runs: DISTCA_CPU_ISA where set, else the fastest "
      "this CPU runs.");
  py::class_<PyCpuAttention>(m, "CpuAttention")
      .def(py::init([](int num_threads, const std::string& isa) {
             if (num_threads < 0 || num_threads > 1024) {
               throw py::value_error(fmt::format("num_threads {} is outside [0, 1024] (0: one per hardware thread)", num_threads));
             }
             const Result<std::string> resolved = kernels::resolve_cpu_isa(isa);
             if (!resolved.is_ok()) throw py::value_error(resolved.status().message());
             return std::make_unique<PyCpuAttention>(num_threads, resolved.value());
           }),
           py::arg("num_threads") = 0, py::arg("isa") = "")
      .def_property_readonly("num_threads", [](const PyCpuAttention& a) { return a.attn.num_threads(); })
      .def_property_readonly("isa", [](const PyCpuAttention& a) { return a.attn.isa(); })
      .def("forward",
           [](PyCpuAttention& self, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse, const Dims& dims,
              const TaskArray& tasks, std::optional<float> scale, const std::string& dtype) {
             run_attention(tasks, dims, dtype, [&](const kernels::AttnDims& d, std::span<const kernels::AttnTask> list,
                                                   bool is_b16) {
               return is_b16 ? attention_forward<distca::bf16>(self, d, list, scale, q, k, v, o, lse)
                             : attention_forward<float>(self, d, list, scale, q, k, v, o, lse);
             });
           },
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dims"), py::arg("tasks"),
           py::arg("scale"), py::arg("dtype"))
      .def("backward",
           [](PyCpuAttention& self, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse, uintptr_t d_o,
              uintptr_t dq, uintptr_t dk, uintptr_t dv, const Dims& dims, const TaskArray& tasks,
              std::optional<float> scale, const std::string& dtype) {
             run_attention(tasks, dims, dtype, [&](const kernels::AttnDims& d, std::span<const kernels::AttnTask> list,
                                                   bool is_b16) {
               return is_b16 ? attention_backward<distca::bf16>(self, d, list, scale, q, k, v, o, lse, d_o, dq, dk, dv)
                             : attention_backward<float>(self, d, list, scale, q, k, v, o, lse, d_o, dq, dk, dv);
             });
           },
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("do"), py::arg("dq"),
           py::arg("dk"), py::arg("dv"), py::arg("dims"), py::arg("tasks"), py::arg("scale"), py::arg("dtype"));
  m.def("cuda_kernels_built", &kernels::cuda_kernels_built);
  m.def("cuda_kernels_archs", &kernels::cuda_kernels_archs);
  m.def("cudnn_built", &kernels::cudnn_built);
  m.def("cudnn_version", &kernels::cudnn_version);
  // The kernel registry (kernels/registry.h): what distca.torch says of a C++ kernel (its dtypes,
  // head dims, whether this build has it) comes from here.
  m.def(
      "kernels",
      [] {
        py::list out;
        for (const kernels::KernelInfo& k : kernels::kKernels) {
          py::list dtypes;
          for (kernels::DType t : k.dtypes) dtypes.append(kernels::dtype_name(t));
          const Status built = kernels::built(k);
          py::dict d;
          d["name"] = std::string(k.name);
          d["device"] = kernels::device_name(k.device);
          d["dtypes"] = py::tuple(dtypes);
          d["head_dims"] = py::tuple(py::cast(std::vector<int64_t>(k.head_dims.begin(), k.head_dims.end())));
          d["has_backward"] = k.has_backward;
          d["built"] = built.is_ok();
          d["not_built"] = built.message();
          d["summary"] = std::string(k.summary);
          out.append(d);
        }
        return out;
      },
      "The registered attention kernels, each a dict: name, device, dtypes, head_dims (empty: any), has_backward, "
      "built, not_built (why not, or \"\"), summary.");
  m.def(
      "kernel_supports",
      [](const std::string& name, const TaskArray& tasks, const Dims& dims, const std::string& dtype,
         bool backward) -> std::optional<std::string> {
        const kernels::KernelInfo* info = take(kernels::find_kernel(name));
        const kernels::DType t = take(kernels::parse_dtype(dtype));
        const Status st = kernels::supports(*info, attn_dims(dims), attn_tasks(tasks), t,
                                            backward ? kernels::Pass::kBackward : kernels::Pass::kForward);
        if (st.is_ok()) return std::nullopt;
        return st.message();
      },
      py::arg("name"), py::arg("tasks"), py::arg("dims"), py::arg("dtype"), py::arg("backward") = false,
      "None when the kernel `name` of this build runs the pass over `tasks` with `dims` (Tq, Tkv, Hq, Hkv, D) "
      "stored as `dtype`, else the reason (kernels::supports).");
  py::class_<PyCudaAttention>(m, "CudaAttention")
      .def(py::init([](int device, const std::string& kernel) {
             if (device < -1) throw py::value_error(fmt::format("device {} is not a CUDA device index (-1: the current one)", device));
             const kernels::CudaKernel which = take(kernels::parse_cuda_kernel(kernel));
             Result<std::unique_ptr<kernels::CudaAttention>> made = [&] {
               py::gil_scoped_release release;
               return kernels::CudaAttention::create(device, which);
             }();
             auto self = std::make_unique<PyCudaAttention>();
             self->attn = take(std::move(made));
             return self;
           }),
           py::arg("device") = -1, py::arg("kernel") = "distca")
      .def_property_readonly("kernel", [](const PyCudaAttention& a) { return kernels::cuda_kernel_name(a.attn->kernel()); })
      .def_property_readonly("graph_stats", [](const PyCudaAttention& a) {
        const kernels::CudnnGraphStats s = a.attn->graph_stats();
        py::dict d;
        d["graphs_built"] = s.graphs_built;
        d["build_seconds"] = s.build_seconds;
        d["calls"] = s.calls;
        d["autotune_seconds"] = s.autotune_seconds;
        py::dict engines;  // graph key -> cuDNN's engine name (DISTCA_CUDNN_AUTOTUNE)
        for (const auto& [key, engine] : s.engines) engines[py::str(key)] = engine;
        d["engines"] = engines;
        return d;
      })
      .def_property_readonly("device", [](const PyCudaAttention& a) { return a.attn->device(); })
      .def_property_readonly("device_name", [](const PyCudaAttention& a) { return a.attn->device_name(); })
      .def("forward",
           [](PyCudaAttention& self, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse, const Dims& dims,
              const TaskArray& tasks, std::optional<float> scale, const std::string& dtype, uintptr_t stream) {
             run_cuda_attention(self, tasks, dims, dtype, [&](const kernels::AttnDims& d,
                                                              std::span<const kernels::AttnTask> list,
                                                              kernels::CudaDType t) {
               kernels::CudaFwdArgs a;
               a.dims = d;
               a.dtype = t;
               a.q = reinterpret_cast<const void*>(q);
               a.k = reinterpret_cast<const void*>(k);
               a.v = reinterpret_cast<const void*>(v);
               a.tasks = list;
               a.scale = scale;
               a.o = reinterpret_cast<void*>(o);
               a.lse = reinterpret_cast<float*>(lse);
               return self.attn->forward(a, reinterpret_cast<void*>(stream));
             });
           },
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dims"), py::arg("tasks"),
           py::arg("scale"), py::arg("dtype"), py::arg("stream"))
      .def("backward",
           [](PyCudaAttention& self, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse, uintptr_t d_o,
              uintptr_t dq, uintptr_t dk, uintptr_t dv, const Dims& dims, const TaskArray& tasks,
              std::optional<float> scale, const std::string& dtype, uintptr_t stream, uintptr_t d_lse, bool dkv_fp32) {
             run_cuda_attention(self, tasks, dims, dtype, [&](const kernels::AttnDims& d,
                                                              std::span<const kernels::AttnTask> list,
                                                              kernels::CudaDType t) {
               kernels::CudaBwdArgs a;
               a.dims = d;
               a.dtype = t;
               a.q = reinterpret_cast<const void*>(q);
               a.k = reinterpret_cast<const void*>(k);
               a.v = reinterpret_cast<const void*>(v);
               a.o = reinterpret_cast<const void*>(o);
               a.lse = reinterpret_cast<const float*>(lse);
               a.d_o = reinterpret_cast<const void*>(d_o);
               a.d_lse = reinterpret_cast<const float*>(d_lse);
               a.tasks = list;
               a.scale = scale;
               a.dq = reinterpret_cast<void*>(dq);
               a.dk = reinterpret_cast<void*>(dk);
               a.dv = reinterpret_cast<void*>(dv);
               a.dkv_fp32 = dkv_fp32;
               return self.attn->backward(a, reinterpret_cast<void*>(stream));
             });
           },
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("do"), py::arg("dq"),
           py::arg("dk"), py::arg("dv"), py::arg("dims"), py::arg("tasks"), py::arg("scale"), py::arg("dtype"),
           py::arg("stream"), py::arg("d_lse") = 0, py::arg("dkv_fp32") = true);
  m.def("attention_pairs", [](const TaskArray& tasks) {
    return kernels::total_pairs(attn_tasks(tasks));
  }, py::arg("tasks"));
  // A pipeline schedule's tick table: ([tick][stage] of ("F" | "B" | "", micro-batch or -1), its text).
  m.def("pipeline_schedule", [](const std::string& name, int stages, int micro_batches) {
    const plan::PipelineSchedule s = take(plan::pipeline_schedule(name, stages, micro_batches));
    py::list ticks;
    for (const auto& tick : s.ticks) {
      py::list row;
      for (const plan::PipeSlot& slot : tick) {
        const char* op = slot.op == plan::PipeOp::kForward ? "F" : slot.op == plan::PipeOp::kBackward ? "B" : "";
        row.append(py::make_tuple(op, slot.micro_batch));
      }
      ticks.append(row);
    }
    return py::make_tuple(ticks, s.to_text());
  }, py::arg("name"), py::arg("stages"), py::arg("micro_batches"));
  m.def("planner_names", &plan::planner_names);
  m.def("model_preset_names", &plan::model_preset_names);
  m.def("system_names", &sim::system_names);
}
