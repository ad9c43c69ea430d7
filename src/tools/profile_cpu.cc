#include "profile_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

#include "distca/core/stopwatch.h"
#include "distca/kernels/cpu.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/model/model.h"
#include "distca/model/optimizer.h"
#include "distca/kernels/blas_setup.h"

namespace distca::tools {

namespace {

using Clock = SteadyClock;

template <typename Fn>
Result<double> best_of(int repeats, Fn&& fn) {
  double best = 1e300;
  for (int i = 0; i < repeats; ++i) {
    const auto t = Clock::now();
    DISTCA_RETURN_IF_ERROR(fn());
    best = std::min(best, seconds_since(t));
  }
  return best;
}

// Attention that costs nothing: what is left of a step is the linear work.
class NoAttention final : public model::AttentionBackend<float> {
 public:
  explicit NoAttention(const model::ModelConfig& c) : c_(c) {}
  std::string name() const override { return "none"; }
  Status begin_step(const plan::Batch&) override { return Status::ok(); }
  Status forward(int, const float*, const float*, const float*, float* o, float* lse) override {
    n_ = rows_;
    std::fill(o, o + n_ * c_.q_width(), 0.0f);
    std::fill(lse, lse + n_ * c_.num_q_heads, 0.0f);
    return Status::ok();
  }
  Status backward(int, const float*, const float*, const float*, const float*, const float*, const float*, float* dq,
                  float* dk, float* dv) override {
    std::fill(dq, dq + n_ * c_.q_width(), 0.0f);
    std::fill(dk, dk + n_ * c_.kv_width(), 0.0f);
    std::fill(dv, dv + n_ * c_.kv_width(), 0.0f);
    return Status::ok();
  }
  int64_t n_ = 0;
  int64_t rows_ = 0;  // the rows of the step (set before forward)

 private:
  model::ModelConfig c_;
};

}  // namespace

std::string linear_model_key(const model::ModelConfig& m) {
  return fmt::format("d{}-l{}-h{}x{}-kv{}-f{}-v{}", m.d_model, m.num_layers, m.num_q_heads, m.head_dim, m.num_kv_heads,
                     m.ffn_dim, m.vocab_size);
}

Result<sim::Profile> measure_cpu_profile(comm::Communicator& c, const CpuProfileOptions& o,
                                         const std::function<void(const std::string&)>& progress) {
  const model::ModelConfig& m = o.model;
  DISTCA_RETURN_IF_ERROR(m.validate());
  if (o.max_tokens < 256 || o.repeats < 1 || o.threads < 1) return invalid_argument("profile: max tokens >= 256, repeats and threads >= 1");
  auto say = [&](const std::string& line) {
    if (c.rank() == 0) progress(line);
  };
  kernels::blas_set_num_threads(o.threads);
  sim::Profile p;
  p.name = fmt::format("cpu-measured ({} rank(s), {} thread(s) each)", c.size(), o.threads);
  // The linear work runs on OpenBLAS: on the wrong kernel family it is not this machine's.
  const kernels::BlasCheck blas = kernels::blas_check();
  if (!blas.is_trusted) say(blas.warning);
  p.source = fmt::format("measured by distca profile on this machine: CpuAttention ({}), OpenBLAS {}{}, {} communicator",
                         kernels::CpuAttention(kernels::CpuAttentionOptions{.num_threads = o.threads}).isa(), blas.core,
                         blas.is_trusted ? "" : fmt::format(" (narrower than this {} CPU: linear work too slow)", blas.cpu_isa),
                         c.name());
  // Attention: whole causal documents of 128 .. max_tokens rows.
  sim::AttentionProfile a;
  a.num_q_heads = m.num_q_heads;
  a.num_kv_heads = m.num_kv_heads;
  a.head_dim = m.head_dim;
  a.tile_rows = 16;
  kernels::CpuAttention kernel(kernels::CpuAttentionOptions{.num_threads = o.threads});
  for (int64_t n = 128; n <= o.max_tokens; n *= 2) {
    std::vector<float> q(static_cast<size_t>(n * m.q_width()), 0.01f), kv(static_cast<size_t>(n * m.kv_width()), 0.02f);
    std::vector<float> out(q.size()), lse(static_cast<size_t>(n * m.num_q_heads)), dq(q.size()), dk(kv.size()), dv(kv.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 17);
    const kernels::AttnTask task{0, n, 0, n, true};
    kernels::AttnFwdParams<float> f;
    f.dims = {n, n, m.num_q_heads, m.num_kv_heads, m.head_dim};
    f.q = q.data(), f.k = kv.data(), f.v = kv.data(), f.o = out.data(), f.lse = lse.data(), f.tasks = {&task, 1};
    kernels::AttnBwdParams<float> b;
    b.dims = f.dims;
    b.q = q.data(), b.k = kv.data(), b.v = kv.data(), b.o = out.data(), b.lse = lse.data(), b.d_o = q.data();
    b.dq = dq.data(), b.dk = dk.data(), b.dv = dv.data(), b.tasks = {&task, 1};
    DISTCA_ASSIGN_OR_RETURN(double fs, best_of(o.repeats, [&] { return kernel.forward(f); }));
    DISTCA_ASSIGN_OR_RETURN(double bs, best_of(o.repeats, [&] { return kernel.backward(b); }));
    a.points.push_back({n, n, fs, bs});
    say(fmt::format("attention {:>6} tokens: forward {:.4f} s, backward {:.4f} s", n, fs, bs));
  }
  a.task_overhead_seconds = std::max(0.0, a.points.front().fwd_seconds * 0.05);
  p.attention.push_back(a);
  // Linear: the model's forward and backward with attention replaced by nothing.
  {
    const int64_t n = o.max_tokens;
    model::Model<float> net(m, n);
    auto state = model::ModelState<float>::create(m);
    NoAttention none(m);
    none.rows_ = n;
    std::vector<int32_t> tokens(static_cast<size_t>(n)), targets(static_cast<size_t>(n)), positions(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      tokens[i] = static_cast<int32_t>((i * 7) % m.vocab_size);
      targets[i] = i + 1 < n ? static_cast<int32_t>(((i + 1) * 7) % m.vocab_size) : -1;
      positions[i] = static_cast<int32_t>(i);
    }
    const model::StepTokens in{tokens, targets, positions};
    DISTCA_ASSIGN_OR_RETURN(double pass, best_of(o.repeats, [&]() -> Status {
      DISTCA_RETURN_IF_ERROR(net.forward(state, in, none, 1.0 / static_cast<double>(n)).status());
      return net.backward(state, none);
    }));
    DISTCA_ASSIGN_OR_RETURN(double opt, best_of(o.repeats, [&]() -> Status {
      model::adamw_step(state, model::OptimConfig{});
      return Status::ok();
    }));
    const double per = pass / static_cast<double>(n * m.num_layers);
    const double flops = 3.0 * 2.0 * (m.d_model * (m.q_width() + 2 * m.kv_width()) + m.q_width() * m.d_model + 3.0 * m.d_model * m.ffn_dim);
    p.linear_flops_per_second = flops / per;
    p.linear_models.push_back({linear_model_key(m), per, opt});
    say(fmt::format("linear: {:.3e} s per token per layer ({:.1f} GFLOP/s in GEMMs), optimizer {:.4f} s", per,
                    p.linear_flops_per_second / 1e9, opt));
  }
  // Links: an all-to-all of 8 bytes (latency) and of 4 MB per peer (bandwidth).
  if (c.size() > 1) {
    auto exchange = [&](int64_t bytes) -> Result<double> {
      const int R = c.size();
      std::vector<std::byte> send(static_cast<size_t>(bytes * R)), recv(send.size());
      std::vector<int64_t> counts(R, bytes), offsets(R);
      for (int r = 0; r < R; ++r) offsets[r] = r * bytes;
      counts[c.rank()] = 0;
      comm::AllToAllV x{send.data(), counts, offsets, recv.data(), counts, offsets};
      DISTCA_RETURN_IF_ERROR(c.barrier());
      return best_of(o.repeats + 2, [&] { return c.all_to_all_v(x); });
    };
    DISTCA_ASSIGN_OR_RETURN(double small, exchange(8));
    DISTCA_ASSIGN_OR_RETURN(double large, exchange(4 << 20));
    const double bw = (4 << 20) / std::max(large - small, 1e-9);
    p.intra_node = p.inter_node = {small, bw};
    p.links_source = fmt::format("measured: {}-rank all-to-all over {}, 8 B and 4 MiB per peer", c.size(), c.name());
    say(fmt::format("link: latency {:.1f} us, {:.2f} GB/s", small * 1e6, bw / 1e9));
  } else {
    p.intra_node = p.inter_node = {1e-6, 10e9};
    p.links_source = "one rank: no link measured (a placeholder of 1 us, 10 GB/s; run under mpirun to measure)";
  }
  // Rank 0's numbers for everyone.
  std::vector<float> values;
  for (const auto& pt : p.attention[0].points) values.push_back(static_cast<float>(pt.fwd_seconds)), values.push_back(static_cast<float>(pt.bwd_seconds));
  values.push_back(static_cast<float>(p.linear_models[0].seconds_per_token_layer));
  values.push_back(static_cast<float>(p.linear_models[0].step_fixed_seconds));
  DISTCA_RETURN_IF_ERROR(c.broadcast(values.data(), static_cast<int64_t>(values.size() * sizeof(float)), 0));
  for (size_t i = 0; i < p.attention[0].points.size(); ++i) {
    p.attention[0].points[i].fwd_seconds = values[2 * i], p.attention[0].points[i].bwd_seconds = values[2 * i + 1];
  }
  p.linear_models[0].seconds_per_token_layer = values[values.size() - 2];
  p.linear_models[0].step_fixed_seconds = values.back();
  DISTCA_RETURN_IF_ERROR(p.validate());
  return p;
}

}  // namespace distca::tools
