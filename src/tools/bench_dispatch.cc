#include "bench_dispatch.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "distca/comm/emulated_link.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/plan/planner.h"
#include "distca/plan/workload.h"
#include "distca/runtime/dispatcher.h"
#include "distca/runtime/pingpong.h"

namespace distca::tools {

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

struct Measured {
  double seq = 0, pp = 0, compute = 0, comm = 0;
  int64_t wire_bytes = 0;  // per sequential run, this rank
  double link_busy = 0;    // emulated seconds the link carried data, per sequential run
};

// max over ranks of each value (an all-reduce of one slot per rank).
Result<std::vector<double>> max_over_ranks(comm::Communicator& c, const std::vector<double>& mine) {
  const size_t k = mine.size();
  std::vector<float> all(k * c.size(), 0.0f);
  for (size_t i = 0; i < k; ++i) all[c.rank() * k + i] = static_cast<float>(mine[i]);
  DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  std::vector<double> out(k, 0.0);
  for (int r = 0; r < c.size(); ++r) {
    for (size_t i = 0; i < k; ++i) out[i] = std::max(out[i], static_cast<double>(all[r * k + i]));
  }
  return out;
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
                       finish});
    x.chain.push_back({attend, start_return, finish});
  }
  for (int l = layers - 1; l >= 0; --l) {
    x.chain.push_back({[&x] { linear(x, 2 * x.linear_n); return Status::ok(); },
                       [&x, d, l, buffers] {
                         return d->start_backward({x.q.data(), x.k.data(), x.v.data(), x.o[l].data(), x.lse[l].data(),
                                                   x.d_o.data(), x.dq.data(), x.dk.data(), x.dv.data()},
                                                  buffers(l));
                       },
                       finish});
    x.chain.push_back({attend, start_return, finish});
  }
  x.chain.push_back({[&x] { linear(x, 2 * x.linear_n); return Status::ok(); }, nullptr, nullptr});
}

// Sequential and ping-pong schedules over `c`, best of `repeats` each, alternating.
Result<Measured> measure(comm::Communicator& c, comm::EmulatedLink& link, std::array<Nano, 2>& nanos,
                         const DispatchBenchOptions& o, const runtime::HeadShape& heads, plan::BackwardMode mode) {
  for (Nano& x : nanos) {
    runtime::DispatchOptions options;
    options.backward_mode = mode;
    options.num_threads = o.threads;
    DISTCA_ASSIGN_OR_RETURN(x.d, runtime::Dispatcher::create(c, x.batch, x.plan, heads, options));
    build_chain(x, o.layers);
  }
  DISTCA_RETURN_IF_ERROR(runtime::run_sequential(nanos[0].chain, nanos[1].chain).status());  // warm-up
  for (Nano& x : nanos) x.d->reset_stats();
  Measured m;
  m.seq = m.pp = INFINITY;
  for (int rep = 0; rep < o.repeats; ++rep) {
    DISTCA_RETURN_IF_ERROR(c.barrier());
    link.reset_counters();
    DISTCA_ASSIGN_OR_RETURN(runtime::ScheduleTiming seq, runtime::run_sequential(nanos[0].chain, nanos[1].chain));
    if (seq.seconds < m.seq) m.seq = seq.seconds, m.compute = seq.compute_seconds, m.comm = seq.comm_seconds;
    m.wire_bytes = link.counters().wire_bytes;
    m.link_busy = link.counters().busy_seconds;
    DISTCA_RETURN_IF_ERROR(c.barrier());
    DISTCA_ASSIGN_OR_RETURN(runtime::ScheduleTiming pp, runtime::run_pingpong(nanos[0].chain, nanos[1].chain));
    m.pp = std::min(m.pp, pp.seconds);
  }
  // Every byte the dispatchers sent is the plan's count.
  for (Nano& x : nanos) {
    const plan::Traffic t = plan::count_traffic(x.batch, plan::token_bytes(heads.num_q_heads, heads.num_kv_heads, heads.head_dim, 4),
                                                x.plan.tasks, mode);
    for (int p = 0; p < plan::kNumPhases; ++p) {
      const runtime::PhaseStats& st = x.d->stats(static_cast<plan::Phase>(p));
      if (st.bytes_sent != st.calls * t.phases[p].send_bytes[c.rank()]) {
        return internal_error(fmt::format("rank {}: {} sent {} bytes in {} calls; the plan counts {} per call", c.rank(),
                                          plan::phase_name(static_cast<plan::Phase>(p)), st.bytes_sent, st.calls,
                                          t.phases[p].send_bytes[c.rank()]));
      }
    }
  }
  DISTCA_ASSIGN_OR_RETURN(auto worst, max_over_ranks(c, {m.seq, m.pp, m.compute, m.comm,
                                                          static_cast<double>(m.wire_bytes), m.link_busy}));
  return Measured{worst[0], worst[1], worst[2], worst[3], static_cast<int64_t>(worst[4]), worst[5]};
}

json run_json(const Measured& m, double gbps, double latency_us) {
  json j;
  j["link_gbps"] = gbps;  // 0: not emulated
  j["latency_us"] = latency_us;
  j["seq_seconds"] = m.seq;
  j["pingpong_seconds"] = m.pp;
  j["compute_seconds"] = m.compute;
  j["comm_seconds"] = m.comm;
  j["comm_over_compute"] = m.compute > 0 ? m.comm / m.compute : 0.0;
  j["hidden_fraction"] = m.comm > 0 ? (m.seq - m.pp) / m.comm : 0.0;
  // The link's own time (latency + bytes / bandwidth) within comm_seconds, which also holds
  // packing, copying and waiting for peers.
  j["link_busy_seconds"] = m.link_busy;
  j["pingpong_over_seq"] = m.pp / m.seq;
  j["achieved_gbps"] = m.comm > 0 ? static_cast<double>(m.wire_bytes) / m.comm / 1e9 : 0.0;
  j["wire_bytes_per_rank"] = m.wire_bytes;
  return j;
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
  const runtime::HeadShape heads{o.q_heads, o.kv_heads, o.head_dim};
  const plan::BackwardMode mode = o.backward_mode == "stateful" ? plan::BackwardMode::kStateful : plan::BackwardMode::kStateless;
  kernels::blas_set_num_threads(o.threads);

  DISTCA_ASSIGN_OR_RETURN(plan::LengthDistribution dist, plan::builtin_distribution(o.workload));
  plan::SamplingOptions sampling;
  sampling.seed = o.seed;
  DISTCA_ASSIGN_OR_RETURN(plan::Batch batch, plan::sample_batch(dist, sampling, R, o.tokens_per_rank));
  DISTCA_ASSIGN_OR_RETURN(runtime::NanoBatches split, runtime::split_nano_batches(batch));
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
  const plan::TokenBytes tb = plan::token_bytes(o.q_heads, o.kv_heads, o.head_dim, 4);
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
    x.linear_n = std::max<int64_t>(1, std::llround(o.linear_ratio * attn_per_token / (2.0 * h)));
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
  say("measuring sequential vs ping-pong on the communicator as it is");
  comm::EmulatedLink counting(c, {});
  DISTCA_ASSIGN_OR_RETURN(Measured real, measure(counting, counting, nanos, o, heads, mode));
  json real_json = run_json(real, 0, 0);
  report["real"] = real_json;
  say(fmt::format("  sequential {:.3f} s, ping-pong {:.3f} s ({:.3f}x), comm {:.3f} s", real.seq, real.pp,
                  real.pp / real.seq, real.comm));

  // 2. An emulated link: by default as fast as makes communication take as long as compute.
  if (o.link != "off") {
    double bytes_per_second = 0;
    if (o.link == "auto") {
      // Communication as measured = what it costs on the communicator as it is (packing,
      // copies, waiting for peers) + latency + bytes / bandwidth. Choose the bandwidth that
      // makes it equal the compute time.
      const double per_op_latency = o.latency_us * 1e-6;
      const int64_t ops = 2 * (4 * o.layers);  // all-to-all-v of the two nano-batch chains
      const double budget = real.compute - real.comm - per_op_latency * static_cast<double>(ops);
      if (budget <= 0.05 * real.compute) {
        return invalid_argument(fmt::format(
            "communication on the communicator as it is ({:.3f} s) already takes about as long as compute "
            "({:.3f} s); pass --link GB/s or raise --linear-ratio",
            real.comm, real.compute));
      }
      bytes_per_second = static_cast<double>(real.wire_bytes) / budget;
    } else {
      bytes_per_second = std::strtod(o.link.c_str(), nullptr) * 1e9;
    }
    say(fmt::format("measuring over an emulated link of {:.3f} GB/s and {} us", bytes_per_second / 1e9, o.latency_us));
    comm::EmulatedLink link(c, {o.latency_us * 1e-6, bytes_per_second});
    DISTCA_ASSIGN_OR_RETURN(Measured emu, measure(link, link, nanos, o, heads, mode));
    report["emulated"] = run_json(emu, bytes_per_second / 1e9, o.latency_us);
    say(fmt::format("  sequential {:.3f} s, ping-pong {:.3f} s, comm {:.3f} s, compute {:.3f} s: {:.0f}% hidden", emu.seq,
                    emu.pp, emu.comm, emu.compute, 100.0 * (emu.seq - emu.pp) / emu.comm));
  }
  const json& headline = report.contains("emulated") ? report["emulated"] : report["real"];
  for (const char* f : {"seq_seconds", "pingpong_seconds", "hidden_fraction"}) report[f] = headline[f];
  report["headline"] = report.contains("emulated") ? "emulated" : "real";
  return report;
}

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
  fmt::print("\n{:<22} {:>10} {:>10} {:>10} {:>10} {:>8} {:>9} {:>8}\n", "link", "seq s", "ping-pong", "compute",
             "comm", "pp/seq", "hidden", "GB/s");
  for (const char* name : {"real", "emulated"}) {
    if (!r.contains(name)) continue;
    const json& j = r[name];
    const std::string label = std::string(name) == "real"
                                  ? std::string("as is (") + r["comm"].get<std::string>() + ")"
                                  : fmt::format("emulated {:.2f} GB/s", j["link_gbps"].get<double>());
    fmt::print("{:<22} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>8.3f} {:>8.0f}% {:>8.2f}\n", label,
               j["seq_seconds"].get<double>(), j["pingpong_seconds"].get<double>(), j["compute_seconds"].get<double>(),
               j["comm_seconds"].get<double>(), j["pingpong_over_seq"].get<double>(),
               100.0 * j["hidden_fraction"].get<double>(), j["achieved_gbps"].get<double>());
  }
}

}  // namespace distca::tools
