#include "distca/sim/simulate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "distca/plan/cost.h"
#include "distca/plan/planner.h"
#include "distca/plan/workload.h"

namespace distca::sim {

namespace {

constexpr int64_t kVocab = 128256;  // Llama 3 tokenizer

struct Ctx {
  Ctx(const Profile& p, const SimOptions& options) : prof(p), o(options), model(options.model) {}
  const Profile& prof;
  const SimOptions& o;
  plan::ModelShape model;
  int U = 0, S = 0, D = 0, L = 0, cp = 1;
  int64_t T = 0;
  int64_t hq = 0, head_dim = 0;
  double lin_f = 0, lin_b = 0;  // seconds per token per layer
  plan::TokenBytes tb;
  Link link;
  double act_bytes_per_token_layer = 0;  // per GPU
  double state_bytes = 0;                // per GPU: weights, gradients, optimizer states
  double allreduce = 0;
  plan::LengthDistribution dist = plan::LengthDistribution::from_sample("none", {1});
  Progress* progress = nullptr;  // may be null
  std::string stage;             // the system (and iteration) being simulated, for progress lines
  void say(const std::string& what) const {
    if (progress != nullptr) progress->stage(what.empty() ? stage : stage + ": " + what);
  }
};

plan::ThroughputProfile planner_profile(const Ctx& c) {
  plan::ThroughputProfile t;
  t.tile_rows = c.prof.attention.front().tile_rows;
  // A task pays the profile's overhead once forward and once backward (Profile::attention_seconds).
  t.task_overhead_seconds = c.prof.attention.front().task_overhead_seconds * 2;
  // The rate by key range, forward and backward together, as the profile prices a task: the
  // difference of two pair counts of one shape cancels the per-task overhead.
  const int64_t rows = std::max<int64_t>(t.tile_rows, 128);
  for (int64_t keys = 128; keys <= (int64_t{1} << 22); keys *= 2) {
    auto seconds = [&](int64_t pairs) {
      return c.prof.attention_seconds(rows, keys, pairs, c.hq, c.head_dim, false) +
             c.prof.attention_seconds(rows, keys, pairs, c.hq, c.head_dim, true);
    };
    const int64_t p1 = rows * keys, p2 = 2 * rows * keys;
    const double rate = 3.5 * 4.0 * c.head_dim * c.hq * static_cast<double>(p2 - p1) / (seconds(p2) - seconds(p1));
    t.rate_by_keys.push_back({keys, rate});
  }
  t.flops_per_second = 0;
  for (const plan::RatePoint& r : t.rate_by_keys) t.flops_per_second = std::max(t.flops_per_second, r.flops_per_second);
  t.source = "from the simulator's profile";
  return t;
}

// Attention seconds per server of one layer (forward or backward) of a task list.
std::vector<double> server_seconds(const Ctx& c, const std::vector<plan::Task>& tasks, int R, bool is_backward) {
  std::vector<double> s(static_cast<size_t>(R), 0.0);
  const AttentionPricer price(c.prof, c.hq, c.head_dim);
  for (const plan::Task& t : tasks) s[t.server] += price.seconds(t.q_len(), t.k1 - t.k0, t.pairs(), is_backward);
  return s;
}

// Per unit, seconds on the link of one phase: the larger of its send and receive.
std::vector<double> phase_seconds(const Ctx& c, const plan::PhaseTraffic& p, int R) {
  std::vector<double> s(static_cast<size_t>(R), 0.0);
  for (int r = 0; r < R; ++r) {
    const double bytes = static_cast<double>(std::max(p.send_bytes[r], p.recv_bytes[r]));
    s[r] = bytes > 0 ? c.link.latency_seconds + bytes / c.link.bytes_per_second : 0.0;
  }
  return s;
}

double vmax(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }
double vmean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// Micro-batch m of every replica: one packed sequence of `context` tokens each (rank = replica).
Result<plan::Batch> sequences(const Ctx& c, int m) {
  plan::SamplingOptions so = c.o.sampling;
  so.seed = c.o.seed * 1000003 + static_cast<uint64_t>(m);
  return plan::sample_batch(c.dist, so, c.D, c.o.context);
}

// Each replica's documents (pieces of its sequence, in order).
std::vector<std::vector<int64_t>> replica_docs(const plan::Batch& seqs) {
  std::vector<std::vector<int64_t>> docs(static_cast<size_t>(seqs.num_ranks));
  for (const plan::Piece& p : seqs.pieces) docs[p.rank].push_back(p.length());
  return docs;
}

// One micro-batch's layout, planned: per-unit attention seconds (one layer) and link seconds.
struct Planned {
  std::vector<double> attn_f, attn_b, disp_f, ret_f, disp_b, ret_b;
  int64_t bytes = 0;  // one layer, all phases, all units
};

Result<Planned> plan_batch(const Ctx& c, const plan::Batch& batch, const std::string& policy, plan::BackwardMode mode,
                           double tolerance) {
  DISTCA_ASSIGN_OR_RETURN(plan::PlanFn fn, plan::find_planner(policy));
  plan::PlannerOptions po;
  po.tolerance = tolerance;
  po.granularity = c.o.granularity;
  const plan::CostModel cost(c.model, planner_profile(c));
  DISTCA_ASSIGN_OR_RETURN(plan::Plan p, fn(batch, cost, po));
  const int R = batch.num_ranks;
  Planned out;
  out.attn_f = server_seconds(c, p.tasks, R, false);
  out.attn_b = server_seconds(c, p.tasks, R, true);
  // The paper's system returns dK/dV in the activation dtype; ours in the model's grad_return
  // (--grad-return), summed at the owner in fp32 either way.
  plan::TokenBytes tb = c.tb;
  if (policy == "distca") tb.bwd_dkv = tb.kv;
  const plan::Traffic t = plan::count_traffic(batch, tb, p.tasks, mode);
  out.disp_f = phase_seconds(c, t.phases[0], R);
  out.ret_f = phase_seconds(c, t.phases[1], R);
  out.disp_b = phase_seconds(c, t.phases[2], R);
  out.ret_b = phase_seconds(c, t.phases[3], R);
  for (const auto& ph : t.phases) out.bytes += ph.total_bytes;
  return out;
}

// Fills a result from its per-unit seconds (without the all-reduce, which every unit pays) and
// its slowest replica's time. No unit computes or sends for longer than the iteration lasts, so
// every unit's idle (the iteration less its work) is >= 0, and the means add up to the time.
void finish(const Ctx& c, SystemResult& r, const std::vector<double>& linear, const std::vector<double>& attention,
            std::vector<double> comm, double compute_seconds) {
  r.allreduce = c.allreduce;
  r.seconds = compute_seconds + c.allreduce;
  for (double& x : comm) x += c.allreduce;
  r.unit_linear = linear;
  r.unit_attention = attention;
  r.unit_comm = std::move(comm);
  r.linear = vmean(r.unit_linear);
  r.attention = vmean(r.unit_attention);
  r.comm = vmean(r.unit_comm);
  r.idle = r.seconds - r.linear - r.attention - r.comm;
  r.state_memory = c.state_bytes;
  r.memory_per_gpu = vmax(r.unit_memory) + c.state_bytes;
  r.device_memory = c.prof.device_memory_bytes;
  r.iteration_cp = {r.cp};
  r.iteration_seconds = {r.seconds};
}

// The mean of one system's iterations (see SystemResult).
SystemResult mean_of(const std::vector<SystemResult>& runs) {
  const double n = static_cast<double>(runs.size());
  SystemResult m = runs[0];
  m.iteration_cp.clear(), m.iteration_seconds.clear(), m.iteration_tolerance.clear();
  m.seconds = m.linear = m.attention = m.comm = m.allreduce = 0;
  double bytes = 0;
  for (auto* v : {&m.unit_linear, &m.unit_attention, &m.unit_comm}) v->assign(v->size(), 0.0);
  for (const SystemResult& r : runs) {
    m.iteration_cp.push_back(r.cp), m.iteration_seconds.push_back(r.seconds);
    if (r.tolerance) m.iteration_tolerance.push_back(*r.tolerance);
    m.seconds += r.seconds / n, m.linear += r.linear / n, m.attention += r.attention / n, m.comm += r.comm / n;
    m.allreduce += r.allreduce / n;
    bytes += static_cast<double>(r.bytes) / n;
    for (size_t u = 0; u < m.unit_linear.size(); ++u) {
      m.unit_linear[u] += r.unit_linear[u] / n, m.unit_attention[u] += r.unit_attention[u] / n;
      m.unit_comm[u] += r.unit_comm[u] / n;
      m.unit_memory[u] = std::max(m.unit_memory[u], r.unit_memory[u]);
    }
    m.memory_per_gpu = std::max(m.memory_per_gpu, r.memory_per_gpu);
  }
  m.idle = m.seconds - m.linear - m.attention - m.comm;
  m.bytes = static_cast<int64_t>(std::llround(bytes));
  // The CP degree most iterations ran at (the larger one on a tie).
  int best = 0;
  for (int cp : m.iteration_cp) {
    const auto count = [&](int x) { return std::count(m.iteration_cp.begin(), m.iteration_cp.end(), x); };
    if (count(cp) > count(best) || (count(cp) == count(best) && cp > best)) best = cp;
  }
  m.cp = best;
  return m;
}

// Unit index of (stage, replica, cp rank).
int unit(const Ctx& c, int s, int x, int i) { return (s * c.D + x) * c.cp + i; }

double doc_attention(const Ctx& c, int64_t len, bool is_backward) {
  return c.prof.attention_seconds(len, len, plan::causal_pairs(0, len), c.hq, c.head_dim, is_backward);
}

// Forward / backward seconds of one layer's CP exchange over cp units: the all-gather of
// `tokens` tokens of K/V, and backward the reduce-scatter of their dK/dV (same dtype).
double cp_seconds(const Ctx& c, double tokens, bool is_backward) {
  const double kv = tokens * static_cast<double>(c.tb.kv);
  return collective_seconds(is_backward ? Collective::kReduceScatter : Collective::kAllGather, kv, c.cp, c.link);
}

// A chunk (a set of documents) on one CP group: one layer's forward and backward seconds of its
// slowest unit, and the per-unit numbers.
struct Chunk {
  double f = 0, b = 0;
  std::vector<double> lin, attn, comm;
  std::vector<int64_t> tokens;
};

// Per-document context parallelism, as Megatron (THD) and WLB-LLM run it: every document is
// cut into 2 cp pieces, unit i holding pieces i and 2cp-1-i, so each unit computes 1/cp of
// every document's attention in pieces of len / 2cp query rows; the chunk's whole K/V is
// all-gathered per layer and its dK/dV reduce-scattered, exposed.
Chunk place_chunk(const Ctx& c, const std::vector<int64_t>& docs, int64_t* bytes) {
  Chunk ch;
  ch.lin.assign(c.cp, 0.0), ch.attn.assign(c.cp, 0.0), ch.comm.assign(c.cp, 0.0), ch.tokens.assign(c.cp, 0);
  double tokens = 0, af = 0, ab = 0;
  for (int64_t len : docs) {
    tokens += static_cast<double>(len);
    const int64_t rows = std::max<int64_t>(1, len / (2 * c.cp));
    const int64_t pairs = plan::causal_pairs(0, len) / c.cp;
    af += c.prof.attention_seconds(rows, len, pairs, c.hq, c.head_dim, false);
    ab += c.prof.attention_seconds(rows, len, pairs, c.hq, c.head_dim, true);
  }
  const double cf = c.cp > 1 ? cp_seconds(c, tokens, false) : 0.0, cb = c.cp > 1 ? cp_seconds(c, tokens, true) : 0.0;
  const double tok = tokens / c.cp;
  for (int i = 0; i < c.cp; ++i) {
    ch.lin[i] = tok * (c.lin_f + c.lin_b), ch.attn[i] = af + ab, ch.comm[i] = cf + cb;
    ch.tokens[i] = static_cast<int64_t>(tok);
  }
  ch.f = tok * c.lin_f + af + cf, ch.b = tok * c.lin_b + ab + cb;
  if (c.cp > 1) *bytes += static_cast<int64_t>(2 * tokens * static_cast<double>(c.tb.kv) * (c.cp - 1));
  return ch;
}

// Runs chunks (per replica, in order) through the replica's stages: 1F1B, or one after another
// with DP only. Fills per-unit numbers; returns the slowest replica's seconds.
double run_chunks(const Ctx& c, const std::vector<std::vector<Chunk>>& chunks, SystemResult& r,
                  std::vector<double>& lin, std::vector<double>& attn, std::vector<double>& comm) {
  const double layers = static_cast<double>(c.L) / c.S;
  double seconds = 0;
  for (int x = 0; x < c.D; ++x) {
    std::vector<std::vector<double>> f(c.S), b(c.S);
    for (int s = 0; s < c.S; ++s) {
      for (const Chunk& ch : chunks[x]) {
        f[s].push_back(layers * ch.f), b[s].push_back(layers * ch.b);
        for (int i = 0; i < c.cp; ++i) {
          const int u = unit(c, s, x, i);
          lin[u] += layers * ch.lin[i], attn[u] += layers * ch.attn[i], comm[u] += layers * ch.comm[i];
          r.unit_memory[u] = std::max(r.unit_memory[u], static_cast<double>(ch.tokens[i]) * layers *
                                                            c.act_bytes_per_token_layer * std::min<int>(c.S - s, chunks[x].size()));
        }
      }
    }
    double t = 0;
    if (c.S == 1) {
      for (size_t m = 0; m < f[0].size(); ++m) t += f[0][m] + b[0][m];
    } else {
      t = one_f_one_b(f, b, 0).seconds;
    }
    seconds = std::max(seconds, t);
  }
  return seconds;
}

Result<SystemResult> colocated(const Ctx& c) {
  SystemResult r;
  r.system = "colocated";
  r.cp = c.cp;
  std::vector<double> lin(c.U, 0.0), attn(c.U, 0.0), comm(c.U, 0.0);
  r.unit_memory.assign(c.U, 0.0);
  std::vector<std::vector<Chunk>> chunks(c.D);
  for (int m = 0; m < c.o.batch; ++m) {
    DISTCA_ASSIGN_OR_RETURN(plan::Batch seqs, sequences(c, m));
    const auto docs = replica_docs(seqs);
    for (int x = 0; x < c.D; ++x) chunks[x].push_back(place_chunk(c, docs[x], &r.bytes));
  }
  r.bytes = static_cast<int64_t>(static_cast<double>(r.bytes) * c.L / c.S);
  const double seconds = run_chunks(c, chunks, r, lin, attn, comm);
  finish(c, r, lin, attn, comm, seconds);
  return r;
}

// WLB at one CP degree: the iteration's documents (all replicas' with DP only, each pipeline's
// own with PP and an unchanged CP degree) re-packed into variable-length chunks balanced by
// linear + attention cost, longest first onto the least loaded chunk; chunks go heaviest first
// to the least loaded replica of gpus / (tp pp cp) replicas, `batch` each.
Result<SystemResult> wlb_at(const Ctx& c, int cp) {
  Ctx w = c;
  w.cp = cp;
  w.D = c.U / (c.S * cp);
  SystemResult r;
  r.system = "wlb";
  r.cp = cp;
  std::vector<double> lin(c.U, 0.0), attn(c.U, 0.0), comm(c.U, 0.0);
  r.unit_memory.assign(c.U, 0.0);
  const int pools = c.S == 1 || cp != c.cp ? 1 : c.D;
  std::vector<std::vector<int64_t>> pool(pools);
  for (int m = 0; m < c.o.batch; ++m) {
    DISTCA_ASSIGN_OR_RETURN(plan::Batch seqs, sequences(c, m));
    const auto docs = replica_docs(seqs);
    for (int x = 0; x < c.D; ++x) pool[pools == 1 ? 0 : x].insert(pool[pools == 1 ? 0 : x].end(), docs[x].begin(), docs[x].end());
  }
  auto cost = [&](int64_t len) { return len * (c.lin_f + c.lin_b) + doc_attention(c, len, false) + doc_attention(c, len, true); };
  std::vector<std::vector<Chunk>> chunks(w.D);
  for (int p = 0; p < pools; ++p) {
    auto& docs = pool[p];
    std::sort(docs.rbegin(), docs.rend());
    const int n = pools == 1 ? w.D * c.o.batch : c.o.batch;
    std::vector<std::vector<int64_t>> bins(n);
    std::vector<double> load(n, 0.0);
    for (int64_t len : docs) {
      const int best = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      bins[best].push_back(len), load[best] += cost(len);
    }
    if (pools > 1) {
      for (auto& bin : bins) chunks[p].push_back(place_chunk(w, bin, &r.bytes));
      continue;
    }
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return load[a] > load[b]; });
    std::vector<double> replica(w.D, 0.0);
    for (int k : order) {
      int best = -1;
      for (int x = 0; x < w.D; ++x) {
        if (static_cast<int>(chunks[x].size()) >= c.o.batch) continue;
        if (best < 0 || replica[x] < replica[best]) best = x;
      }
      chunks[best].push_back(place_chunk(w, bins[k], &r.bytes));
      replica[best] += chunks[best].back().f + chunks[best].back().b;
    }
  }
  r.bytes = static_cast<int64_t>(static_cast<double>(r.bytes) * c.L / c.S);
  const double seconds = run_chunks(w, chunks, r, lin, attn, comm);
  finish(c, r, lin, attn, comm, seconds);
  return r;
}

// The CP degrees WLB is tried at: o.wlb_cp, or as the paper's baseline sweep does for
// "WLB-ideal", the two largest powers of two that divide a stage's units and leave at most two
// replicas per sequence of the iteration (smaller degrees give variable-length chunks too long
// for a CP group's memory).
std::vector<int> wlb_cps(const Ctx& c) {
  if (c.o.wlb_cp > 0) return {c.o.wlb_cp};
  std::vector<int> out;
  const int stage_units = c.U / c.S;
  for (int cp = 1 << 20; cp >= 1 && out.size() < 2; cp /= 2) {
    if (cp <= stage_units && stage_units % cp == 0 && stage_units / cp <= 2 * c.D * c.o.batch) out.push_back(cp);
  }
  return out;
}

Result<SystemResult> wlb(const Ctx& c) {
  std::optional<SystemResult> best;
  for (int cp : wlb_cps(c)) {
    DISTCA_ASSIGN_OR_RETURN(SystemResult r, wlb_at(c, cp));
    if (!best || r.seconds < best->seconds) best = std::move(r);
  }
  if (!best) return invalid_argument("no CP degree fits wlb");
  return std::move(*best);
}

Result<SystemResult> cad(const Ctx& c, const std::string& name, const std::string& policy, plan::BackwardMode mode,
                         double tolerance, const std::string& sweep = "") {
  SystemResult r;
  r.system = name;
  r.cp = c.cp;
  r.tolerance = tolerance;
  std::vector<double> lin(c.U, 0.0), attn(c.U, 0.0), comm(c.U, 0.0);
  r.unit_memory.assign(c.U, 0.0);
  const double layers = static_cast<double>(c.L) / c.S;
  const double lin_f = static_cast<double>(c.T) * c.lin_f, lin_b = static_cast<double>(c.T) * c.lin_b;
  // Waves of micro-batches planned together: one with DP only, pp with PP (the ones in flight).
  const int wave = c.S;
  std::vector<std::vector<std::vector<double>>> f(c.D, std::vector<std::vector<double>>(c.S)), b = f;
  double seconds = 0;
  for (int w = 0; w * wave < c.o.batch; ++w) {
    const int in_wave = std::min(wave, c.o.batch - w * wave);
    std::vector<int64_t> lengths;  // sequences in unit order: (micro-batch in wave, replica)
    for (int j = 0; j < in_wave; ++j) {
      DISTCA_ASSIGN_OR_RETURN(plan::Batch seqs, sequences(c, w * wave + j));
      for (const auto& docs : replica_docs(seqs)) lengths.insert(lengths.end(), docs.begin(), docs.end());
    }
    const int R = in_wave * c.D * c.cp;
    c.say(fmt::format("eps {:g}{}, micro-batch{} {} of {}: planning {} ranks with {}", tolerance, sweep,
                      in_wave > 1 ? "es" : "", in_wave > 1 ? fmt::format("{}-{}", w * wave + 1, w * wave + in_wave)
                                                            : fmt::format("{}", w * wave + 1),
                      c.o.batch, R, policy));
    DISTCA_ASSIGN_OR_RETURN(plan::Batch batch, plan::pack_documents(lengths, R, c.T));
    DISTCA_ASSIGN_OR_RETURN(Planned p, plan_batch(c, batch, policy, mode, tolerance));
    r.bytes += static_cast<int64_t>(static_cast<double>(p.bytes) * layers);
    if (c.S == 1) {
      // Every unit meets the others at each exchange: each operation takes its slowest unit's
      // time; each nano-batch carries half of everything.
      const LayerOps fwd{lin_f / 2, vmax(p.disp_f) / 2, vmax(p.attn_f) / 2, vmax(p.ret_f) / 2};
      const LayerOps bwd{lin_b / 2, vmax(p.disp_b) / 2, vmax(p.attn_b) / 2, vmax(p.ret_b) / 2};
      std::vector<std::array<LayerOps, 2>> ops(static_cast<size_t>(c.L), {fwd, fwd});
      ops.resize(static_cast<size_t>(2 * c.L), {bwd, bwd});
      const double t = pingpong_seconds(ops);
      seconds += t;
      const double busy = c.L * 2 * (fwd.linear + fwd.attention + bwd.linear + bwd.attention);
      for (int u = 0; u < c.U; ++u) comm[u] += std::max(0.0, t - busy);
    }
    for (int j = 0; j < in_wave; ++j) {
      for (int x = 0; x < c.D; ++x) {
        double af = 0, ab = 0, ef = 0, eb = 0;
        for (int i = 0; i < c.cp; ++i) {
          const int k = (j * c.D + x) * c.cp + i;
          af = std::max(af, p.attn_f[k]), ab = std::max(ab, p.attn_b[k]);
          // Ping-pong hides the link behind compute where it can; the rest is exposed.
          ef = std::max(ef, p.disp_f[k] + p.ret_f[k] - lin_f - p.attn_f[k]);
          eb = std::max(eb, p.disp_b[k] + p.ret_b[k] - lin_b - p.attn_b[k]);
        }
        for (int s = 0; s < c.S; ++s) {
          f[x][s].push_back(layers * (lin_f + af + std::max(0.0, ef)));
          b[x][s].push_back(layers * (lin_b + ab + std::max(0.0, eb)));
          for (int i = 0; i < c.cp; ++i) {
            const int k = (j * c.D + x) * c.cp + i, u = unit(c, s, x, i);
            lin[u] += layers * (lin_f + lin_b);
            attn[u] += layers * (p.attn_f[k] + p.attn_b[k]);
            if (c.S > 1) comm[u] += layers * (std::max(0.0, ef) + std::max(0.0, eb));
            r.unit_memory[u] = static_cast<double>(c.T) * layers * c.act_bytes_per_token_layer * std::min(c.S - s, c.o.batch);
          }
        }
      }
    }
  }
  if (c.S > 1) {
    for (int x = 0; x < c.D; ++x) seconds = std::max(seconds, one_f_one_b(f[x], b[x], 0).seconds);
  }
  finish(c, r, lin, attn, comm, seconds);
  return r;
}

// A CAD system at the tolerance that gives its fastest iteration, of --tolerance and its halves
// down to a 512th (SimOptions::tolerance_sweep; 1e-4 at the default 0.05, about the finest
// balance cuts of 128 tokens resolve at these sizes): a planner that stops at its bound (minmax,
// minbytes) leaves the busiest server up to eps above the mean even where balancing further
// costs nothing the link cannot hide, so a deployment would tune eps down, and the simulator,
// which prices both sides, does it for every CAD system alike (the paper's planner included).
Result<SystemResult> cad_tuned(const Ctx& c, const std::string& name, const std::string& policy, plan::BackwardMode mode) {
  std::optional<SystemResult> best;
  const int steps = c.o.tolerance_sweep ? 10 : 1;
  double tolerance = c.o.tolerance;
  for (int i = 0; i < steps; ++i, tolerance /= 2) {
    const std::string sweep = steps > 1 ? fmt::format(" ({} of {} in the sweep)", i + 1, steps) : "";
    DISTCA_ASSIGN_OR_RETURN(SystemResult r, cad(c, name, policy, mode, tolerance, sweep));
    if (!best || r.seconds < best->seconds) best = std::move(r);
  }
  return std::move(*best);
}

// One iteration of a system (a name of system_names()).
Result<SystemResult> run_system(const Ctx& c, const std::string& system) {
  if (system == "colocated") return colocated(c);
  if (system == "wlb") return wlb(c);
  if (system == "cad-distca") return cad_tuned(c, system, "distca", plan::BackwardMode::kStateless);
  if (system == "cad-minmax") return cad_tuned(c, system, "minmax", plan::BackwardMode::kStateful);
  return cad_tuned(c, system, std::string(plan::kDefaultPlanner), plan::BackwardMode::kStateful);
}

}  // namespace

Status Cluster::validate() const {
  const std::pair<const char*, int> counts[] = {{"--gpus", gpus}, {"--gpus-per-node", gpus_per_node}, {"--tp", tp}, {"--pp", pp}, {"--cp", cp}};
  for (const auto& [flag, value] : counts) {
    // The same ceiling as `distca plan --ranks`: a cluster larger than that is refused at once,
    // before anything is allocated for it.
    if (value < 1 || value > plan::kMaxRanks) {
      return invalid_argument(fmt::format("{} must be in [1, {}], got {}", flag, plan::kMaxRanks, value));
    }
  }
  if (int64_t{tp} * pp * cp > gpus) {
    return invalid_argument(fmt::format("--tp x --pp x --cp ({} x {} x {}) is more than --gpus ({})", tp, pp, cp, gpus));
  }
  if (gpus % (tp * pp * cp) != 0) {
    return invalid_argument(fmt::format("--gpus ({}) must be a multiple of --tp x --pp x --cp ({} x {} x {})", gpus, tp, pp, cp));
  }
  return Status::ok();
}

Status SimOptions::validate() const {
  DISTCA_RETURN_IF_ERROR(cluster.validate());
  plan::ModelShape m = model;
  m.tp = cluster.tp;
  DISTCA_RETURN_IF_ERROR(m.validate());
  if (model.num_layers % cluster.pp != 0) {
    return invalid_argument(fmt::format("the model's {} layers do not split into {} stages", model.num_layers, cluster.pp));
  }
  if (context < 1024 || context > plan::kMaxTokens) return invalid_argument(fmt::format("--context must be 1K..2G tokens, got {}", context));
  if (context % cluster.cp != 0) return invalid_argument(fmt::format("--context {} does not split into --cp {} units", context, cluster.cp));
  // Each step samples one sequence of `context` tokens per data-parallel replica, all at once.
  if (int64_t{cluster.dp()} * context > plan::kMaxTokens) {
    return invalid_argument(fmt::format("{} data-parallel replicas (--gpus {} / (--tp x --pp x --cp)) x --context {} is "
                                        "more than {} tokens per step; use fewer --gpus or a shorter --context",
                                        cluster.dp(), cluster.gpus, context, plan::kMaxTokens));
  }
  if (batch < 1 || batch > 4096) return invalid_argument(fmt::format("--batch must be 1..4096, got {}", batch));
  if (iterations < 1 || iterations > 1000) return invalid_argument(fmt::format("--iterations must be 1..1000, got {}", iterations));
  if (wlb_cp < 0 || (wlb_cp > 0 && (cluster.units() / cluster.pp) % wlb_cp != 0)) {
    return invalid_argument(fmt::format("--wlb-cp {} must divide a stage's {} units (0: the best of them)", wlb_cp,
                                        cluster.units() / cluster.pp));
  }
  DISTCA_RETURN_IF_ERROR(sampling.validate());
  if (!(tolerance >= 0) || !std::isfinite(tolerance) || tolerance > 1) {
    return invalid_argument(fmt::format("--tolerance must be in [0, 1], got {}", tolerance));
  }
  if (granularity < 1) return invalid_argument(fmt::format("granularity must be >= 1, got {}", granularity));
  // The simulator samples only the built-in workloads (the shared message names the document
  // files `distca plan` also reads, which the simulator does not).
  const std::vector<std::string> names = plan::builtin_distribution_names();
  if (std::find(names.begin(), names.end(), workload) == names.end()) {
    return invalid_argument(fmt::format("--workload must be {}, got '{}'", fmt::join(names, " or "), workload));
  }
  return Status::ok();
}

nlohmann::json SystemResult::to_json() const {
  std::vector<double> unit_idle_seconds;
  for (size_t u = 0; u < unit_linear.size(); ++u) unit_idle_seconds.push_back(unit_idle(u));
  return {{"system", system},
          {"cp", cp},
          {"iteration_cp", iteration_cp},
          {"iteration_tolerance", tolerance ? nlohmann::json(iteration_tolerance) : nlohmann::json(nullptr)},
          {"seconds", seconds},
          {"iteration_seconds", iteration_seconds},
          {"linear_seconds", linear},
          {"attention_seconds", attention},
          {"comm_seconds", comm},
          {"idle_seconds", idle},
          {"allreduce_seconds", allreduce},
          {"bytes", bytes},
          {"unit_linear_seconds", unit_linear},
          {"unit_attention_seconds", unit_attention},
          {"unit_comm_seconds", unit_comm},
          {"unit_idle_seconds", unit_idle_seconds},
          {"unit_activation_bytes", unit_memory},
          {"model_state_bytes_per_gpu", state_memory},
          {"memory_bytes_per_gpu", memory_per_gpu},
          {"device_memory_bytes", device_memory > 0 ? nlohmann::json(device_memory) : nlohmann::json(nullptr)},
          {"fits_memory", device_memory > 0 ? nlohmann::json(fits_memory()) : nlohmann::json(nullptr)}};
}

StepPrediction predict_step(const Profile& profile, const plan::ModelShape& model, const plan::Batch& batch,
                            const std::vector<plan::Task>& tasks, plan::BackwardMode mode,
                            double linear_seconds_per_token_layer, double fixed_seconds) {
  const int R = batch.num_ranks;
  const int64_t hq = model.q_heads_per_rank();
  std::vector<double> af(R, 0.0), ab(R, 0.0), tokens(R, 0.0);
  const AttentionPricer price(profile, hq, model.head_dim);
  for (const plan::Task& t : tasks) {
    const auto [f, b] = price.seconds_both(t.q_len(), t.k1 - t.k0, t.pairs());
    af[t.server] += f;
    ab[t.server] += b;
  }
  for (const plan::Piece& p : batch.pieces) tokens[p.rank] += static_cast<double>(p.length());
  const plan::Traffic traffic =
      plan::count_traffic(batch, plan::token_bytes(model), tasks, mode);
  int64_t moved = 0;
  for (const auto& ph : traffic.phases) moved += ph.total_bytes;
  StepPrediction out;
  const double L = model.num_layers;
  out.linear = vmax(tokens) * linear_seconds_per_token_layer * L;
  if (moved == 0) {  // ranks meet only at the end of the step
    for (int r = 0; r < R; ++r) {
      const double t = tokens[r] * linear_seconds_per_token_layer * L + L * (af[r] + ab[r]);
      out.seconds = std::max(out.seconds, t);
      out.attention = std::max(out.attention, L * (af[r] + ab[r]));
    }
  } else {
    double link = 0;
    for (const auto& ph : traffic.phases) {
      double worst = 0;
      for (int r = 0; r < R; ++r) {
        const double bytes = static_cast<double>(std::max(ph.send_bytes[r], ph.recv_bytes[r]));
        worst = std::max(worst, profile.inter_node.latency_seconds + bytes / profile.inter_node.bytes_per_second);
      }
      link += worst;
    }
    out.attention = L * (vmax(af) + vmax(ab));
    out.comm = L * link;
    out.seconds = out.linear + out.attention + out.comm;
  }
  out.seconds += fixed_seconds;
  return out;
}

StepPrediction predict_pipeline_step(const Profile& profile, const plan::ModelShape& model, const PipelineStepInput& in,
                                     double linear_seconds_per_token_layer, double fixed_seconds) {
  const int P = in.stages, D = in.dp;
  const auto M = static_cast<int>(in.micro_batches.size());
  DISTCA_CHECK(P >= 1 && D >= 1 && M >= 1 && model.num_layers % P == 0) << "pipeline step of " << P << " stages, " << M << " micro-batches";
  const int64_t hq = model.q_heads_per_rank();
  const double layers = static_cast<double>(model.num_layers) / P;
  const double lin_f = linear_seconds_per_token_layer / 3, lin_b = 2 * linear_seconds_per_token_layer / 3;
  auto attention = [&](const plan::Task& t, bool is_backward) {
    return profile.attention_seconds(t.q_len(), t.k1 - t.k0, t.pairs(), hq, model.head_dim, is_backward);
  };
  auto tokens = [](const plan::Batch& b, int rank) {
    int64_t n = 0;
    for (const plan::Piece& p : b.pieces) n += p.rank == rank ? p.length() : 0;
    return static_cast<double>(n);
  };
  StepPrediction out;
  if (in.ticks.empty()) {
    // 1F1B: each (stage, micro-batch) op costs its slowest replica's linear + own attention.
    std::vector<std::vector<double>> f(P, std::vector<double>(M, 0.0)), b = f;
    for (int m = 0; m < M; ++m) {
      const plan::Batch& batch = in.micro_batches[m];
      std::vector<double> af(D, 0.0), ab(D, 0.0);
      for (const plan::Piece& p : batch.pieces) {
        const plan::Task t = plan::causal_task(p.doc, p.begin, p.end, p.rank);
        af[p.rank] += attention(t, false), ab[p.rank] += attention(t, true);
      }
      for (int x = 0; x < D; ++x) {
        for (int s = 0; s < P; ++s) {
          f[s][m] = std::max(f[s][m], layers * (tokens(batch, x) * lin_f + af[x]));
          b[s][m] = std::max(b[s][m], layers * (tokens(batch, x) * lin_b + ab[x]));
        }
      }
    }
    const double message = static_cast<double>(in.micro_batches[0].tokens_per_rank) * model.hidden * 4;
    const double p2p = profile.inter_node.latency_seconds + message / profile.inter_node.bytes_per_second;
    const PipelineTiming t = one_f_one_b(f, b, p2p);
    out.seconds = t.seconds;
    for (const double busy : t.busy) out.attention = std::max(out.attention, busy);
  } else {
    const plan::TokenBytes tb = plan::token_bytes(model);
    for (const PipelineStepInput::Tick& tick : in.ticks) {
      const int R = tick.pool.num_ranks;
      std::vector<double> work(R, 0.0);
      for (const plan::Task& t : tick.tasks) work[t.server] += attention(t, tick.is_backward);
      double attn = 0;
      for (double w : work) attn = std::max(attn, w);
      for (int r = 0; r < R; ++r) work[r] += tokens(tick.pool, r) * (tick.is_backward ? lin_b : lin_f);
      const plan::Traffic traffic = plan::count_traffic(tick.pool, tb, tick.tasks, plan::BackwardMode::kStateless);
      double link = 0;
      const int first = tick.is_backward ? 2 : 0;
      for (int ph = first; ph < first + 2; ++ph) {
        double worst = 0;
        for (int r = 0; r < R; ++r) {
          const double bytes = static_cast<double>(std::max(traffic.phases[ph].send_bytes[r], traffic.phases[ph].recv_bytes[r]));
          worst = std::max(worst, profile.inter_node.latency_seconds + bytes / profile.inter_node.bytes_per_second);
        }
        link += worst;
      }
      double slot = 0;
      for (double w : work) slot = std::max(slot, w);
      out.seconds += layers * (slot + link);
      out.attention += layers * attn;
      out.comm += layers * link;
    }
  }
  out.seconds += fixed_seconds;
  return out;
}

std::vector<std::string> system_names() { return {"colocated", "wlb", "cad-distca", "cad", "cad-minmax"}; }

Result<std::vector<SystemResult>> simulate(const Profile& profile, const SimOptions& o, const std::vector<std::string>& systems,
                                           Progress* progress) {
  DISTCA_RETURN_IF_ERROR(o.validate());
  DISTCA_RETURN_IF_ERROR(profile.validate());
  const std::vector<std::string> known = system_names();
  for (const std::string& s : systems) {
    if (std::find(known.begin(), known.end(), s) == known.end()) {
      return invalid_argument(fmt::format("no system '{}' (known: colocated, wlb, cad-distca, cad, cad-minmax, all)", s));
    }
  }
  // runs[k]: system k's iterations, each sampled with its own seed.
  std::vector<std::vector<SystemResult>> runs(systems.size());
  for (int it = 0; it < o.iterations; ++it) {
    SimOptions oi = o;
    oi.seed = o.seed + static_cast<uint64_t>(it);
    Ctx c(profile, oi);
    c.model.tp = o.cluster.tp;
    c.U = o.cluster.units();
    c.S = o.cluster.pp;
    c.D = o.cluster.dp();
    c.L = o.model.num_layers;
    c.cp = o.cluster.cp;
    c.T = o.context / c.cp;
    c.hq = c.model.q_heads_per_rank();
    c.head_dim = c.model.head_dim;
    const double h = c.model.hidden, tp = c.model.tp;
    const double per_token_flops = 2.0 * (h * (c.model.num_q_heads + 2.0 * c.model.num_kv_heads) * c.model.head_dim +
                                          c.model.num_q_heads * c.model.head_dim * h + 3.0 * h * c.model.ffn_hidden) / tp;
    c.lin_f = per_token_flops / profile.linear_flops_per_second;
    c.lin_b = 2 * c.lin_f;
    c.tb = plan::token_bytes(c.model);
    c.link = o.cluster.gpus > o.cluster.gpus_per_node ? profile.inter_node : profile.intra_node;
    c.act_bytes_per_token_layer = 34.0 * h / tp;  // Korthikanti et al. 2022, with flash attention (no scores)
    const double params = c.L * (h * (c.model.num_q_heads + 2.0 * c.model.num_kv_heads) * c.model.head_dim +
                                 c.model.num_q_heads * c.model.head_dim * h + 3.0 * h * c.model.ffn_hidden) +
                          2.0 * kVocab * h;
    // Megatron-LM's distributed optimizer, bf16 parameters and gradients: 4 bytes per parameter
    // on every GPU holding it, 16 (fp32 main parameter and gradient, Adam's two moments) sharded
    // over the stage's DP x CP group.
    c.state_bytes = params / (tp * c.S) * (4.0 + 16.0 / (c.U / c.S));
    c.allreduce = collective_seconds(Collective::kAllReduce, 2.0 * params / (tp * c.S), c.D, profile.inter_node);
    DISTCA_ASSIGN_OR_RETURN(c.dist, plan::builtin_distribution(o.workload));
    c.progress = progress;
    for (size_t k = 0; k < systems.size(); ++k) {
      c.stage = o.iterations > 1 ? fmt::format("iteration {} of {}, {}", it + 1, o.iterations, systems[k]) : systems[k];
      c.say("");
      DISTCA_ASSIGN_OR_RETURN(SystemResult r, run_system(c, systems[k]));
      runs[k].push_back(std::move(r));
    }
  }
  std::vector<SystemResult> out;
  for (const auto& system_runs : runs) out.push_back(mean_of(system_runs));
  return out;
}

}  // namespace distca::sim
