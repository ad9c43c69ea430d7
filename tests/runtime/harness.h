// Checks of the CAD runtime that every rank runs with its own communicator, so the same code
// tests LocalComm (ranks as threads) and MpiComm (under mpirun). Each returns a Status naming
// the first mismatch.
//
// check_against_colocated: random Q/K/V/dO of a batch, the same on every rank (one seed);
// forward O/LSE and backward dQ/dK/dV through the Dispatcher must equal one CpuAttention call
// over the whole batch (each document one causal task, as colocated attention computes it),
// and the bytes sent per phase and per peer must be exactly plan::count_traffic's.
//
// check_routing: self-describing rows (each element encodes document, position, owner and
// tensor) through a server kernel that copies instead of attending: every row must reach the
// server slot the plan gives it and come back to exactly where it started (a row in several
// tasks of a key-range split: its dQ once per task).
//
// split_key_ranges: a plan whose tasks split the key range, made from a causal one.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "distca/comm/emulated_link.h"
#include "distca/kernels/cpu.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/runtime/dispatcher.h"
#include "layout/plans.h"

namespace distca::runtime::testing {

// Rows of the whole batch, document after document, and where each rank's linear rows sit in it.
struct GlobalLayout {
  std::vector<int64_t> doc_start;                // (docs) first global row of each document
  std::vector<std::vector<int64_t>> local_rows;  // [rank][local row] -> global row
  int64_t num_rows = 0;
};

inline GlobalLayout global_layout(const plan::Batch& batch) {
  GlobalLayout g;
  for (int64_t len : batch.doc_lengths) {
    g.doc_start.push_back(g.num_rows);
    g.num_rows += len;
  }
  g.local_rows.resize(batch.num_ranks);
  for (const plan::Piece& p : batch.pieces) {
    for (int64_t pos = p.begin; pos < p.end; ++pos) g.local_rows[p.rank].push_back(g.doc_start[p.doc] + pos);
  }
  return g;
}

using layout::testing::make_plan;

// Splits the key range of about half of the plan's tasks: a task over queries [q0, q1) and keys
// [k0, q1) becomes a causal task over keys [c, q1) (k0 < c <= q0) and non-causal tasks tiling
// keys [k0, c), each key range over one or two query sub-ranges of [q0, q1); every new task on
// a random server. The result passes plan::verify_tasks (checked).
inline Result<plan::Plan> split_key_ranges(const plan::Batch& batch, const plan::Plan& causal, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto server = [&] { return static_cast<int32_t>(uniform(0, batch.num_ranks - 1)); };
  std::vector<plan::Task> tasks;
  for (const plan::Task& t : causal.tasks) {
    if (!t.is_causal() || t.q0 <= t.k0 || uniform(0, 1) == 0) {
      tasks.push_back(t);
      continue;
    }
    const int64_t c = uniform(t.k0 + 1, t.q0);
    tasks.push_back({t.doc, t.q0, t.q1, c, t.q1, server()});
    for (int64_t a = t.k0; a < c;) {
      const int64_t b = uniform(0, 2) == 0 ? c : uniform(a + 1, c);
      const int64_t m = t.q_len() > 1 && uniform(0, 1) == 0 ? uniform(t.q0 + 1, t.q1 - 1) : t.q1;
      tasks.push_back({t.doc, t.q0, m, a, b, server()});
      if (m < t.q1) tasks.push_back({t.doc, m, t.q1, a, b, server()});
      a = b;
    }
  }
  DISTCA_ASSIGN_OR_RETURN(plan::ModelShape model, plan::model_preset("llama-8b"));
  const plan::CostModel cost(model, plan::ThroughputProfile{});
  plan::Plan split = plan::finalize_plan(causal.policy + "+split", causal.tolerance, batch, cost, std::move(tasks));
  DISTCA_RETURN_IF_ERROR(plan::verify_tasks(batch, split.tasks));
  return split;
}

// Gathers rows `rows` of a [N, width] array.
inline std::vector<float> gather(const std::vector<float>& global, const std::vector<int64_t>& rows, int64_t width) {
  std::vector<float> out(rows.size() * width);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.data() + i * width, global.data() + rows[i] * width, width * sizeof(float));
  }
  return out;
}

// |got - want| <= tol * (1 + |want|) everywhere, or the worst element.
inline Status compare(const char* what, int rank, const std::vector<float>& got, const std::vector<float>& want,
                      const std::vector<int64_t>& rows, int64_t width, double tol) {
  if (got.size() != want.size()) return internal_error(fmt::format("{}: {} values, want {}", what, got.size(), want.size()));
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double excess = std::abs(double{got[i]} - double{want[i]}) / (1.0 + std::abs(double{want[i]}));
    if (!(excess <= worst) || std::isnan(excess)) worst = std::isnan(excess) ? INFINITY : excess, at = i;
  }
  if (worst > tol) {
    return internal_error(fmt::format("rank {}: {} differs from colocated at local row {} (global {}), element {}: "
                                      "{} vs {} (relative {:.3g} > {:.3g})",
                                      rank, what, at / width, rows[at / width], at % width, got[at], want[at],
                                      worst, tol));
  }
  return Status::ok();
}

struct DispatchCase {
  uint64_t seed = 1;
  layout::HeadShape heads{4, 2, 32};
  plan::BackwardMode mode = plan::BackwardMode::kStateless;
  int num_threads = 1;
};

// Random Q/K/V/dO of the whole batch, [N, Hq, D] and [N, Hkv, D]: the same on every rank (one seed).
struct GlobalInputs {
  std::vector<float> q, k, v, d_o;
};

inline GlobalInputs random_inputs(const GlobalLayout& g, const DispatchCase& c) {
  const int64_t qw = c.heads.num_q_heads * c.heads.head_dim, kw = c.heads.num_kv_heads * c.heads.head_dim;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](int64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  GlobalInputs in;
  in.q = random(g.num_rows * qw), in.k = random(g.num_rows * kw), in.v = random(g.num_rows * kw);
  in.d_o = random(g.num_rows * qw);
  return in;
}

// This rank's outputs of one forward and one backward through the dispatcher.
struct LocalOutputs {
  std::vector<float> o, lse, dq, dk, dv;
};

// Runs this rank's linear rows `rows` (global row of each) of `in` forward and backward.
inline Result<LocalOutputs> run_local(Dispatcher& dispatcher, const std::vector<int64_t>& rows, const GlobalInputs& in) {
  const layout::HeadShape& h = dispatcher.heads();
  const int64_t qw = h.num_q_heads * h.head_dim, kw = h.num_kv_heads * h.head_dim;
  if (dispatcher.num_local_rows() != static_cast<int64_t>(rows.size())) {
    return internal_error(fmt::format("{} local rows, want {}", dispatcher.num_local_rows(), rows.size()));
  }
  const auto lq = gather(in.q, rows, qw), lk = gather(in.k, rows, kw), lv = gather(in.v, rows, kw),
             ld_o = gather(in.d_o, rows, qw);
  const auto n = static_cast<int64_t>(rows.size());
  LocalOutputs out;
  out.o.assign(n * qw, NAN), out.lse.assign(n * h.num_q_heads, NAN), out.dq.assign(n * qw, NAN);
  out.dk.assign(n * kw, NAN), out.dv.assign(n * kw, NAN);
  ServerBuffers server;
  DISTCA_RETURN_IF_ERROR(dispatcher.forward({lq.data(), lk.data(), lv.data(), out.o.data(), out.lse.data()}, server));
  DISTCA_RETURN_IF_ERROR(dispatcher.backward({lq.data(), lk.data(), lv.data(), out.o.data(), out.lse.data(), ld_o.data(),
                                              out.dq.data(), out.dk.data(), out.dv.data()},
                                             server));
  return out;
}

inline Status check_against_colocated(comm::Communicator& base, const plan::Batch& batch, const plan::Plan& plan,
                                      const DispatchCase& c) {
  const int rank = base.rank();
  const GlobalLayout g = global_layout(batch);
  const int64_t hq = c.heads.num_q_heads, hkv = c.heads.num_kv_heads, d = c.heads.head_dim;
  const int64_t qw = hq * d, kw = hkv * d;
  const GlobalInputs in = random_inputs(g, c);

  // Colocated: one call over the whole batch, a causal task per document.
  std::vector<kernels::AttnTask> tasks;
  for (int32_t doc = 0; doc < batch.num_docs(); ++doc) {
    const int64_t len = batch.doc_lengths[doc];
    if (len > 0) tasks.push_back({g.doc_start[doc], len, g.doc_start[doc], len, true});
  }
  const kernels::AttnDims dims{g.num_rows, g.num_rows, hq, hkv, d};
  std::vector<float> o(g.num_rows * qw), lse(g.num_rows * hq), dq(g.num_rows * qw), dk(g.num_rows * kw),
      dv(g.num_rows * kw);
  kernels::CpuAttention attention({.num_threads = c.num_threads});
  DISTCA_RETURN_IF_ERROR(attention.forward(kernels::AttnFwdParams<float>{dims, in.q.data(), in.k.data(), in.v.data(),
                                                                         tasks, {}, o.data(), lse.data()}));
  DISTCA_RETURN_IF_ERROR(attention.backward(kernels::AttnBwdParams<float>{dims, in.q.data(), in.k.data(), in.v.data(),
                                                                          o.data(), lse.data(), in.d_o.data(), tasks,
                                                                          {}, dq.data(), dk.data(), dv.data()}));

  // CAD: this rank's linear rows through the dispatcher, counted by a link with no delay.
  comm::EmulatedLink link(base, {});
  DispatchOptions options;
  options.backward_mode = c.mode;
  options.num_threads = c.num_threads;
  DISTCA_ASSIGN_OR_RETURN(auto dispatcher, Dispatcher::create(link, batch, plan, c.heads, options));
  link.reset_counters();
  const std::vector<int64_t>& rows = g.local_rows[rank];
  auto local = run_local(*dispatcher, rows, in);
  if (!local.is_ok()) return internal_error(fmt::format("rank {}: {}", rank, local.status().to_string()));
  const LocalOutputs& out = local.value();

  const double tol = 2e-5;
  DISTCA_RETURN_IF_ERROR(compare("O", rank, out.o, gather(o, rows, qw), rows, qw, tol));
  DISTCA_RETURN_IF_ERROR(compare("LSE", rank, out.lse, gather(lse, rows, hq), rows, hq, tol));
  DISTCA_RETURN_IF_ERROR(compare("dQ", rank, out.dq, gather(dq, rows, qw), rows, qw, tol));
  DISTCA_RETURN_IF_ERROR(compare("dK", rank, out.dk, gather(dk, rows, kw), rows, kw, tol));
  DISTCA_RETURN_IF_ERROR(compare("dV", rank, out.dv, gather(dv, rows, kw), rows, kw, tol));

  // Bytes: the dispatcher's own count, and what crossed the link per peer, against the plan's.
  const plan::Traffic want = plan::count_traffic(batch, plan::token_bytes(hq, hkv, d, 4, plan::GradReturn::kFp32), plan.tasks, c.mode);
  std::vector<int64_t> want_to(batch.num_ranks, 0);
  for (int p = 0; p < plan::kNumPhases; ++p) {
    const auto phase = static_cast<plan::Phase>(p);
    const PhaseStats& st = dispatcher->stats(phase);
    const plan::PhaseTraffic& t = want.phases[p];
    if (st.bytes_sent != t.send_bytes[rank] || st.bytes_received != t.recv_bytes[rank]) {
      return internal_error(fmt::format("rank {}: {} sent {} and received {} bytes; the plan counts {} and {}", rank,
                                        plan::phase_name(phase), st.bytes_sent, st.bytes_received, t.send_bytes[rank],
                                        t.recv_bytes[rank]));
    }
    for (const plan::Flow& f : plan::count_flows(batch, plan::token_bytes(hq, hkv, d, 4, plan::GradReturn::kFp32), plan.tasks,
                                                 phase, c.mode)) {
      if (f.src == rank) want_to[f.dst] += f.bytes;
    }
  }
  if (link.counters().bytes_sent_to != want_to) {
    return internal_error(fmt::format("rank {}: bytes per peer on the link [{}] differ from the plan's [{}]", rank,
                                      fmt::join(link.counters().bytes_sent_to, ", "), fmt::join(want_to, ", ")));
  }
  return Status::ok();
}

// ---- Routing with self-describing rows ----

// Element e of row (doc, pos) of tensor `tag` held by `owner`, head h: small integers, exact
// in fp32 even when summed over a few hundred tasks.
inline float code(int64_t doc, int64_t pos, int owner, int tag, int64_t h, int64_t e) {
  switch (e) {
    case 0: return static_cast<float>(doc);
    case 1: return static_cast<float>(pos);
    case 2: return static_cast<float>(owner);
    case 3: return static_cast<float>(tag);
    case 4: return static_cast<float>(h);
    default: return static_cast<float>((doc * 31 + pos * 7 + e + tag) % 1000);
  }
}

// A server "kernel" that copies: O = Q, LSE = Q's doc code, dQ = dO, dK/dV = the sum of K/V over
// the tasks that read the row. It checks that each task's rows are the document rows the task
// names: K/V rows consecutive positions k0.. of one document, Q rows consecutive positions of
// the same document ending at the last key (causal) or starting after it (non-causal); in the
// backward also that O and LSE came back as the forward made them (after the owner's merge).
//
// Key-range splits: a non-causal task's LSE is its doc code - 200, so that in fp32 the merge of
// a row's partials is exactly the causal task's (O = Q, LSE = doc code): exp(-200) is 0.
class CopyKernel final : public ServerKernel {
 public:
  static constexpr float kNonCausalLseOffset = -200.0f;

  Status forward(const kernels::AttnFwdParams<float>& p) override {
    const int64_t hq = p.dims.num_q_heads, d = p.dims.head_dim;
    for (const kernels::AttnTask& t : p.tasks) {
      DISTCA_RETURN_IF_ERROR(check_task(t, p.q, p.k, p.v, p.dims));
      const float offset = t.is_causal ? 0.0f : kNonCausalLseOffset;
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t row = t.q_offset + i;
        std::memcpy(p.o + row * hq * d, p.q + row * hq * d, hq * d * sizeof(float));
        for (int64_t h = 0; h < hq; ++h) p.lse[row * hq + h] = p.q[(row * hq + h) * d] + offset;
      }
    }
    return Status::ok();
  }
  Status backward(const kernels::AttnBwdParams<float>& p) override {
    const int64_t hq = p.dims.num_q_heads, hkv = p.dims.num_kv_heads, d = p.dims.head_dim;
    std::fill(p.dk, p.dk + p.dims.num_kv_rows * hkv * d, 0.0f);
    std::fill(p.dv, p.dv + p.dims.num_kv_rows * hkv * d, 0.0f);
    for (const kernels::AttnTask& t : p.tasks) {
      DISTCA_RETURN_IF_ERROR(check_task(t, p.q, p.k, p.v, p.dims));
      for (int64_t i = 0; i < t.q_len * hq * d; ++i) {
        const int64_t at = t.q_offset * hq * d + i;
        if (p.o[at] != p.q[at]) return internal_error(fmt::format("server Q row {}: O did not come back as sent", t.q_offset + i / (hq * d)));
      }
      for (int64_t i = 0; i < t.q_len * hq; ++i) {
        const int64_t at = t.q_offset * hq + i;
        if (p.lse[at] != p.q[at * d]) {
          return internal_error(fmt::format("server Q row {}: LSE {} is not the merged one ({})", t.q_offset + i / hq,
                                            p.lse[at], p.q[at * d]));
        }
      }
      std::memcpy(p.dq + t.q_offset * hq * d, p.d_o + t.q_offset * hq * d, t.q_len * hq * d * sizeof(float));
      for (int64_t i = 0; i < t.kv_len * hkv * d; ++i) {
        p.dk[t.kv_offset * hkv * d + i] += p.k[t.kv_offset * hkv * d + i];
        p.dv[t.kv_offset * hkv * d + i] += p.v[t.kv_offset * hkv * d + i];
      }
    }
    return Status::ok();
  }

 private:
  static Status check_task(const kernels::AttnTask& t, const float* q, const float* k, const float* v,
                           const kernels::AttnDims& dims) {
    const int64_t hq = dims.num_q_heads, hkv = dims.num_kv_heads, d = dims.head_dim;
    const float doc = q[t.q_offset * hq * d];
    const float k0 = k[t.kv_offset * hkv * d + 1];
    const float last_key = k0 + static_cast<float>(t.kv_len - 1);
    // Causal: the last query sits at the last key; non-causal: the first query after it.
    const float q0 = t.is_causal ? last_key - static_cast<float>(t.q_len - 1) : q[t.q_offset * hq * d + 1];
    if (!t.is_causal && q0 < last_key) {
      return internal_error(fmt::format("non-causal task: first query at {} before its last key {}", q0, last_key));
    }
    for (int64_t i = 0; i < t.q_len; ++i) {
      const float* row = q + (t.q_offset + i) * hq * d;
      if (row[0] != doc || row[1] != q0 + static_cast<float>(i) || row[3] != 1) {
        return internal_error(fmt::format("server Q row {} holds (doc {}, pos {}, tensor {}), want (doc {}, pos {}, Q)",
                                          t.q_offset + i, row[0], row[1], row[3], doc, q0 + static_cast<float>(i)));
      }
    }
    for (int64_t j = 0; j < t.kv_len; ++j) {
      const float* kr = k + (t.kv_offset + j) * hkv * d;
      const float* vr = v + (t.kv_offset + j) * hkv * d;
      const float pos = k0 + static_cast<float>(j);
      if (kr[0] != doc || kr[1] != pos || kr[3] != 2 || vr[0] != doc || vr[1] != kr[1] || vr[3] != 3) {
        return internal_error(fmt::format("server K/V row {} holds (doc {}, pos {}), want (doc {}, pos {})",
                                          t.kv_offset + j, kr[0], kr[1], doc, pos));
      }
    }
    return Status::ok();
  }
};

inline Status check_routing(comm::Communicator& comm, const plan::Batch& batch, const plan::Plan& plan,
                            plan::BackwardMode mode) {
  const int rank = comm.rank();
  const layout::HeadShape heads{2, 1, 8};
  const int64_t hq = heads.num_q_heads, hkv = heads.num_kv_heads, d = heads.head_dim;
  CopyKernel kernel;
  DispatchOptions options;
  options.backward_mode = mode;
  options.kernel = &kernel;
  DISTCA_ASSIGN_OR_RETURN(auto dispatcher, Dispatcher::create(comm, batch, plan, heads, options));
  // This rank's rows in order, as (doc, pos).
  std::vector<std::pair<int32_t, int64_t>> mine;
  for (const plan::Piece& p : batch.pieces) {
    if (p.rank != rank) continue;
    for (int64_t pos = p.begin; pos < p.end; ++pos) mine.emplace_back(p.doc, pos);
  }
  const auto n = static_cast<int64_t>(mine.size());
  auto fill = [&](int tag, int64_t heads_n) {
    std::vector<float> t(n * heads_n * d);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < heads_n; ++h) {
        for (int64_t e = 0; e < d; ++e) t[(r * heads_n + h) * d + e] = code(mine[r].first, mine[r].second, rank, tag, h, e);
      }
    }
    return t;
  };
  const auto q = fill(1, hq), k = fill(2, hkv), v = fill(3, hkv), d_o = fill(4, hq);
  std::vector<float> o(n * hq * d, NAN), lse(n * hq, NAN), dq(n * hq * d, NAN), dk(n * hkv * d, NAN),
      dv(n * hkv * d, NAN);
  ServerBuffers server;
  DISTCA_RETURN_IF_ERROR(dispatcher->forward({q.data(), k.data(), v.data(), o.data(), lse.data()}, server));
  DISTCA_RETURN_IF_ERROR(dispatcher->backward(
      {q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(), dq.data(), dk.data(), dv.data()}, server));

  // How many tasks read each key row, and how many have each query row (dQ comes from each).
  auto readers = [&](int32_t doc, int64_t pos) {
    int64_t count = 0;
    for (const plan::Task& t : plan.tasks) count += t.doc == doc && t.k0 <= pos && pos < t.k1;
    return static_cast<float>(count);
  };
  auto queriers = [&](int32_t doc, int64_t pos) {
    int64_t count = 0;
    for (const plan::Task& t : plan.tasks) count += t.doc == doc && t.q0 <= pos && pos < t.q1;
    return static_cast<float>(count);
  };
  for (int64_t r = 0; r < n; ++r) {
    const auto [doc, pos] = mine[r];
    const float tasks_of_row = queriers(doc, pos);
    for (int64_t i = 0; i < hq * d; ++i) {
      const int64_t at = r * hq * d + i;
      if (o[at] != q[at] || dq[at] != tasks_of_row * d_o[at]) {
        return internal_error(fmt::format("rank {}: row {} (doc {}, pos {}) came back as O (doc {}, pos {}, owner {}), "
                                          "dQ (doc {}, pos {}) over its {} task(s)",
                                          rank, r, doc, pos, o[r * hq * d], o[r * hq * d + 1], o[r * hq * d + 2],
                                          dq[r * hq * d] / tasks_of_row, dq[r * hq * d + 1] / tasks_of_row,
                                          tasks_of_row));
      }
    }
    for (int64_t h = 0; h < hq; ++h) {
      if (lse[r * hq + h] != static_cast<float>(doc)) return internal_error(fmt::format("rank {}: LSE of row {} misplaced", rank, r));
    }
    const float times = readers(doc, pos);
    for (int64_t i = 0; i < hkv * d; ++i) {
      const int64_t at = r * hkv * d + i;
      if (dk[at] != times * k[at] || dv[at] != times * v[at]) {
        return internal_error(fmt::format("rank {}: dK/dV of row {} (doc {}, pos {}) is {} x K, want {} x K", rank, r,
                                          doc, pos, dk[at] / k[at], times));
      }
    }
  }
  return Status::ok();
}

}  // namespace distca::runtime::testing
