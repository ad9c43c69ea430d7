#include "distca/model/model.h"

#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "distca/core/stopwatch.h"
#include "distca/core/trace.h"

namespace distca::model {

namespace {

using Clock = SteadyClock;

// Row-major C[M, N] = op(A) op(B) + beta C, op(A) [M, K], op(B) [K, N].
// k == 0 (no rows to sum over): C = beta C.
template <typename T>
bool gemm_is_empty(int64_t m, int64_t n, int64_t k, T beta, T* c) {
  if (m == 0 || n == 0) return true;
  if (k > 0) return false;
  if (beta == T(0)) std::fill(c, c + m * n, T(0));
  return true;
}
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, const float* b, float beta, float* c) {
  if (gemm_is_empty(m, n, k, beta, c)) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), 1.0f, a, static_cast<int>(ta ? m : k), b,
              static_cast<int>(tb ? k : n), beta, c, static_cast<int>(n));
}
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const double* a, const double* b, double beta, double* c) {
  if (gemm_is_empty(m, n, k, beta, c)) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), 1.0, a, static_cast<int>(ta ? m : k), b,
              static_cast<int>(tb ? k : n), beta, c, static_cast<int>(n));
}

// y = x * rstd * g, rstd = 1 / sqrt(mean(x^2) + eps), per row of d.
template <typename T>
void rmsnorm_forward(const T* x, const T* g, int64_t n, int64_t d, double eps, T* y, T* rstd) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(xi[j]) * xi[j];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    rstd[i] = r;
    T* yi = y + i * d;
    for (int64_t j = 0; j < d; ++j) yi[j] = xi[j] * r * g[j];
  }
}

// dx += rstd (g dy) - x rstd^3 mean(g dy x); dg += dy x rstd.
template <typename T>
void rmsnorm_backward(const T* x, const T* g, const T* rstd, const T* dy, int64_t n, int64_t d, T* dx, T* dg) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    const T* dyi = dy + i * d;
    const T r = rstd[i];
    double dot = 0;
    for (int64_t j = 0; j < d; ++j) {
      dot += static_cast<double>(g[j]) * dyi[j] * xi[j];
      dg[j] += dyi[j] * xi[j] * r;
    }
    const T c = static_cast<T>(dot / static_cast<double>(d)) * r * r * r;
    T* dxi = dx + i * d;
    for (int64_t j = 0; j < d; ++j) dxi[j] += r * g[j] * dyi[j] - c * xi[j];
  }
}

// Rotates each head's halves (x1, x2) by the angle of its row: (x1 c - x2 s, x2 c + x1 s);
// sign -1 rotates back (the backward).
template <typename T>
void rope(T* x, int64_t n, int64_t heads, int64_t dim, const T* cos, const T* sin, T sign) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < n; ++i) {
    const T* c = cos + i * half;
    const T* s = sin + i * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = x + (i * heads + h) * dim;
      T* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        const T a = x1[j], b = x2[j], sj = sign * s[j];
        x1[j] = a * c[j] - b * sj;
        x2[j] = b * c[j] + a * sj;
      }
    }
  }
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Box-Muller over splitmix64: the same numbers on every platform and rank.
class Normal {
 public:
  explicit Normal(uint64_t seed) : state_(seed) {}
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(bits() >> 11) + 0.5) / 9007199254740992.0;
    const double u2 = static_cast<double>(bits() >> 11) / 9007199254740992.0;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2 * M_PI * u2);
  }

 private:
  uint64_t bits() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0;
};

const char* const kLayerBlocks[] = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"};

}  // namespace

template <typename T>
ModelState<T> ModelState<T>::create(const ModelConfig& c, int tp_size, int tp_index) {
  if (tp_size > 1) {
    auto shard = tensor_parallel_shard(c, tp_size);
    DISTCA_CHECK(shard.is_ok()) << shard.status().message();
    DISTCA_CHECK(tp_index >= 0 && tp_index < tp_size) << "tensor-parallel index " << tp_index << " of " << tp_size;
    // Draw the whole model, then keep this rank's slice: rank i holds the columns (of a
    // column-parallel [in, out] matrix) or rows (row-parallel) [i w, (i + 1) w) of the whole.
    const ModelState whole = create(c);
    ModelState s;
    s.config = shard.value();
    for (const auto& b : whole.params.blocks()) {
      const bool is_kv = b.name.ends_with(".wk") || b.name.ends_with(".wv");
      const int64_t count = !is_tp_sharded(b.name) ? b.count
                            : is_kv                ? c.d_model * s.config.kv_width()
                                                   : b.count / tp_size;
      s.params.add(b.name, count);
    }
    s.params.allocate();
    s.grads.copy_layout(s.params);
    s.m.copy_layout(s.params);
    s.v.copy_layout(s.params);
    for (size_t i = 0; i < whole.params.blocks().size(); ++i) {
      const auto& from = whole.params.blocks()[i];
      const auto& to = s.params.blocks()[i];
      const T* src = whole.params.at(from.offset);
      T* dst = s.params.at(to.offset);
      const bool is_row_parallel = from.name.ends_with(".wo") || from.name.ends_with(".w_down");
      if (!is_tp_sharded(from.name)) {
        std::copy(src, src + from.count, dst);
        continue;
      }
      if (is_row_parallel) {  // [in, d]: a contiguous run of rows
        std::copy(src + tp_index * to.count, src + (tp_index + 1) * to.count, dst);
        continue;
      }
      // Column-parallel [d, out]: columns [slice w, (slice + 1) w); the key/value heads of a
      // rank that shares them are its group's (rank i of tp / Hkv sharing ranks each).
      const int64_t rows = c.d_model, width = to.count / rows, whole_width = from.count / rows;
      const bool is_kv = from.name.ends_with(".wk") || from.name.ends_with(".wv");
      const int64_t slice = is_kv ? tp_index / kv_head_replicas(c, tp_size) : tp_index;
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(src + r * whole_width + slice * width, src + r * whole_width + (slice + 1) * width, dst + r * width);
      }
    }
    return s;
  }
  ModelState s;
  s.config = c;
  const int64_t d = c.d_model;
  s.params.add("embed", c.vocab_size * d);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const int64_t sizes[] = {d, d * c.q_width(), d * c.kv_width(), d * c.kv_width(), c.q_width() * d,
                             d, d * c.ffn_dim,   d * c.ffn_dim,    c.ffn_dim * d};
    for (int i = 0; i < 9; ++i) s.params.add(fmt::format("layers.{}.{}", l, kLayerBlocks[i]), sizes[i]);
  }
  s.params.add("final_norm", d);
  s.params.add("lm_head", d * c.vocab_size);
  s.params.allocate();
  s.grads.copy_layout(s.params);
  s.m.copy_layout(s.params);
  s.v.copy_layout(s.params);
  Normal normal(c.init_seed);
  const double out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.num_layers));
  for (const auto& b : s.params.blocks()) {
    T* p = s.params.at(b.offset);
    if (!is_decayed(b.name)) {
      std::fill(p, p + b.count, T(1));
      continue;
    }
    const bool is_output = b.name.ends_with(".wo") || b.name.ends_with(".w_down");
    const double std = c.init_std * (is_output ? out_scale : 1.0);
    for (int64_t i = 0; i < b.count; ++i) p[i] = static_cast<T>(std * normal.next());
  }
  return s;
}

template <typename T>
bool ModelState<T>::is_decayed(const std::string& name) {
  return !(name.ends_with("norm"));
}

template <typename T>
bool ModelState<T>::is_tp_sharded(const std::string& name) {
  for (const char* p : {".wq", ".wk", ".wv", ".wo", ".w_gate", ".w_up", ".w_down"}) {
    if (name.ends_with(p)) return true;
  }
  return false;
}

template <typename T>
Weights<T> ModelState<T>::views(Arena<T>& a) const {
  Weights<T> w;
  auto at = [&a](const std::string& name) {
    const auto* b = a.find(name);
    DISTCA_CHECK(b != nullptr) << "no block " << name;
    return a.at(b->offset);
  };
  w.embed = at("embed");
  for (int64_t l = 0; l < config.num_layers; ++l) {
    auto p = [&](const char* n) { return at(fmt::format("layers.{}.{}", l, n)); };
    w.layers.push_back({p("attn_norm"), p("wq"), p("wk"), p("wv"), p("wo"), p("mlp_norm"), p("w_gate"), p("w_up"),
                        p("w_down")});
  }
  w.final_norm = at("final_norm");
  w.lm_head = at("lm_head");
  return w;
}

template <typename T>
int64_t Model<T>::workspace_bytes(const ModelConfig& c, int64_t n, LayerRange range) {
  const int64_t layers = range.count < 0 ? c.num_layers - range.first : range.count;
  // Per token, as the constructor lays it out: per layer x, h1, x_mid, h2 (d each), rstd1/2, q and
  // o, k and v, gate, up and s; then x_final, hf, dx, dh, rstdf, logits and dlogits, RoPE cos and
  // sin, dq, do, dk, dv, dgate, dup, ds; LSE per layer and query head (fp32); the token ids and
  // targets.
  const int64_t d = c.d_model, f = c.ffn_dim, qw = c.q_width(), kw = c.kv_width();
  const int64_t per_layer = 4 * d + 2 + 2 * qw + 2 * kw + 3 * f;
  const int64_t global = 4 * d + 1 + 2 * c.vocab_size + 2 * (c.head_dim / 2) + 2 * qw + 2 * kw + 3 * f;
  const int64_t elements = n * (layers * per_layer + global);
  return elements * static_cast<int64_t>(sizeof(T)) +
         n * (layers * c.num_q_heads * static_cast<int64_t>(sizeof(float)) + 2 * static_cast<int64_t>(sizeof(int32_t)));
}

template <typename T>
Status Model<T>::tp_reduce(T* data, int64_t count) {
  if (tp_.size <= 1) return Status::ok();
  const trace::Scope span("tp all-reduce", "comm");
  const auto begin = Clock::now();
  if (!tp_.all_reduce) return internal_error("tensor parallelism without an all-reduce");
  DISTCA_RETURN_IF_ERROR(tp_.all_reduce(data, count));
  tp_seconds_ += seconds_since(begin);
  return Status::ok();
}

template <typename T>
Model<T>::Model(const ModelConfig& config, int64_t max_tokens, LayerRange range, TensorParallel<T> tp)
    : config_(config), tp_(std::move(tp)), max_tokens_(max_tokens), first_(range.first),
      count_(range.count < 0 ? config.num_layers - range.first : range.count) {
  DISTCA_CHECK(first_ >= 0 && count_ >= 1 && first_ + count_ <= config.num_layers)
      << "layers [" << first_ << ", " << first_ + count_ << ") of " << config.num_layers;
  const ModelConfig& c = config_;
  const int64_t n = max_tokens, d = c.d_model, f = c.ffn_dim, qw = c.q_width(), kw = c.kv_width();
  struct Offsets {
    int64_t x, h1, rstd1, q, k, v, o, x_mid, h2, rstd2, gate, up, s;
  };
  std::vector<Offsets> offsets;
  for (int64_t l = 0; l < count_; ++l) {
    auto add = [&](const char* what, int64_t count) { return acts_.add(fmt::format("layers.{}.{}", l, what), count); };
    offsets.push_back({add("x", n * d), add("h1", n * d), add("rstd1", n), add("q", n * qw), add("k", n * kw),
                       add("v", n * kw), add("o", n * qw), add("x_mid", n * d), add("h2", n * d), add("rstd2", n),
                       add("gate", n * f), add("up", n * f), add("s", n * f)});
  }
  const int64_t half = c.head_dim / 2;
  const int64_t x_final = acts_.add("x_final", n * d), hf = acts_.add("hf", n * d), rstdf = acts_.add("rstdf", n),
                logits = acts_.add("logits", n * c.vocab_size), dlogits = acts_.add("dlogits", n * c.vocab_size),
                cos = acts_.add("rope_cos", n * half), sin = acts_.add("rope_sin", n * half),
                dx = acts_.add("dx", n * d), dh = acts_.add("dh", n * d), dq = acts_.add("dq", n * qw),
                dk = acts_.add("dk", n * kw), dv = acts_.add("dv", n * kw), d_o = acts_.add("do", n * qw),
                dgate = acts_.add("dgate", n * f), dup = acts_.add("dup", n * f), ds = acts_.add("ds", n * f);
  acts_.allocate();
  lse_.assign(static_cast<size_t>(count_ * n * c.num_q_heads), 0.0f);
  for (int64_t l = 0; l < count_; ++l) {
    const Offsets& o = offsets[l];
    auto p = [this](int64_t off) { return acts_.at(off); };
    layer_acts_.push_back({p(o.x), p(o.h1), p(o.rstd1), p(o.q), p(o.k), p(o.v), p(o.o), p(o.x_mid), p(o.h2),
                           p(o.rstd2), p(o.gate), p(o.up), p(o.s), lse_.data() + l * n * c.num_q_heads});
  }
  x_final_ = acts_.at(x_final), hf_ = acts_.at(hf), rstdf_ = acts_.at(rstdf), logits_ = acts_.at(logits);
  dlogits_ = acts_.at(dlogits), cos_ = acts_.at(cos), sin_ = acts_.at(sin), dx_ = acts_.at(dx), dh_ = acts_.at(dh);
  dq_ = acts_.at(dq), dk_ = acts_.at(dk), dv_ = acts_.at(dv), do_ = acts_.at(d_o), dgate_ = acts_.at(dgate);
  dup_ = acts_.at(dup), ds_ = acts_.at(ds);
  ids_.assign(static_cast<size_t>(2 * n), -1);
  tokens_ = ids_.data();
  targets_ = ids_.data() + n;
}

template <typename T>
Model<T>::Model(Model& whole, int64_t r0, int64_t rows)
    : config_(whole.config_), tp_(whole.tp_), poll_(whole.poll_), grads_done_(whole.grads_done_), max_tokens_(rows), first_(whole.first_), count_(whole.count_) {
  const ModelConfig& c = config_;
  const int64_t d = c.d_model, f = c.ffn_dim, qw = c.q_width(), kw = c.kv_width(), V = c.vocab_size, half = c.head_dim / 2;
  for (const LayerActs& a : whole.layer_acts_) {  // every buffer is [rows, width]: row r0 on
    layer_acts_.push_back({a.x + r0 * d, a.h1 + r0 * d, a.rstd1 + r0, a.q + r0 * qw, a.k + r0 * kw, a.v + r0 * kw,
                           a.o + r0 * qw, a.x_mid + r0 * d, a.h2 + r0 * d, a.rstd2 + r0, a.gate + r0 * f,
                           a.up + r0 * f, a.s + r0 * f, a.lse + r0 * c.num_q_heads});
  }
  x_final_ = whole.x_final_ + r0 * d, hf_ = whole.hf_ + r0 * d, rstdf_ = whole.rstdf_ + r0;
  logits_ = whole.logits_ + r0 * V, dlogits_ = whole.dlogits_ + r0 * V;
  cos_ = whole.cos_ + r0 * half, sin_ = whole.sin_ + r0 * half;
  dx_ = whole.dx_ + r0 * d, dh_ = whole.dh_ + r0 * d, dq_ = whole.dq_ + r0 * qw, dk_ = whole.dk_ + r0 * kw;
  dv_ = whole.dv_ + r0 * kw, do_ = whole.do_ + r0 * qw, dgate_ = whole.dgate_ + r0 * f, dup_ = whole.dup_ + r0 * f;
  ds_ = whole.ds_ + r0 * f;
  tokens_ = whole.tokens_ + r0;
  targets_ = whole.targets_ + r0;
}

template <typename T>
std::unique_ptr<Model<T>> Model<T>::slice(int64_t first_row, int64_t rows) {
  DISTCA_CHECK(first_row >= 0 && rows >= 0 && first_row + rows <= max_tokens_)
      << "rows [" << first_row << ", " << first_row + rows << ") of a workspace of " << max_tokens_;
  return std::unique_ptr<Model>(new Model(*this, first_row, rows));
}

template <typename T>
const typename Model<T>::Views& Model<T>::views(ModelState<T>& state) {
  // Rebuilt when another state (or a reallocated one) comes: block lookups by name are not free.
  if (views_.state != &state || views_.data != state.params.data() || views_.grad_data != state.grads.data()) {
    views_ = {&state, state.params.data(), state.grads.data(), state.weights(), state.gradients()};
  }
  return views_;
}

template <typename T>
Status Model<T>::begin_forward(ModelState<T>& state, const StepTokens& in, const T* x_in) {
  const trace::Scope span("embedding", "linear");
  const ModelConfig& c = config_;
  const auto n = static_cast<int64_t>(in.tokens.size());
  if (n > max_tokens_) return invalid_argument(fmt::format("{} tokens but the model's workspace holds {}", n, max_tokens_));
  if (static_cast<int64_t>(in.targets.size()) != n || static_cast<int64_t>(in.positions.size()) != n) {
    return invalid_argument("tokens, targets and positions must have one entry per token");
  }
  n_ = n;
  const int64_t d = c.d_model, V = c.vocab_size;
  const Weights<T> w = state.weights();
  if (!has_embedding() && x_in == nullptr) return invalid_argument("a stage without the embedding needs its input activations");
  if (!has_embedding()) std::memcpy(layer_acts_[0].x, x_in, sizeof(T) * n * d);
  // Embedding and the RoPE tables of this step's positions.
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = in.tokens[i];
    if (t < 0 || t >= V) return invalid_argument(fmt::format("token {} at row {} is outside the vocabulary of {}", t, i, V));
    if (in.targets[i] < -1 || in.targets[i] >= V) {
      return invalid_argument(fmt::format("target {} at row {} is outside the vocabulary of {}", in.targets[i], i, V));
    }
    tokens_[i] = t;
    targets_[i] = in.targets[i];
    if (has_embedding()) std::memcpy(layer_acts_[0].x + i * d, w.embed + t * d, sizeof(T) * d);
  }
  const int64_t half = c.head_dim / 2;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < half; ++j) {
      const double angle = in.positions[i] * std::pow(c.rope_base, -2.0 * static_cast<double>(j) / static_cast<double>(c.head_dim));
      cos_[i * half + j] = static_cast<T>(std::cos(angle));
      sin_[i * half + j] = static_cast<T>(std::sin(angle));
    }
  }
  return Status::ok();
}

template <typename T>
typename Model<T>::AttentionIo Model<T>::attention_io(int64_t slot) {
  const LayerActs& a = layer_acts_[slot];
  return {a.q, a.k, a.v, a.o, a.lse, do_, dq_, dk_, dv_};
}

template <typename T>
void Model<T>::forward_pre_attention(ModelState<T>& state, int64_t slot) {
  const trace::Scope span("layer: norm, Q/K/V, RoPE", "linear", static_cast<int>(first_ + slot));
  const ModelConfig& c = config_;
  const int64_t n = n_, d = c.d_model, qw = c.q_width(), kw = c.kv_width();
  const LayerWeights<T>& lw = views(state).params.layers[first_ + slot];
  const LayerActs& a = layer_acts_[slot];
  rmsnorm_forward(a.x, lw.attn_norm, n, d, c.norm_eps, a.h1, a.rstd1);
  gemm(false, false, n, qw, d, a.h1, lw.wq, T(0), a.q);
  poll();
  gemm(false, false, n, kw, d, a.h1, lw.wk, T(0), a.k);
  poll();
  gemm(false, false, n, kw, d, a.h1, lw.wv, T(0), a.v);
  poll();
  rope(a.q, n, c.num_q_heads, c.head_dim, cos_, sin_, T(1));
  rope(a.k, n, c.num_kv_heads, c.head_dim, cos_, sin_, T(1));
}

template <typename T>
Status Model<T>::forward_post_attention(ModelState<T>& state, int64_t slot) {
  const trace::Scope span("layer: Wo, feed-forward", "linear", static_cast<int>(first_ + slot));
  const ModelConfig& c = config_;
  const int64_t n = n_, d = c.d_model, f = c.ffn_dim, qw = c.q_width();
  const LayerWeights<T>& lw = views(state).params.layers[first_ + slot];
  const LayerActs& a = layer_acts_[slot];
  T* x_out = slot + 1 < count_ ? layer_acts_[slot + 1].x : x_final_;
  if (tp_.size > 1) {  // x_mid = x + sum over the group of o Wo
    gemm(false, false, n, d, qw, a.o, lw.wo, T(0), a.x_mid);
    poll();
    DISTCA_RETURN_IF_ERROR(tp_reduce(a.x_mid, n * d));
    for (int64_t i = 0; i < n * d; ++i) a.x_mid[i] += a.x[i];
  } else {
    std::memcpy(a.x_mid, a.x, sizeof(T) * n * d);
    gemm(false, false, n, d, qw, a.o, lw.wo, T(1), a.x_mid);
    poll();
  }
  rmsnorm_forward(a.x_mid, lw.mlp_norm, n, d, c.norm_eps, a.h2, a.rstd2);
  gemm(false, false, n, f, d, a.h2, lw.w_gate, T(0), a.gate);
  poll();
  gemm(false, false, n, f, d, a.h2, lw.w_up, T(0), a.up);
  poll();
  for (int64_t i = 0; i < n * f; ++i) a.s[i] = a.gate[i] * sigmoid(a.gate[i]) * a.up[i];
  if (tp_.size > 1) {
    gemm(false, false, n, d, f, a.s, lw.w_down, T(0), x_out);
    poll();
    DISTCA_RETURN_IF_ERROR(tp_reduce(x_out, n * d));
    for (int64_t i = 0; i < n * d; ++i) x_out[i] += a.x_mid[i];
  } else {
    std::memcpy(x_out, a.x_mid, sizeof(T) * n * d);
    gemm(false, false, n, d, f, a.s, lw.w_down, T(1), x_out);
    poll();
  }
  return Status::ok();
}

template <typename T>
double Model<T>::finish_forward(ModelState<T>& state, double loss_scale) {
  const trace::Scope span("head and loss", "linear");
  if (!has_head()) return 0.0;
  const ModelConfig& c = config_;
  const int64_t n = n_, d = c.d_model, V = c.vocab_size;
  const Weights<T> w = state.weights();
  rmsnorm_forward(x_final_, w.final_norm, n, d, c.norm_eps, hf_, rstdf_);
  gemm(false, false, n, V, d, hf_, w.lm_head, T(0), logits_);
  // Cross-entropy; dlogits = (softmax - onehot) * loss_scale on rows with a target, else 0.
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* z = logits_ + i * V;
    T* dz = dlogits_ + i * V;
    const int32_t target = targets_[i];
    if (target < 0) {
      std::fill(dz, dz + V, T(0));
      continue;
    }
    double mx = z[0];
    for (int64_t j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(z[j]));
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(z[j]) - mx);
    const double lse = mx + std::log(sum);
    loss += lse - static_cast<double>(z[target]);
    for (int64_t j = 0; j < V; ++j) dz[j] = static_cast<T>(std::exp(static_cast<double>(z[j]) - lse) * loss_scale);
    dz[target] -= static_cast<T>(loss_scale);
  }
  return loss;
}

template <typename T>
void Model<T>::add_times(PassTimes* times, std::chrono::steady_clock::time_point begin, const AttentionTimes& before,
                         const AttentionBackend<T>& attention, double tp_before) const {
  if (times == nullptr) return;
  times->total += seconds_since(begin);
  times->attention += attention.times.compute - before.compute;
  times->comm += attention.times.comm - before.comm + (tp_seconds_ - tp_before);
}

template <typename T>
Result<double> Model<T>::forward(ModelState<T>& state, const StepTokens& in, AttentionBackend<T>& attention,
                                 double loss_scale, PassTimes* times, const T* x_in) {
  // The pass's span: what its phases, attention and communication spans leave of it is linear
  // time as PassTimes counts it (total - attention - comm), so the parts' spans add up to it.
  const trace::Scope span("forward pass", "linear");
  const auto begin = Clock::now();
  const AttentionTimes before = attention.times;
  const double tp_before = tp_seconds_;
  DISTCA_RETURN_IF_ERROR(begin_forward(state, in, x_in));
  for (int64_t l = 0; l < count_; ++l) {
    forward_pre_attention(state, l);
    const AttentionIo io = attention_io(l);
    DISTCA_RETURN_IF_ERROR(attention.forward(static_cast<int>(first_ + l), io.q, io.k, io.v, io.o, io.lse));
    DISTCA_RETURN_IF_ERROR(forward_post_attention(state, l));
  }
  const double loss = finish_forward(state, loss_scale);
  add_times(times, begin, before, attention, tp_before);
  return loss;
}

template <typename T>
Status Model<T>::begin_backward(ModelState<T>& state, const T* dx_in, bool zero_grads) {
  const trace::Scope span("head backward", "linear");
  const ModelConfig& c = config_;
  const int64_t n = n_, d = c.d_model, V = c.vocab_size;
  if (zero_grads) state.grads.fill(T(0));
  if (has_head()) {
    // Head and final norm: dx_ = d loss / d x_final.
    const Weights<T> w = state.weights();
    const Weights<T> g = state.gradients();
    gemm(true, false, d, V, n, hf_, dlogits_, T(1), g.lm_head);
    gemm(false, true, n, d, V, dlogits_, w.lm_head, T(0), dh_);
    std::fill(dx_, dx_ + n * d, T(0));
    rmsnorm_backward(x_final_, w.final_norm, rstdf_, dh_, n, d, dx_, g.final_norm);
    grads_done({GradsDone::Kind::kHead, -1});
    return Status::ok();
  }
  if (dx_in == nullptr) return invalid_argument("a stage without the head needs the gradient of its output");
  std::memcpy(dx_, dx_in, sizeof(T) * n * d);
  return Status::ok();
}

template <typename T>
Status Model<T>::backward_post_attention(ModelState<T>& state, int64_t slot) {
  const trace::Scope span("layer backward: feed-forward, Wo", "linear", static_cast<int>(first_ + slot));
  const ModelConfig& c = config_;
  const int64_t n = n_, d = c.d_model, f = c.ffn_dim, qw = c.q_width();
  const LayerWeights<T>& lw = views(state).params.layers[first_ + slot];
  const LayerWeights<T>& lg = views(state).grads.layers[first_ + slot];
  const LayerActs& a = layer_acts_[slot];
  // MLP: x_out = x_mid + s Wdown, s = silu(gate) up.
  gemm(true, false, f, d, n, a.s, dx_, T(1), lg.w_down);
  poll();
  gemm(false, true, n, f, d, dx_, lw.w_down, T(0), ds_);
  poll();
  for (int64_t i = 0; i < n * f; ++i) {
    const T sg = sigmoid(a.gate[i]);
    const T silu = a.gate[i] * sg;
    dup_[i] = ds_[i] * silu;
    dgate_[i] = ds_[i] * a.up[i] * sg * (T(1) + a.gate[i] * (T(1) - sg));
  }
  gemm(true, false, d, f, n, a.h2, dgate_, T(1), lg.w_gate);
  poll();
  gemm(true, false, d, f, n, a.h2, dup_, T(1), lg.w_up);
  poll();
  gemm(false, true, n, d, f, dgate_, lw.w_gate, T(0), dh_);
  poll();
  gemm(false, true, n, d, f, dup_, lw.w_up, T(1), dh_);
  poll();
  DISTCA_RETURN_IF_ERROR(tp_reduce(dh_, n * d));
  rmsnorm_backward(a.x_mid, lw.mlp_norm, a.rstd2, dh_, n, d, dx_, lg.mlp_norm);  // dx_ = d / d x_mid
  // Attention: x_mid = x + o Wo.
  gemm(true, false, qw, d, n, a.o, dx_, T(1), lg.wo);
  poll();
  gemm(false, true, n, qw, d, dx_, lw.wo, T(0), do_);
  poll();
  grads_done({GradsDone::Kind::kLayerMlp, first_ + slot});
  return Status::ok();
}

template <typename T>
Status Model<T>::backward_pre_attention(ModelState<T>& state, int64_t slot) {
  const trace::Scope span("layer backward: RoPE, Q/K/V, norm", "linear", static_cast<int>(first_ + slot));
  const ModelConfig& c = config_;
  const int64_t n = n_, d = c.d_model, qw = c.q_width(), kw = c.kv_width();
  const LayerWeights<T>& lw = views(state).params.layers[first_ + slot];
  const LayerWeights<T>& lg = views(state).grads.layers[first_ + slot];
  const LayerActs& a = layer_acts_[slot];
  rope(dq_, n, c.num_q_heads, c.head_dim, cos_, sin_, T(-1));
  rope(dk_, n, c.num_kv_heads, c.head_dim, cos_, sin_, T(-1));
  gemm(true, false, d, qw, n, a.h1, dq_, T(1), lg.wq);
  poll();
  gemm(true, false, d, kw, n, a.h1, dk_, T(1), lg.wk);
  poll();
  gemm(true, false, d, kw, n, a.h1, dv_, T(1), lg.wv);
  poll();
  gemm(false, true, n, d, qw, dq_, lw.wq, T(0), dh_);
  poll();
  gemm(false, true, n, d, kw, dk_, lw.wk, T(1), dh_);
  poll();
  gemm(false, true, n, d, kw, dv_, lw.wv, T(1), dh_);
  poll();
  DISTCA_RETURN_IF_ERROR(tp_reduce(dh_, n * d));
  rmsnorm_backward(a.x, lw.attn_norm, a.rstd1, dh_, n, d, dx_, lg.attn_norm);  // dx_ = d / d x
  grads_done({GradsDone::Kind::kLayerAttention, first_ + slot});
  return Status::ok();
}

template <typename T>
void Model<T>::finish_backward(ModelState<T>& state) {
  const trace::Scope span("embedding backward", "linear");
  if (!has_embedding()) return;
  const int64_t d = config_.d_model;
  T* embed = state.gradients().embed;
  for (int64_t i = 0; i < n_; ++i) {
    T* ge = embed + tokens_[i] * d;
    const T* dxi = dx_ + i * d;
    for (int64_t j = 0; j < d; ++j) ge[j] += dxi[j];
  }
  grads_done({GradsDone::Kind::kEmbedding, -1});
}

template <typename T>
Status Model<T>::reduce_shared_grads(ModelState<T>& state) {
  if (!tp_.kv_all_reduce) return Status::ok();
  const trace::Scope span("tp all-reduce (shared K/V heads)", "comm");
  const auto t0 = Clock::now();
  const int64_t n = config_.d_model * config_.kv_width();
  for (int64_t l = first_; l < first_ + count_; ++l) {
    const LayerWeights<T>& lg = views(state).grads.layers[l];
    DISTCA_RETURN_IF_ERROR(tp_.kv_all_reduce(lg.wk, n));
    DISTCA_RETURN_IF_ERROR(tp_.kv_all_reduce(lg.wv, n));
  }
  tp_seconds_ += seconds_since(t0);
  return Status::ok();
}

template <typename T>
Status Model<T>::backward(ModelState<T>& state, AttentionBackend<T>& attention, PassTimes* times, const T* dx_in) {
  const trace::Scope span("backward pass", "linear");  // as forward's
  const auto begin = Clock::now();
  const AttentionTimes before = attention.times;
  const double tp_before = tp_seconds_;
  DISTCA_RETURN_IF_ERROR(begin_backward(state, dx_in));
  for (int64_t l = count_ - 1; l >= 0; --l) {
    DISTCA_RETURN_IF_ERROR(backward_post_attention(state, l));
    const AttentionIo io = attention_io(l);
    DISTCA_RETURN_IF_ERROR(attention.backward(static_cast<int>(first_ + l), io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq,
                                              io.dk, io.dv));
    DISTCA_RETURN_IF_ERROR(backward_pre_attention(state, l));
  }
  finish_backward(state);
  DISTCA_RETURN_IF_ERROR(reduce_shared_grads(state));
  add_times(times, begin, before, attention, tp_before);
  return Status::ok();
}

template struct ModelState<float>;
template struct ModelState<double>;
template class Model<float>;
template class Model<double>;

}  // namespace distca::model
