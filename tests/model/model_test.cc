// The model's math: a finite-difference check (double) of every parameter's gradient, the
// float model against the double one, and forward logits and loss against an independent NumPy
// implementation (golden file, made by make_golden.py beside this file).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/file.h"
#include "distca/model/attention.h"
#include "distca/model/model.h"
#include "distca/model/optimizer.h"
#include "distca/plan/batch.h"

namespace distca::model {
namespace {

// A step of whole documents on one rank: tokens from a fixed pattern, targets and positions.
struct Doc1 {
  plan::Batch batch;
  std::vector<int32_t> tokens, targets, positions;
  int64_t num_targets = 0;
  StepTokens in() const { return {tokens, targets, positions}; }
};

Doc1 make_docs(const std::vector<int64_t>& lengths, int64_t vocab, uint64_t seed) {
  Doc1 d;
  auto b = plan::batch_from_ranks({lengths}, 0);
  EXPECT_TRUE(b.is_ok());
  d.batch = b.value();
  uint64_t x = seed;
  for (int64_t len : lengths) {
    for (int64_t i = 0; i < len; ++i) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      d.tokens.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab)));
      d.positions.push_back(static_cast<int32_t>(i));
    }
  }
  size_t at = 0;
  for (int64_t len : lengths) {
    for (int64_t i = 0; i < len; ++i, ++at) {
      d.targets.push_back(i + 1 < len ? d.tokens[at + 1] : -1);
      d.num_targets += i + 1 < len ? 1 : 0;
    }
  }
  return d;
}

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 11;
  c.d_model = 8;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  c.ffn_dim = 12;
  c.init_std = 0.5;  // large weights: every path of the network matters to the loss
  c.init_seed = 7;
  return c;
}

TEST(Model, FiniteDifferencesMatchEveryParameterGradientInDouble) {
  const ModelConfig c = small_config();
  const Doc1 d = make_docs({5, 1, 7, 3}, c.vocab_size, 3);
  auto state = ModelState<double>::create(c);
  // Non-trivial norm gains too.
  for (const auto& b : state.params.blocks()) {
    if (b.name.ends_with("norm")) {
      for (int64_t i = 0; i < b.count; ++i) state.params.at(b.offset)[i] = 0.5 + 0.1 * static_cast<double>(i % 7);
    }
  }
  Model<double> model(c, 16);
  LocalAttention<double> attention(c, 0);
  ASSERT_TRUE(attention.begin_step(d.batch).is_ok());
  const double scale = 1.0 / static_cast<double>(d.num_targets);
  ASSERT_TRUE(model.forward(state, d.in(), attention, scale).is_ok());
  ASSERT_TRUE(model.backward(state, attention).is_ok());
  const std::vector<double> analytic(state.grads.data(), state.grads.data() + state.grads.size());
  auto loss = [&]() {
    auto l = model.forward(state, d.in(), attention, scale);
    EXPECT_TRUE(l.is_ok());
    return l.value() * scale;
  };
  const double h = 1e-5;
  int checked = 0;
  for (const auto& b : state.params.blocks()) {
    double worst = 0;
    for (int64_t i = 0; i < b.count; ++i) {
      double& p = state.params.at(b.offset)[i];
      const double saved = p;
      p = saved + h;
      const double up = loss();
      p = saved - h;
      const double down = loss();
      p = saved;
      const double fd = (up - down) / (2 * h);
      const double an = analytic[b.offset + i];
      worst = std::max(worst, std::abs(fd - an) / (1e-6 + std::abs(an) + std::abs(fd)));
      EXPECT_NEAR(fd, an, 1e-7 + 1e-5 * std::abs(an)) << b.name << "[" << i << "]";
      ++checked;
    }
    SCOPED_TRACE(b.name);
    EXPECT_LT(worst, 1e-4) << b.name;
  }
  EXPECT_EQ(checked, c.num_parameters());
  // Every block has a gradient that is not identically zero (the check is not vacuous); the
  // embedding rows of tokens that never occur are the only zeros.
  for (const auto& b : state.params.blocks()) {
    double sum = 0;
    for (int64_t i = 0; i < b.count; ++i) sum += std::abs(analytic[b.offset + i]);
    EXPECT_GT(sum, 1e-8) << b.name;
  }
}

TEST(Model, FloatModelWithCpuKernelsMatchesTheDoubleReference) {
  ModelConfig c = small_config();
  c.head_dim = 32;  // the CPU kernels' smallest head dim
  c.d_model = 48;
  c.vocab_size = 40;
  const Doc1 d = make_docs({33, 2, 60, 1, 17}, c.vocab_size, 5);
  auto sd = ModelState<double>::create(c);
  auto sf = ModelState<float>::create(c);
  Model<double> md(c, 128);
  Model<float> mf(c, 128);
  LocalAttention<double> ad(c, 0);
  LocalAttention<float> af(c, 0);
  ASSERT_TRUE(ad.begin_step(d.batch).is_ok());
  ASSERT_TRUE(af.begin_step(d.batch).is_ok());
  const double scale = 1.0 / static_cast<double>(d.num_targets);
  auto ld = md.forward(sd, d.in(), ad, scale);
  auto lf = mf.forward(sf, d.in(), af, scale);
  ASSERT_TRUE(ld.is_ok() && lf.is_ok()) << lf.status().to_string();
  EXPECT_NEAR(lf.value(), ld.value(), 1e-5 * std::abs(ld.value()));
  ASSERT_TRUE(md.backward(sd, ad).is_ok());
  ASSERT_TRUE(mf.backward(sf, af).is_ok());
  double worst = 0, norm = 0;
  for (int64_t i = 0; i < sd.grads.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(sf.grads.data()[i]) - sd.grads.data()[i]));
    norm = std::max(norm, std::abs(sd.grads.data()[i]));
  }
  EXPECT_LT(worst, 1e-4 * norm);
}

// Two nano-batches in two row slices of one workspace, their phases interleaved layer by layer
// as ping-pong runs them, and their gradients summed (zero_grads false), give the whole batch's
// loss and gradients: the slices share no rows and the phases accumulate.
TEST(Model, TwoRowSlicesInterleavedEqualTheWholeBatch) {
  const ModelConfig c = small_config();
  const Doc1 a = make_docs({5, 7}, c.vocab_size, 11), b = make_docs({1, 3}, c.vocab_size, 12);
  // The whole batch is a's documents then b's, with the same tokens.
  Doc1 ab = make_docs({5, 7, 1, 3}, c.vocab_size, 0);
  for (auto* v : {&ab.tokens, &ab.targets, &ab.positions}) v->clear();
  for (const Doc1* x : {&a, &b}) {
    ab.tokens.insert(ab.tokens.end(), x->tokens.begin(), x->tokens.end());
    ab.targets.insert(ab.targets.end(), x->targets.begin(), x->targets.end());
    ab.positions.insert(ab.positions.end(), x->positions.begin(), x->positions.end());
  }
  ab.num_targets = a.num_targets + b.num_targets;
  const double scale = 1.0 / static_cast<double>(ab.num_targets);
  auto reference = ModelState<double>::create(c);
  Model<double> full(c, 16);
  LocalAttention<double> attention(c, 0);
  ASSERT_TRUE(attention.begin_step(ab.batch).is_ok());
  auto want_loss = full.forward(reference, ab.in(), attention, scale);
  ASSERT_TRUE(want_loss.is_ok());
  ASSERT_TRUE(full.backward(reference, attention).is_ok());

  auto state = ModelState<double>::create(c);
  Model<double> workspace(c, 16);
  std::unique_ptr<Model<double>> sa = workspace.slice(0, 12), sb = workspace.slice(12, 4);
  LocalAttention<double> att_a(c, 0), att_b(c, 0);
  ASSERT_TRUE(att_a.begin_step(a.batch).is_ok());
  ASSERT_TRUE(att_b.begin_step(b.batch).is_ok());
  ASSERT_TRUE(sa->begin_forward(state, a.in()).is_ok());
  ASSERT_TRUE(sb->begin_forward(state, b.in()).is_ok());
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (auto [m, att] : {std::pair{sa.get(), &att_a}, {sb.get(), &att_b}}) {
      m->forward_pre_attention(state, l);
      const auto io = m->attention_io(l);
      ASSERT_TRUE(att->forward(static_cast<int>(l), io.q, io.k, io.v, io.o, io.lse).is_ok());
      ASSERT_TRUE(m->forward_post_attention(state, l).is_ok());
    }
  }
  const double loss = sa->finish_forward(state, scale) + sb->finish_forward(state, scale);
  EXPECT_NEAR(loss, want_loss.value(), 1e-12 * std::abs(loss));
  state.grads.fill(0.0);  // the caller zeroes once; the slices only add
  ASSERT_TRUE(sa->begin_backward(state, nullptr, false).is_ok());
  ASSERT_TRUE(sb->begin_backward(state, nullptr, false).is_ok());
  for (int64_t l = c.num_layers - 1; l >= 0; --l) {
    for (auto [m, att] : {std::pair{sb.get(), &att_b}, {sa.get(), &att_a}}) {
      ASSERT_TRUE(m->backward_post_attention(state, l).is_ok());
      const auto io = m->attention_io(l);
      ASSERT_TRUE(att->backward(static_cast<int>(l), io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv).is_ok());
      ASSERT_TRUE(m->backward_pre_attention(state, l).is_ok());
    }
  }
  sa->finish_backward(state);
  sb->finish_backward(state);
  ASSERT_TRUE(sa->reduce_shared_grads(state).is_ok());
  EXPECT_EQ(sa->allocated_bytes(), 0);
  double worst = 0, largest = 0;
  for (int64_t i = 0; i < state.grads.size(); ++i) {
    worst = std::max(worst, std::abs(state.grads.data()[i] - reference.grads.data()[i]));
    largest = std::max(largest, std::abs(reference.grads.data()[i]));
  }
  EXPECT_GT(largest, 1e-3);
  EXPECT_LT(worst, 1e-12 * largest);
}

// AdamW against the update written out by hand for two steps: clipping by the global norm,
// bias correction, warm-up, and decay on matrices only.
TEST(Model, AdamWMatchesTheHandWrittenUpdate) {
  const ModelConfig c = small_config();
  auto state = ModelState<double>::create(c);
  OptimConfig o;
  o.lr = 0.01;
  o.warmup_steps = 2;
  o.clip_norm = 1.0;
  std::vector<double> p(state.params.data(), state.params.data() + state.params.size());
  std::vector<double> m(p.size(), 0.0), v(p.size(), 0.0);
  for (int step = 0; step < 2; ++step) {
    double ss = 0;
    for (int64_t i = 0; i < state.grads.size(); ++i) {
      state.grads.data()[i] = (step == 0 ? 0.5 : -0.25) * static_cast<double>(1 + i % 3);
      ss += state.grads.data()[i] * state.grads.data()[i];
    }
    const double clip = std::min(1.0, 1.0 / std::sqrt(ss));
    const double lr = o.lr * (step + 1) / 2.0;
    for (const auto& b : state.params.blocks()) {
      const double wd = b.name.ends_with("norm") ? 0.0 : o.weight_decay;
      for (int64_t i = b.offset; i < b.offset + b.count; ++i) {
        const double g = state.grads.data()[i] * clip;
        m[i] = 0.9 * m[i] + 0.1 * g;
        v[i] = 0.95 * v[i] + 0.05 * g * g;
        const double mhat = m[i] / (1 - std::pow(0.9, step + 1)), vhat = v[i] / (1 - std::pow(0.95, step + 1));
        p[i] -= lr * (mhat / (std::sqrt(vhat) + o.eps) + wd * p[i]);
      }
    }
    EXPECT_NEAR(adamw_step(state, o), std::sqrt(ss), 1e-9);
  }
  EXPECT_EQ(state.step, 2);
  for (size_t i = 0; i < p.size(); ++i) ASSERT_NEAR(state.params.data()[i], p[i], 1e-12) << i;
}

TEST(Model, WorkspaceEstimateIsWhatTheConstructorAllocates) {
  // The memory check before a run relies on this formula; it must match the real layout.
  for (int64_t tokens : {1, 37, 256}) {
    ModelConfig c = small_config();
    EXPECT_EQ(Model<float>::workspace_bytes(c, tokens), Model<float>(c, tokens).allocated_bytes()) << tokens;
    c.num_layers = 3;
    c.ffn_dim = 40;
    EXPECT_EQ(Model<double>::workspace_bytes(c, tokens), Model<double>(c, tokens).allocated_bytes()) << tokens;
  }
}

TEST(Model, LocalAttentionRefusesADocumentSplitAcrossRanks) {
  const ModelConfig c = small_config();
  auto batch = plan::pack_documents({30}, 2, 16);
  ASSERT_TRUE(batch.is_ok());
  LocalAttention<double> a(c, 1);
  const Status s = a.begin_step(batch.value());
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("split across ranks"), std::string::npos) << s.message();
}

TEST(Model, BadTokensAreRefused) {
  const ModelConfig c = small_config();
  Doc1 d = make_docs({4}, c.vocab_size, 1);
  auto state = ModelState<double>::create(c);
  Model<double> model(c, 4);
  LocalAttention<double> attention(c, 0);
  ASSERT_TRUE(attention.begin_step(d.batch).is_ok());
  d.tokens[2] = 11;
  auto r = model.forward(state, d.in(), attention, 1.0);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("outside the vocabulary"), std::string::npos);
  Doc1 big = make_docs({5}, c.vocab_size, 1);
  EXPECT_FALSE(model.forward(state, big.in(), attention, 1.0).is_ok());  // more rows than the workspace
}

// The golden file holds a model (every parameter by block name), packed documents, and the
// logits and loss NumPy computed for them with its own implementation.
TEST(Model, ForwardMatchesTheNumpyGolden) {
  auto text = read_text_file(DISTCA_GOLDEN_DIR "/tiny_forward.json");
  ASSERT_TRUE(text.is_ok()) << text.status().to_string();
  const auto g = nlohmann::json::parse(text.value());
  auto config = model_config_from_json(g["model"]);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  const ModelConfig& c = config.value();
  auto state = ModelState<double>::create(c);
  for (const auto& b : state.params.blocks()) {
    ASSERT_TRUE(g["params"].contains(b.name)) << b.name;
    const auto values = g["params"][b.name].get<std::vector<double>>();
    ASSERT_EQ(static_cast<int64_t>(values.size()), b.count) << b.name;
    std::copy(values.begin(), values.end(), state.params.at(b.offset));
  }
  const auto lengths = g["doc_lengths"].get<std::vector<int64_t>>();
  Doc1 d = make_docs(lengths, c.vocab_size, 1);
  d.tokens = g["tokens"].get<std::vector<int32_t>>();
  for (size_t i = 0; i + 1 < d.tokens.size(); ++i) d.targets[i] = d.targets[i] < 0 ? -1 : d.tokens[i + 1];
  d.targets.back() = -1;
  const auto n = static_cast<int64_t>(d.tokens.size());
  Model<double> model(c, n);
  LocalAttention<double> attention(c, 0);
  ASSERT_TRUE(attention.begin_step(d.batch).is_ok());
  auto loss = model.forward(state, d.in(), attention, 1.0);
  ASSERT_TRUE(loss.is_ok());
  EXPECT_NEAR(loss.value() / static_cast<double>(d.num_targets), g["loss"].get<double>(), 1e-10);
  const auto logits = g["logits"].get<std::vector<double>>();
  ASSERT_EQ(static_cast<int64_t>(logits.size()), n * c.vocab_size);
  for (int64_t i = 0; i < n * c.vocab_size; ++i) ASSERT_NEAR(model.logits()[i], logits[i], 1e-10) << i;
}

}  // namespace
}  // namespace distca::model
