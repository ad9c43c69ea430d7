#include "distca/bench/bench_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "distca/plan/planner.h"
#include "distca/plan/workload.h"
#include "distca/sim/timing.h"
#include "distca/core/memory.h"
#include "distca/bench/spread.h"

namespace distca::bench {

using nlohmann::json;

Status validate(const LinkBenchOptions& o) {
  if (o.ranks < 2 || o.ranks > 64) return invalid_argument(fmt::format("--ranks must be 2..64, got {}", o.ranks));
  if (o.tokens_per_rank < 64 || o.tokens_per_rank > (int64_t{1} << 20)) {
    return invalid_argument(fmt::format("--tokens-per-rank must be 64..1048576, got {}", o.tokens_per_rank));
  }
  if (o.q_heads < 1 || o.kv_heads < 1 || o.q_heads % o.kv_heads != 0 || o.q_heads > 1024) {
    return invalid_argument(fmt::format("--heads ({}) must be a positive multiple of --kv-heads ({}), at most 1024",
                                        o.q_heads, o.kv_heads));
  }
  if (o.head_dim < 1 || o.head_dim > 1024) return invalid_argument(fmt::format("--head-dim must be 1..1024, got {}", o.head_dim));
  if (o.dtype_bytes != 2 && o.dtype_bytes != 4) {
    return invalid_argument(fmt::format("--dtype-bytes must be 2 or 4, got {}", o.dtype_bytes));
  }
  if (o.backward_mode != "stateless" && o.backward_mode != "stateful") {
    return invalid_argument(fmt::format("--backward must be stateless or stateful, got '{}'", o.backward_mode));
  }
  if (!(o.rate_gbit >= 0) || !std::isfinite(o.rate_gbit) || o.rate_gbit > 1e6) {
    return invalid_argument(fmt::format("--rate-gbit must be 0 (no model) or a rate in Gbit/s, got {}", o.rate_gbit));
  }
  if (o.repeats < 1 || o.repeats > 1000) return invalid_argument(fmt::format("--repeats must be 1..1000, got {}", o.repeats));
  DISTCA_RETURN_IF_ERROR(plan::builtin_distribution(o.workload).status());
  DISTCA_RETURN_IF_ERROR(plan::find_planner(o.policy).status());
  return Status::ok();
}

namespace {

using Clock = std::chrono::steady_clock;

// This rank's side of one phase's all-to-all: counts and offsets in bytes.
struct Exchange {
  std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
  int64_t send_total = 0, recv_total = 0;
};

Exchange exchange_of(const std::vector<plan::Flow>& flows, int rank, int R) {
  Exchange e;
  e.send_counts.assign(R, 0);
  e.recv_counts.assign(R, 0);
  for (const plan::Flow& f : flows) {
    if (f.src == rank) e.send_counts[f.dst] += f.bytes;
    if (f.dst == rank) e.recv_counts[f.src] += f.bytes;
  }
  e.send_offsets.assign(R, 0);
  e.recv_offsets.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    e.send_offsets[r] = e.send_total;
    e.send_total += e.send_counts[r];
    e.recv_offsets[r] = e.recv_total;
    e.recv_total += e.recv_counts[r];
  }
  return e;
}

// Seconds of one exchange on the slowest rank, every rank starting after a barrier.
Result<double> time_exchange(comm::Communicator& c, const Exchange& e, std::vector<std::byte>& send,
                             std::vector<std::byte>& recv) {
  DISTCA_RETURN_IF_ERROR(c.barrier());
  const auto t0 = Clock::now();
  DISTCA_RETURN_IF_ERROR(c.all_to_all_v({send.data(), e.send_counts, e.send_offsets, recv.data(), e.recv_counts,
                                         e.recv_offsets}));
  const double mine = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<float> all(static_cast<size_t>(c.size()), 0.0f);
  all[c.rank()] = static_cast<float>(mine);
  DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  return static_cast<double>(*std::max_element(all.begin(), all.end()));
}

json spread_json(const Spread& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

}  // namespace

Result<json> run_link_bench(comm::Communicator& c, const LinkBenchOptions& o,
                            const std::function<void(const std::string&)>& progress) {
  DISTCA_RETURN_IF_ERROR(validate(o));
  const int R = c.size();
  if (R < 2) return invalid_argument("bench link needs 2 or more ranks: nothing crosses a link otherwise");
  auto say = [&](const std::string& line) {
    if (c.rank() == 0) progress(line);
  };
  DISTCA_ASSIGN_OR_RETURN(plan::LengthDistribution dist, plan::builtin_distribution(o.workload));
  plan::SamplingOptions sampling;
  sampling.seed = o.seed;
  DISTCA_ASSIGN_OR_RETURN(plan::Batch batch, plan::sample_batch(dist, sampling, R, o.tokens_per_rank));
  plan::ModelShape model;
  model.name = "bench-link";
  model.num_layers = 1;
  model.num_q_heads = static_cast<int>(o.q_heads);
  model.num_kv_heads = static_cast<int>(o.kv_heads);
  model.head_dim = static_cast<int>(o.head_dim);
  model.hidden = static_cast<int>(o.q_heads * o.head_dim);
  model.ffn_hidden = 4 * model.hidden;
  model.dtype_bytes = static_cast<int>(o.dtype_bytes);
  const plan::CostModel cost(model, plan::ThroughputProfile{});
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn planner, plan::find_planner(o.policy));
  DISTCA_ASSIGN_OR_RETURN(plan::Plan p, planner(batch, cost, plan::PlannerOptions{}));
  const plan::BackwardMode mode =
      o.backward_mode == "stateful" ? plan::BackwardMode::kStateful : plan::BackwardMode::kStateless;
  const plan::TokenBytes tb = plan::token_bytes(o.q_heads, o.kv_heads, o.head_dim, o.dtype_bytes, plan::GradReturn::kFp32);
  const plan::Traffic traffic = plan::count_traffic(batch, tb, p.tasks, mode);

  std::array<Exchange, plan::kNumPhases> ex;
  int64_t buffer = 1;
  for (int ph = 0; ph < plan::kNumPhases; ++ph) {
    ex[ph] = exchange_of(plan::count_flows(batch, tb, p.tasks, static_cast<plan::Phase>(ph), mode), c.rank(), R);
    buffer = std::max({buffer, ex[ph].send_total, ex[ph].recv_total});
  }
  // Memory, before the buffers: every rank holds a send and a receive buffer of its largest
  // phase; the ranks on this machine together (all of them as threads; mpirun's local ranks, the
  // largest each) must fit. Every rank finds the same and refuses alike (exit 2, one line).
  std::vector<int64_t> rank_buffer(static_cast<size_t>(R), 1);
  for (const plan::PhaseTraffic& t : traffic.phases) {
    for (int r = 0; r < R; ++r) rank_buffer[r] = std::max({rank_buffer[r], t.send_bytes[r], t.recv_bytes[r]});
  }
  const int here = ranks_on_this_machine(R);
  int64_t needed = 0;
  if (here == R) {
    for (int64_t b : rank_buffer) needed += 2 * b;
  } else {
    needed = 2 * here * *std::max_element(rank_buffer.begin(), rank_buffer.end());
  }
  DISTCA_RETURN_IF_ERROR(check_memory(
      "bench link", needed,
      fmt::format("{} rank{} x a send and a receive buffer of up to {} each, the largest phase's bytes at Hq {} Hkv {} D "
                  "{} and {} tokens per rank",
                  here, here == 1 ? "" : "s", memory_text(*std::max_element(rank_buffer.begin(), rank_buffer.end())),
                  o.q_heads, o.kv_heads, o.head_dim, o.tokens_per_rank),
      kBenchMemoryShare, "lower --heads, --kv-heads, --head-dim or --tokens-per-rank, or run fewer ranks per machine"));
  std::vector<std::byte> send(static_cast<size_t>(buffer), std::byte{1}), recv(static_cast<size_t>(buffer));
  // The link's latency: a one-byte exchange with every peer, the median of its repeats.
  Exchange probe;
  probe.send_counts.assign(R, 1);
  probe.recv_counts.assign(R, 1);
  probe.send_counts[c.rank()] = probe.recv_counts[c.rank()] = 0;
  for (int r = 0; r < R; ++r) probe.send_offsets.push_back(r), probe.recv_offsets.push_back(r);
  std::vector<double> probe_seconds;
  say("warm-up: one of each exchange");
  for (int ph = 0; ph < plan::kNumPhases; ++ph) DISTCA_RETURN_IF_ERROR(time_exchange(c, ex[ph], send, recv).status());
  const int probes = std::max(9, 3 * o.repeats);
  for (int i = 0; i < probes; ++i) {
    DISTCA_ASSIGN_OR_RETURN(double s, time_exchange(c, probe, send, recv));
    probe_seconds.push_back(s);
  }
  const double latency = spread_of(probe_seconds).median;
  std::array<std::vector<double>, plan::kNumPhases> seconds;
  std::vector<double> layer_seconds;
  for (int rep = 0; rep < o.repeats; ++rep) {
    double layer = 0;
    for (int ph = 0; ph < plan::kNumPhases; ++ph) {
      DISTCA_ASSIGN_OR_RETURN(double s, time_exchange(c, ex[ph], send, recv));
      seconds[ph].push_back(s);
      layer += s;
    }
    layer_seconds.push_back(layer);
    say(fmt::format("repeat {}/{}: one layer's four exchanges {:.4f} s", rep + 1, o.repeats, layer));
  }

  const sim::Link link{latency, o.rate_gbit * 1e9 / 8};
  json phases = json::array();
  double predicted_layer = 0;
  for (int ph = 0; ph < plan::kNumPhases; ++ph) {
    const plan::PhaseTraffic& t = traffic.phases[ph];
    int64_t busiest = 0;
    for (int r = 0; r < R; ++r) busiest = std::max({busiest, t.send_bytes[r], t.recv_bytes[r]});
    const Spread s = spread_of(seconds[ph]);
    json j = {{"phase", plan::phase_name(static_cast<plan::Phase>(ph))},
              {"total_bytes", t.total_bytes},
              {"busiest_rank_bytes", busiest},
              {"measured_seconds", spread_json(s)},
              {"achieved_gbit", s.median > 0 ? 8.0 * busiest / s.median / 1e9 : 0.0}};
    if (o.rate_gbit > 0) {
      const double predicted = sim::exchange_seconds(t.send_bytes, t.recv_bytes, link);
      predicted_layer += predicted;
      j["predicted_seconds"] = predicted;
      j["measured_over_predicted"] = predicted > 0 ? s.median / predicted : 0.0;
    }
    phases.push_back(j);
  }
  const Spread layer = spread_of(layer_seconds);
  json report = {{"benchmark", "link"},
                 {"ranks", R},
                 {"communicator", c.name()},
                 {"workload", o.workload},
                 {"tokens_per_rank", o.tokens_per_rank},
                 {"heads", {{"q", o.q_heads}, {"kv", o.kv_heads}, {"dim", o.head_dim}}},
                 {"dtype_bytes", o.dtype_bytes},
                 {"policy", o.policy},
                 {"backward_mode", o.backward_mode},
                 {"repeats", o.repeats},
                 {"latency_seconds", spread_json(spread_of(probe_seconds))},
                 {"phases", phases},
                 {"layer_seconds", spread_json(layer)},
                 {"rate_gbit", o.rate_gbit}};
  if (o.rate_gbit > 0) {
    report["predicted_layer_seconds"] = predicted_layer;
    report["layer_measured_over_predicted"] = predicted_layer > 0 ? layer.median / predicted_layer : 0.0;
  }
  return report;
}

void print_link_report(const json& j) {
  fmt::print("distca bench link: {} ranks over {}, {} batch of {} tokens per rank, Hq {} Hkv {} D {}, {} bytes per "
             "element, planner {}, {} backward; medians of {} repeats on the slowest rank\n",
             j["ranks"].get<int>(), j["communicator"].get<std::string>(), j["workload"].get<std::string>(),
             j["tokens_per_rank"].get<int64_t>(), j["heads"]["q"].get<int64_t>(), j["heads"]["kv"].get<int64_t>(),
             j["heads"]["dim"].get<int64_t>(), j["dtype_bytes"].get<int64_t>(), j["policy"].get<std::string>(),
             j["backward_mode"].get<std::string>(), j["repeats"].get<int>());
  const double rate = j["rate_gbit"].get<double>();
  fmt::print("latency (one-byte exchange, measured): {:.1f} us; model link: {}\n\n",
             1e6 * j["latency_seconds"]["median"].get<double>(),
             rate > 0 ? fmt::format("{} Gbit/s + that latency (sim::exchange_seconds)", rate)
                      : std::string("none (--rate-gbit not given)"));
  fmt::print("{:<14} {:>12} {:>24} {:>10} {:>12} {:>10}\n", "phase", "busiest MB", "measured s (min..max)",
             "Gbit/s", "predicted s", "meas/pred");
  for (const auto& p : j["phases"]) {
    const auto& m = p["measured_seconds"];
    fmt::print("{:<14} {:>12.2f} {:>24} {:>10.3f} {:>12} {:>10}\n", p["phase"].get<std::string>(),
               p["busiest_rank_bytes"].get<int64_t>() / 1e6,
               fmt::format("{:.4f} ({:.4f}..{:.4f})", m["median"].get<double>(), m["min"].get<double>(),
                           m["max"].get<double>()),
               p["achieved_gbit"].get<double>(),
               p.contains("predicted_seconds") ? fmt::format("{:.4f}", p["predicted_seconds"].get<double>()) : "-",
               p.contains("measured_over_predicted") ? fmt::format("{:.3f}", p["measured_over_predicted"].get<double>())
                                                     : "-");
  }
  const auto& l = j["layer_seconds"];
  fmt::print("{:<14} {:>12} {:>24} {:>10} {:>12} {:>10}\n", "layer (sum)", "",
             fmt::format("{:.4f} ({:.4f}..{:.4f})", l["median"].get<double>(), l["min"].get<double>(), l["max"].get<double>()),
             "", j.contains("predicted_layer_seconds") ? fmt::format("{:.4f}", j["predicted_layer_seconds"].get<double>()) : "-",
             j.contains("layer_measured_over_predicted") ? fmt::format("{:.3f}", j["layer_measured_over_predicted"].get<double>())
                                                         : "-");
}

}  // namespace distca::bench
