#include "distca/bench/bench_dispatch.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "distca/comm/emulated_link.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/layout/step_split.h"
#include "distca/plan/planner.h"
#include "distca/plan/workload.h"
#include "distca/runtime/dispatcher.h"
#include "distca/runtime/pingpong.h"
#include "distca/kernels/blas_setup.h"
#include "distca/bench/spread.h"

namespace distca::bench {

using nlohmann::json;

Status validate(const DispatchBenchOptions& o) {
  if (o.ranks < 1 || o.ranks > 64) return invalid_argument(fmt::format("--ranks must be 1..64, got {}", o.ranks));
  if (o.tokens_per_rank < 64 || o.tokens_per_rank > (int64_t{1} << 20)) {
    return invalid_argument(fmt::format("--tokens-per-rank must be 64..1048576, got {}", o.tokens_per_rank));
  }
  if (o.q_heads < 1 || o.kv_heads < 1 || o.q_heads % o.kv_heads != 0) {
    return invalid_argument(fmt::format("--heads ({}) must be a positive multiple of --kv-heads ({})", o.q_heads, o.kv_heads));
  }
  if (o.head_dim != 32 && o.head_dim != 64 && o.head_dim != 128 && o.head_dim != 256) {
    return invalid_argument(fmt::format("--head-dim must be 32, 64, 128 or 256, got {}", o.head_dim));
  }
  if (o.layers < 1 || o.layers > 64) return invalid_argument(fmt::format("--layers must be 1..64, got {}", o.layers));
  if (o.backward_mode != "stateless" && o.backward_mode != "stateful") {
    return invalid_argument(fmt::format("--backward must be stateless or stateful, got '{}'", o.backward_mode));
  }
  if (o.threads < 1 || o.threads > 256) return invalid_argument(fmt::format("--threads must be 1..256, got {}", o.threads));
  if (!(o.linear_ratio >= 0) || o.linear_ratio > 100) {
    return invalid_argument(fmt::format("--linear-ratio must be 0..100, got {}", o.linear_ratio));
  }
  if (o.link != "auto" && o.link != "off") {
    char* end = nullptr;
    const double gbps = std::strtod(o.link.c_str(), &end);
    if (end == o.link.c_str() || *end != '\0' || !(gbps > 0) || !std::isfinite(gbps)) {
      return invalid_argument(fmt::format("--link must be auto, off, or a bandwidth in GB/s > 0, got '{}'", o.link));
    }
  }
  if (!(o.latency_us >= 0) || o.latency_us > 1e6) {
    return invalid_argument(fmt::format("--latency-us must be 0..1e6, got {}", o.latency_us));
  }
  if (o.repeats < 1 || o.repeats > 100) return invalid_argument(fmt::format("--repeats must be 1..100, got {}", o.repeats));
  DISTCA_RETURN_IF_ERROR(plan::builtin_distribution(o.workload).status());
  DISTCA_RETURN_IF_ERROR(plan::find_planner(o.policy).status());
  return Status::ok();
}

namespace {

// This rank's share of one nano-batch: inputs (shared by the layers), per-layer outputs, the
// stand-in linear layer, and a dispatcher once a communicator is chosen.
struct Nano {
  plan::Batch batch;
  plan::Plan plan;
  int64_t rows = 0;
  std::vector<float> q, k, v, d_o, dq, dk, dv;
  std::vector<std::vector<float>> o, lse;  // [layer]
  int64_t linear_n = 0;                    // output columns of the forward linear stand-in
  std::vector<float> w, y;
  std::unique_ptr<runtime::Dispatcher> d;
  std::vector<runtime::ServerBuffers> server;  // one per layer when stateful, else one
  std::vector<runtime::Stage> chain;
};

// One repeat on one rank: a sequential run, then a ping-pong run. All doubles: samples cross
// ranks as bytes.
struct Sample {
  double seq = 0;         // wall time of the sequential schedule
  double compute = 0;     // its time in compute stages
  double comm = 0;        // its time in communication: packing, waiting (link and peers), unpacking
  double pp = 0;          // wall time of the ping-pong schedule
  double pp_compute = 0;  // its time in compute stages
  double wire_bytes = 0;  // the sequential run's link bytes: sum over operations of max(out, in)
  double operations = 0;  // the sequential run's link operations
  double link_busy = 0;   // emulated seconds the link carried the sequential run's operations
  // The sequential run's compute and communication per nano-batch.
  double compute_a = 0, compute_b = 0, comm_a = 0, comm_b = 0;
};

// Every rank's sample, exactly, on every rank: one all-to-all of the raw doubles.
Result<std::vector<Sample>> all_samples(comm::Communicator& c, const Sample& mine) {
  const int R = c.size();
  const auto n = static_cast<int64_t>(sizeof(Sample));
  std::vector<Sample> all(R);
  all[c.rank()] = mine;
  std::vector<int64_t> counts(R, n), send_offsets(R, 0), recv_offsets(R);
  counts[c.rank()] = 0;
  for (int r = 0; r < R; ++r) recv_offsets[r] = r * n;
  const comm::AllToAllV x{reinterpret_cast<const std::byte*>(&mine), counts, send_offsets,
                          reinterpret_cast<std::byte*>(all.data()), counts, recv_offsets};
  DISTCA_RETURN_IF_ERROR(c.all_to_all_v(x));
  return all;
}

// The repeat's slowest rank (the longest sequential run): its compute and communication add up
// to its time, so every figure of a repeat comes from one rank.
Sample slowest(const std::vector<Sample>& ranks) {
  return *std::max_element(ranks.begin(), ranks.end(), [](const Sample& a, const Sample& b) { return a.seq < b.seq; });
}

double hidden_fraction(const Sample& s) { return s.comm > 0 ? (s.seq - s.pp) / s.comm : 0.0; }

// Ping-pong hides a nano-batch's communication behind the other's compute: the share of the
// communication that the other nano-batch's compute, as measured, is long enough to cover. An
// estimate of what the schedule can hide, not a bound: transfers in flight together, or a
// machine that computes faster in one run than another, move the measured fraction off it.
double cover_fraction(const Sample& s) {
  if (!(s.comm > 0)) return 0.0;
  const double uncovered = std::max(0.0, s.comm_a - s.compute_b) + std::max(0.0, s.comm_b - s.compute_a);
  // The clamp absorbs rounding only: comm_a + comm_b is comm summed in another order.
  return std::clamp(1.0 - uncovered / s.comm, 0.0, 1.0);
}

void linear(Nano& x, int64_t n) {
  if (x.rows == 0 || n == 0) return;
  // Y[rows, n] = X[rows, H] W[H, n], X the layer's attention input (Q stands in for it).
  const auto h = static_cast<int>(x.w.size() / (2 * x.linear_n));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(x.rows), static_cast<int>(n), h, 1.0f,
              x.q.data(), h, x.w.data(), static_cast<int>(2 * x.linear_n), 0.0f, x.y.data(), static_cast<int>(n));
}

// Builds the nano-batch's chain on dispatcher x.d: per layer a linear stage whose end posts the
// dispatch and an attention stage whose end posts the return; then the backward, mirrored.
void build_chain(Nano& x, int layers) {
  runtime::Dispatcher* d = x.d.get();
  auto finish = [d] { return d->finish_comm(); };
  auto start_return = [d] { return d->start_return(); };
  auto attend = [d] { return d->compute(); };
  auto buffers = [&x](int l) -> runtime::ServerBuffers& { return x.server[std::min<size_t>(l, x.server.size() - 1)]; };
  x.chain.clear();
  for (int l = 0; l < layers; ++l) {
    x.chain.push_back({[&x] { linear(x, x.linear_n); return Status::ok(); },
                       [&x, d, l, buffers] {
                         return d->start_forward({x.q.data(), x.k.data(), x.v.data(), x.o[l].data(), x.lse[l].data()}, buffers(l));
                       },
                       finish, fmt::format("L{} fwd linear", l), fmt::format("L{} fwd dispatch", l)});
    x.chain.push_back({attend, start_return, finish, fmt::format("L{} fwd attention", l), fmt::format("L{} fwd return", l)});
  }
  for (int l = layers - 1; l >= 0; --l) {
    x.chain.push_back({[&x] { linear(x, 2 * x.linear_n); return Status::ok(); },
                       [&x, d, l, buffers] {
                         return d->start_backward({x.q.data(), x.k.data(), x.v.data(), x.o[l].data(), x.lse[l].data(),
                                                   x.d_o.data(), x.dq.data(), x.dk.data(), x.dv.data()},
                                                  buffers(l));
                       },
                       finish, fmt::format("L{} bwd linear", l), fmt::format("L{} bwd dispatch", l)});
    x.chain.push_back({attend, start_return, finish, fmt::format("L{} bwd attention", l), fmt::format("L{} bwd return", l)});
  }
  x.chain.push_back({[&x] { linear(x, 2 * x.linear_n); return Status::ok(); }, nullptr, nullptr, "last linear", ""});
}

// Dispatchers over `link` for both nano-batches, and their chains (collective).
Status prepare(comm::EmulatedLink& link, std::array<Nano, 2>& nanos, const DispatchBenchOptions& o,
               const layout::HeadShape& heads, plan::BackwardMode mode) {
  for (Nano& x : nanos) {
    runtime::DispatchOptions options;
    options.backward_mode = mode;
    options.num_threads = o.threads;
    DISTCA_ASSIGN_OR_RETURN(x.d, runtime::Dispatcher::create(link, x.batch, x.plan, heads, options));
    build_chain(x, o.layers);
  }
  return Status::ok();
}

// One repeat on this rank: the sequential schedule, then, when asked, the ping-pong schedule,
// each started together on every rank.
Result<Sample> run_once(comm::EmulatedLink& link, std::array<Nano, 2>& nanos, bool with_pingpong) {
  Sample s;
  DISTCA_RETURN_IF_ERROR(link.barrier());
  link.reset_counters();
  DISTCA_ASSIGN_OR_RETURN(runtime::ScheduleTiming seq, runtime::run_sequential(nanos[0].chain, nanos[1].chain));
  s.seq = seq.seconds;
  s.compute = seq.compute_seconds;
  s.comm = seq.comm_seconds;
  s.compute_a = seq.nano_compute_seconds[0];
  s.compute_b = seq.nano_compute_seconds[1];
  s.comm_a = seq.nano_comm_seconds[0];
  s.comm_b = seq.nano_comm_seconds[1];
  s.wire_bytes = static_cast<double>(link.counters().wire_bytes);
  s.operations = static_cast<double>(link.counters().operations);
  s.link_busy = link.counters().busy_seconds;
  if (with_pingpong) {
    DISTCA_RETURN_IF_ERROR(link.barrier());
    DISTCA_ASSIGN_OR_RETURN(runtime::ScheduleTiming pp, runtime::run_pingpong(nanos[0].chain, nanos[1].chain));
    s.pp = pp.seconds;
    s.pp_compute = pp.compute_seconds;
  }
  return s;
}

// Every byte the dispatchers sent since their stats were reset is the plan's count.
Status check_traffic(int rank, std::array<Nano, 2>& nanos, const layout::HeadShape& heads, plan::BackwardMode mode) {
  for (Nano& x : nanos) {
    const plan::Traffic t = plan::count_traffic(x.batch, plan::token_bytes(heads.num_q_heads, heads.num_kv_heads, heads.head_dim, 4, plan::GradReturn::kFp32),
                                                x.plan.tasks, mode);
    for (int p = 0; p < plan::kNumPhases; ++p) {
      const runtime::PhaseStats& st = x.d->stats(static_cast<plan::Phase>(p));
      if (st.bytes_sent != st.calls * t.phases[p].send_bytes[rank]) {
        return internal_error(fmt::format("rank {}: {} sent {} bytes in {} calls; the plan counts {} per call", rank,
                                          plan::phase_name(static_cast<plan::Phase>(p)), st.bytes_sent, st.calls,
                                          t.phases[p].send_bytes[rank]));
      }
    }
  }
  return Status::ok();
}

struct Series {
  std::vector<Sample> samples;            // per repeat, the slowest rank's
  std::vector<double> wire_bytes_per_rank;  // of one sequential run
};

using Say = std::function<void(const std::string&)>;

// `repeats` repeats of sequential then ping-pong; the dispatchers must be warm.
Result<Series> measure(comm::EmulatedLink& link, std::array<Nano, 2>& nanos, int repeats, const layout::HeadShape& heads,
                       plan::BackwardMode mode, const Say& say) {
  for (Nano& x : nanos) x.d->reset_stats();
  Series out;
  for (int rep = 0; rep < repeats; ++rep) {
    DISTCA_ASSIGN_OR_RETURN(Sample mine, run_once(link, nanos, true));
    DISTCA_ASSIGN_OR_RETURN(std::vector<Sample> ranks, all_samples(link, mine));
    const Sample s = slowest(ranks);
    out.samples.push_back(s);
    if (rep == 0) {
      for (const Sample& r : ranks) out.wire_bytes_per_rank.push_back(r.wire_bytes);
    }
    say(fmt::format("  repeat {}/{}: sequential {:.3f} s (compute {:.3f}, comm {:.3f}), ping-pong {:.3f} s: {}", rep + 1,
                    repeats, s.seq, s.compute, s.comm, s.pp,
                    s.comm > 0 ? fmt::format("{:.0f}% hidden", 100.0 * hidden_fraction(s))
                               : std::string("no communication measured, no share hidden")));
  }
  DISTCA_RETURN_IF_ERROR(check_traffic(link.rank(), nanos, heads, mode));
  return out;
}

using bench::spread_of;  // the values' (spread.h), beside the samples' below

template <typename Get>
Spread spread_of(const std::vector<Sample>& samples, Get get) {
  std::vector<double> v;
  for (const Sample& s : samples) v.push_back(get(s));
  return spread_of(v);
}

// Each figure is the median over the repeats, its min and max under "range".
json run_json(const Series& series, double gbps, double latency_us) {
  const std::vector<Sample>& samples = series.samples;
  json j;
  j["link_gbps"] = gbps;  // 0: not emulated
  j["latency_us"] = latency_us;
  j["repeats"] = samples.size();
  j["range"] = json::object();
  auto put = [&](const char* name, const Spread& s) {
    j[name] = s.median;
    j["range"][name] = {s.min, s.max};
  };
  put("seq_seconds", spread_of(samples, [](const Sample& s) { return s.seq; }));
  put("pingpong_seconds", spread_of(samples, [](const Sample& s) { return s.pp; }));
  put("compute_seconds", spread_of(samples, [](const Sample& s) { return s.compute; }));
  put("pingpong_compute_seconds", spread_of(samples, [](const Sample& s) { return s.pp_compute; }));
  put("comm_seconds", spread_of(samples, [](const Sample& s) { return s.comm; }));
  put("comm_over_compute", spread_of(samples, [](const Sample& s) { return s.compute > 0 ? s.comm / s.compute : 0.0; }));
  put("pingpong_over_seq", spread_of(samples, [](const Sample& s) { return s.pp / s.seq; }));
  const Spread hidden = spread_of(samples, hidden_fraction);
  put("hidden_fraction", hidden);
  put("cover_fraction", spread_of(samples, cover_fraction));
  put("nano_a_compute_seconds", spread_of(samples, [](const Sample& s) { return s.compute_a; }));
  put("nano_b_compute_seconds", spread_of(samples, [](const Sample& s) { return s.compute_b; }));
  // The link's own time (latency + bytes / bandwidth) within comm_seconds, which also holds
  // packing, copying and waiting for peers.
  put("link_busy_seconds", spread_of(samples, [](const Sample& s) { return s.link_busy; }));
  put("achieved_gbps", spread_of(samples, [](const Sample& s) { return s.comm > 0 ? s.wire_bytes / s.comm / 1e9 : 0.0; }));
  j["wire_bytes_per_rank"] = series.wire_bytes_per_rank;
  j["samples"] = json::array();
  int out_of_range = 0;
  for (const Sample& s : samples) {
    const double h = hidden_fraction(s);
    out_of_range += (h < 0 || h > 1) ? 1 : 0;
    j["samples"].push_back({{"seq_seconds", s.seq}, {"pingpong_seconds", s.pp}, {"compute_seconds", s.compute},
                            {"pingpong_compute_seconds", s.pp_compute}, {"comm_seconds", s.comm}, {"hidden_fraction", h},
                            {"cover_fraction", cover_fraction(s)},
                            {"nano_compute_seconds", {s.compute_a, s.compute_b}},
                            {"nano_comm_seconds", {s.comm_a, s.comm_b}}});
  }
  // A fraction of the communication hidden lies in [0, 1]; a median outside is noise larger
  // than the communication, not a property of the schedule.
  const double comm = j["comm_seconds"];
  const bool is_error = !(comm > 0) || hidden.median < 0 || hidden.median > 1;
  j["hidden_fraction_out_of_range"] = out_of_range;  // repeats whose own fraction is outside [0, 1]
  j["hidden_fraction_is_measurement_error"] = is_error;
  if (is_error) {
    j["measurement_error"] = fmt::format(
        "hidden fraction {:.0f}% (median of {}, range {:.0f}..{:.0f}%) is outside 0..100%: {}; compute took {:.3f} s in "
        "the sequential runs and {:.3f} s in the ping-pong runs. The times moved by more than the communication between "
        "runs: raise --repeats or the sizes, or run on a quiet machine",
        100 * hidden.median, samples.size(), 100 * hidden.min, 100 * hidden.max,
        !(comm > 0) ? "no communication time was measured"
                    : (hidden.median < 0 ? "ping-pong ran slower than sequential"
                                         : "ping-pong saved more than the sequential run spent communicating"),
        j["compute_seconds"].get<double>(), j["pingpong_compute_seconds"].get<double>());
  }
  return j;
}

constexpr int kMaxCalibrationTries = 4;
constexpr double kCalibrationTolerance = 0.05;  // a try within 5 % of comm = compute stops the search
constexpr double kCalibrationVerifyTolerance = 0.1;  // the repeats' median within 10 %: calibrated

// Sets `link`'s bandwidth so that the sequential run's communication, as measured, equals its
// compute time, as measured over the same link. Compute measured on the communicator as it is
// need not be compute over the link (it ran up to 1.4x slower on a loaded 2-core machine), so it
// only makes the first guess, which gives the link the time between the communicator's own
// communication and that compute. Each try then runs over the link, compares
// its communication with the median compute of the tries so far (a median ignores a run the
// machine slowed), and adds the gap still measured: the link's time overlaps partly with
// waiting for peers. At least two tries, at most kMaxCalibrationTries, after one warm-up run.
// Every rank decides on the same gathered numbers.
Result<json> calibrate(comm::EmulatedLink& link, std::array<Nano, 2>& nanos, const Series& real, double latency_seconds,
                       const Say& say) {
  double compute = spread_of(real.samples, [](const Sample& s) { return s.compute; }).median;
  const double comm = spread_of(real.samples, [](const Sample& s) { return s.comm; }).median;
  double link_seconds = compute - comm;  // the link's time in one sequential run (latency + bytes / bandwidth)
  if (link_seconds <= 0.05 * compute) {
    return infeasible(fmt::format(
        "communication on the communicator as it is ({:.3f} s) already takes about as long as compute ({:.3f} s), so "
        "no emulated link can make them equal; pass --link GB/s or raise --linear-ratio",
        comm, compute));
  }
  std::vector<double> computes;  // of the tries, over the link
  link.set_options({latency_seconds, 0});
  DISTCA_RETURN_IF_ERROR(run_once(link, nanos, false).status());  // warm-up: the new dispatchers' first run
  json tries = json::array();
  double wire = real.samples.front().wire_bytes, ops = real.samples.front().operations;
  bool is_met = false;
  for (int t = 0;; ++t) {
    if (wire <= 0) return infeasible("no bytes cross the link (one rank): there is no communication to emulate; pass --link off");
    const double bytes_seconds = link_seconds - ops * latency_seconds;
    if (bytes_seconds <= 0) {
      return infeasible(fmt::format(
          "the emulated link's latency alone ({} operations x {:.0f} us) exceeds the {:.3f} s the link may take to "
          "make communication equal compute; lower --latency-us or pass --link GB/s",
          ops, latency_seconds * 1e6, link_seconds));
    }
    link.set_options({latency_seconds, wire / bytes_seconds});
    if (t == kMaxCalibrationTries) break;  // the last correction, untried: the repeats measure it
    DISTCA_ASSIGN_OR_RETURN(Sample mine, run_once(link, nanos, false));
    DISTCA_ASSIGN_OR_RETURN(std::vector<Sample> ranks, all_samples(link, mine));
    const Sample s = slowest(ranks);
    computes.push_back(s.compute);
    compute = spread_of(computes).median;
    const double ratio = s.comm / compute;
    tries.push_back({{"link_gbps", link.options().bytes_per_second / 1e9}, {"comm_seconds", s.comm},
                     {"compute_seconds", compute}, {"run_compute_seconds", s.compute}, {"comm_over_compute", ratio}});
    say(fmt::format("  try {}: {:.3f} GB/s: comm {:.3f} s, compute {:.3f} s (median of the tries; this one {:.3f}): {:.2f}x",
                    t + 1, link.options().bytes_per_second / 1e9, s.comm, compute, s.compute, ratio));
    is_met = t >= 1 && std::abs(ratio - 1) <= kCalibrationTolerance;
    if (is_met) break;
    link_seconds += compute - s.comm;
    wire = s.wire_bytes, ops = s.operations;
  }
  // is_met: a try came within `tolerance`; the repeats then verify the bandwidth it used.
  return json{{"target_comm_over_compute", 1.0}, {"tolerance", kCalibrationTolerance}, {"tries", tries}, {"is_met", is_met}};
}

}  // namespace

Result<json> run_dispatch_bench(comm::Communicator& c, const DispatchBenchOptions& o,
                                const std::function<void(const std::string&)>& progress) {
  DISTCA_RETURN_IF_ERROR(validate(o));
  const bool is_root = c.rank() == 0;
  auto say = [&](const std::string& line) {
    if (is_root) progress(line);
  };
  const int R = c.size();
  const layout::HeadShape heads{o.q_heads, o.kv_heads, o.head_dim};
  const plan::BackwardMode mode = o.backward_mode == "stateful" ? plan::BackwardMode::kStateful : plan::BackwardMode::kStateless;
  kernels::blas_set_num_threads(o.threads);

  DISTCA_ASSIGN_OR_RETURN(plan::LengthDistribution dist, plan::builtin_distribution(o.workload));
  plan::SamplingOptions sampling;
  sampling.seed = o.seed;
  DISTCA_ASSIGN_OR_RETURN(plan::Batch batch, plan::sample_batch(dist, sampling, R, o.tokens_per_rank));
  DISTCA_ASSIGN_OR_RETURN(layout::NanoBatches split, layout::split_step_by_documents(batch));
  plan::ModelShape model;
  model.name = "bench";
  model.num_layers = o.layers;
  model.num_q_heads = static_cast<int>(o.q_heads);
  model.num_kv_heads = static_cast<int>(o.kv_heads);
  model.head_dim = static_cast<int>(o.head_dim);
  model.hidden = static_cast<int>(o.q_heads * o.head_dim);
  model.ffn_hidden = 4 * model.hidden;
  model.dtype_bytes = 4;
  const plan::CostModel cost(model, plan::ThroughputProfile{});
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn planner, plan::find_planner(o.policy));

  const int64_t h = o.q_heads * o.head_dim;
  const int64_t hk = o.kv_heads * o.head_dim;
  const plan::TokenBytes tb = plan::token_bytes(o.q_heads, o.kv_heads, o.head_dim, 4, plan::GradReturn::kFp32);
  std::array<Nano, 2> nanos;
  json nano_json = json::array();
  int64_t bytes_fwd = 0, bytes_bwd_stateless = 0, bytes_bwd_stateful = 0;
  std::mt19937_64 rng(o.seed * 1000 + c.rank());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int n = 0; n < 2; ++n) {
    Nano& x = nanos[n];
    x.batch = split.batches[n];
    DISTCA_ASSIGN_OR_RETURN(x.plan, planner(x.batch, cost, plan::PlannerOptions{}));
    x.rows = static_cast<int64_t>(split.rows[n][c.rank()].size());
    for (auto* t : {&x.q, &x.d_o, &x.dq}) t->resize(x.rows * h);
    for (auto* t : {&x.k, &x.v, &x.dk, &x.dv}) t->resize(x.rows * hk);
    for (auto* t : {&x.q, &x.k, &x.v, &x.d_o}) {
      for (float& f : *t) f = normal(rng);
    }
    x.o.assign(o.layers, std::vector<float>(x.rows * h));
    x.lse.assign(o.layers, std::vector<float>(x.rows * o.q_heads));
    x.server.resize(mode == plan::BackwardMode::kStateful ? o.layers : 1);
    // Linear FLOPs per token = ratio x attention FLOPs per token of this nano-batch.
    int64_t pairs = 0, tokens = 0;
    for (int64_t len : x.batch.doc_lengths) pairs += plan::causal_pairs(0, len), tokens += len;
    const double attn_per_token = tokens > 0 ? 4.0 * o.head_dim * o.q_heads * pairs / tokens : 0.0;
    // --linear-ratio 0: no linear stage at all (not one column of it).
    x.linear_n = o.linear_ratio > 0 ? std::max<int64_t>(1, std::llround(o.linear_ratio * attn_per_token / (2.0 * h))) : 0;
    x.w.resize(h * 2 * x.linear_n);
    for (float& f : x.w) f = normal(rng) * 0.01f;
    x.y.resize(x.rows * 2 * x.linear_n);
    for (auto m : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
      const plan::Traffic t = plan::count_traffic(x.batch, tb, x.plan.tasks, m);
      const int64_t bwd = t.phases[2].total_bytes + t.phases[3].total_bytes;
      (m == plan::BackwardMode::kStateless ? bytes_bwd_stateless : bytes_bwd_stateful) += bwd * o.layers;
      if (m == plan::BackwardMode::kStateless) bytes_fwd += (t.phases[0].total_bytes + t.phases[1].total_bytes) * o.layers;
    }
    nano_json.push_back({{"documents", x.batch.num_docs()},
                         {"tokens", tokens},
                         {"causal_pairs", pairs},
                         {"load_imbalance", x.plan.load.pairs_imbalance},
                         {"linear_columns", x.linear_n}});
  }
  const int64_t total_tokens = batch.total_tokens();
  say(fmt::format("{} ranks ({}), {} tokens per rank, {} documents in two nano-batches; {} layers; {} plan",
                  R, c.name(), o.tokens_per_rank, batch.num_docs(), o.layers, o.policy));

  json report;
  report["format"] = "distca-bench-dispatch";
  report["comm"] = c.name();
  report["ranks"] = R;
  report["workload"] = o.workload;
  report["tokens_per_rank"] = o.tokens_per_rank;
  report["total_tokens"] = total_tokens;
  report["heads"] = {{"q", o.q_heads}, {"kv", o.kv_heads}, {"dim", o.head_dim}};
  report["layers"] = o.layers;
  report["policy"] = o.policy;
  report["backward_mode"] = o.backward_mode;
  report["threads"] = o.threads;
  report["linear_ratio"] = o.linear_ratio;
  // The linear stand-in is OpenBLAS sgemm: on the wrong kernel family compute is too slow.
  const kernels::BlasCheck blas = kernels::blas_check();
  report["blas_core"] = blas.core;
  if (!blas.is_trusted) {
    report["blas_warning"] = blas.warning;
    say(blas.warning);
  }
  report["nano_batches"] = nano_json;
  // Bytes of one step (all layers, all ranks), fp32, from the plan's count, which the run checks.
  const int64_t bytes_bwd = mode == plan::BackwardMode::kStateful ? bytes_bwd_stateful : bytes_bwd_stateless;
  report["bytes_fwd"] = bytes_fwd;
  report["bytes_bwd"] = bytes_bwd;
  report["bytes_bwd_stateless"] = bytes_bwd_stateless;
  report["bytes_bwd_stateful"] = bytes_bwd_stateful;
  const double per_token = static_cast<double>(o.layers) * static_cast<double>(total_tokens);
  report["bytes_per_token_layer_stateless"] = static_cast<double>(bytes_fwd + bytes_bwd_stateless) / per_token;
  report["bytes_per_token_layer_stateful"] = static_cast<double>(bytes_fwd + bytes_bwd_stateful) / per_token;

  // 1. The communicator as it is (shared memory or the network), counted but not delayed.
  say(fmt::format("measuring sequential vs ping-pong on the communicator as it is, {} repeats", o.repeats));
  comm::EmulatedLink counting(c, {});
  DISTCA_RETURN_IF_ERROR(prepare(counting, nanos, o, heads, mode));
  DISTCA_RETURN_IF_ERROR(run_once(counting, nanos, false).status());  // warm-up
  DISTCA_ASSIGN_OR_RETURN(Series real, measure(counting, nanos, o.repeats, heads, mode, say));
  report["real"] = run_json(real, 0, 0);

  // 2. An emulated link: by default calibrated so that communication takes as long as compute.
  if (o.link != "off") {
    comm::EmulatedLink link(c, {o.latency_us * 1e-6, 0});  // the bandwidth is set below
    DISTCA_RETURN_IF_ERROR(prepare(link, nanos, o, heads, mode));
    json calibration;
    if (o.link == "auto") {
      say("calibrating an emulated link on the measured compute time (communication = compute)");
      DISTCA_ASSIGN_OR_RETURN(calibration, calibrate(link, nanos, real, o.latency_us * 1e-6, say));
    } else {
      link.set_options({o.latency_us * 1e-6, std::strtod(o.link.c_str(), nullptr) * 1e9});
      DISTCA_RETURN_IF_ERROR(run_once(link, nanos, false).status());  // warm-up: the new dispatchers' first run
    }
    const double gbps = link.options().bytes_per_second / 1e9;
    say(fmt::format("measuring over an emulated link of {:.3f} GB/s and {} us, {} repeats", gbps, o.latency_us, o.repeats));
    DISTCA_ASSIGN_OR_RETURN(Series emu, measure(link, nanos, o.repeats, heads, mode, say));
    report["emulated"] = run_json(emu, gbps, o.latency_us);
    if (!calibration.is_null()) {
      // Verified on the measured repeats: the median communication over compute.
      const json& ratio = report["emulated"]["comm_over_compute"];
      calibration["comm_over_compute"] = ratio;
      calibration["verify_tolerance"] = kCalibrationVerifyTolerance;
      calibration["is_verified"] = std::abs(ratio.get<double>() - 1) <= kCalibrationVerifyTolerance;
      report["emulated"]["calibration"] = calibration;
    }
  }
  const char* headline = report.contains("emulated") ? "emulated" : "real";
  report["headline"] = headline;
  for (const char* f : {"seq_seconds", "pingpong_seconds", "hidden_fraction", "hidden_fraction_is_measurement_error"}) {
    report[f] = report[headline][f];
  }
  return report;
}

namespace {

// "min..max" of a figure, times `scale`, with `decimals` decimals.
std::string range_cell(const json& run, const char* field, int decimals, double scale = 1) {
  const json& r = run["range"][field];
  return fmt::format("{:.{}f}..{:.{}f}", scale * r[0].get<double>(), decimals, scale * r[1].get<double>(), decimals);
}

}  // namespace

void print_dispatch_report(const json& r) {
  fmt::print("distca bench dispatch: {} ranks over {}, {} tokens per rank ({}), {} layers, {} plan, {} backward\n",
             r["ranks"].get<int>(), r["comm"].get<std::string>(), r["tokens_per_rank"].get<int64_t>(),
             r["workload"].get<std::string>(), r["layers"].get<int>(), r["policy"].get<std::string>(),
             r["backward_mode"].get<std::string>());
  fmt::print("bytes per step (fp32, all ranks): forward {:.1f} MB, backward {:.1f} MB stateless / {:.1f} MB stateful\n",
             r["bytes_fwd"].get<double>() / 1e6, r["bytes_bwd_stateless"].get<double>() / 1e6,
             r["bytes_bwd_stateful"].get<double>() / 1e6);
  fmt::print("bytes per token per layer: {:.0f} stateless, {:.0f} stateful\n",
             r["bytes_per_token_layer_stateless"].get<double>(), r["bytes_per_token_layer_stateful"].get<double>());
  if (r.contains("blas_warning")) fmt::print("{}\n", r["blas_warning"].get<std::string>());
  fmt::print("\nseconds of the slowest rank, the median of {} repeat(s); min..max below\n", r["real"]["repeats"].get<int>());
  fmt::print("{:<22} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10} {:>8}\n", "link", "sequential", "ping-pong", "compute",
             "comm", "comm/compute", "hidden", "GB/s");
  std::vector<std::string> errors;
  for (const char* name : {"real", "emulated"}) {
    if (!r.contains(name)) continue;
    const json& j = r[name];
    const std::string label = std::string(name) == "real"
                                  ? std::string("as is (") + r["comm"].get<std::string>() + ")"
                                  : fmt::format("emulated {:.3g} GB/s", j["link_gbps"].get<double>());
    fmt::print("{:<22} {:>12.3f} {:>12.3f} {:>12.3f} {:>12.3f} {:>12.2f} {:>9.0f}% {:>8.2f}\n", label,
               j["seq_seconds"].get<double>(), j["pingpong_seconds"].get<double>(), j["compute_seconds"].get<double>(),
               j["comm_seconds"].get<double>(), j["comm_over_compute"].get<double>(),
               100.0 * j["hidden_fraction"].get<double>(), j["achieved_gbps"].get<double>());
    fmt::print("{:<22} {:>12} {:>12} {:>12} {:>12} {:>12} {:>9}% {:>8}\n", "  min..max", range_cell(j, "seq_seconds", 3),
               range_cell(j, "pingpong_seconds", 3), range_cell(j, "compute_seconds", 3), range_cell(j, "comm_seconds", 3),
               range_cell(j, "comm_over_compute", 2), range_cell(j, "hidden_fraction", 0, 100), "");
    if (j["hidden_fraction_is_measurement_error"].get<bool>()) {
      errors.push_back(fmt::format("measurement error ({}): {}", name, j["measurement_error"].get<std::string>()));
    }
  }
  if (r.contains("emulated") && r["emulated"].contains("calibration")) {
    const json& cal = r["emulated"]["calibration"];
    const json& e = r["emulated"];
    fmt::print("\nemulated link {} after {} calibration tries on the measured compute: communication / compute {:.2f} "
               "(median of the repeats, {}){}\n",
               cal["is_verified"].get<bool>() ? "calibrated" : "NOT calibrated", cal["tries"].size(),
               e["comm_over_compute"].get<double>(), range_cell(e, "comm_over_compute", 2),
               cal["is_verified"].get<bool>() ? "" : fmt::format(": the target is 1 +- {}", kCalibrationVerifyTolerance));
  }
  // What the schedule could hide: each nano-batch's communication hides only behind the other's
  // compute, and the split keeps documents whole, so one long document leaves little to hide behind.
  const json& h = r[r["headline"].get<std::string>()];
  fmt::print("\nnano-batch compute {:.3f} s and {:.3f} s ({} and {} documents): the other nano-batch's compute covers "
             "{:.0f}% of the communication ({}%), against {:.0f}% hidden\n",
             h["nano_a_compute_seconds"].get<double>(), h["nano_b_compute_seconds"].get<double>(),
             r["nano_batches"][0]["documents"].get<int>(), r["nano_batches"][1]["documents"].get<int>(),
             100 * h["cover_fraction"].get<double>(), range_cell(h, "cover_fraction", 0, 100),
             100 * h["hidden_fraction"].get<double>());
  if (!errors.empty()) fmt::print("\n");
  for (const std::string& line : errors) fmt::print("{}\n", line);
}

}  // namespace distca::bench
