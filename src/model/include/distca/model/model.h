// The Llama-style decoder, forward and backward written out layer by layer:
//   x0 = embed[tokens]
//   per layer: h = rmsnorm(x) g1; q, k, v = h Wq, h Wk, h Wv; RoPE(q, k) at each token's
//              position in its document; o, lse = attention(q, k, v) (a backend); x += o Wo;
//              h = rmsnorm(x) g2; x += (silu(h Wgate) * (h Wup)) Wdown
//   logits = rmsnorm(x) gf Wlm; loss = sum over tokens with a target of -log softmax[target]
// Matrices are [in, out] row-major (y = x W) and run through BLAS (sgemm / dgemm). Attention
// never crosses a document boundary (the backend attends per document) and neither does the
// loss (a document's last token has no target). T is float (training) or double (gradient
// checks).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "distca/core/status.h"
#include "distca/model/arena.h"
#include "distca/model/attention.h"
#include "distca/model/config.h"

namespace distca::model {

template <typename T>
struct LayerWeights {
  T* attn_norm = nullptr;  // [d]
  T* wq = nullptr;         // [d, Hq D]
  T* wk = nullptr;         // [d, Hkv D]
  T* wv = nullptr;         // [d, Hkv D]
  T* wo = nullptr;         // [Hq D, d]
  T* mlp_norm = nullptr;   // [d]
  T* w_gate = nullptr;     // [d, f]
  T* w_up = nullptr;       // [d, f]
  T* w_down = nullptr;     // [f, d]
};

template <typename T>
struct Weights {
  T* embed = nullptr;  // [V, d]
  std::vector<LayerWeights<T>> layers;
  T* final_norm = nullptr;  // [d]
  T* lm_head = nullptr;     // [d, V]
};

// Parameters, gradients and AdamW moments: four arenas of one layout. Block names are
// "embed", "layers.<l>.<attn_norm|wq|wk|wv|wo|mlp_norm|w_gate|w_up|w_down>", "final_norm",
// "lm_head".
template <typename T>
struct ModelState {
  ModelConfig config;
  Arena<T> params, grads, m, v;
  int64_t step = 0;  // optimizer steps taken

  // Parameters drawn from config.init_seed (normal(0, init_std); output projections scaled by
  // 1 / sqrt(2 layers); norm gains 1), the same on every rank; moments zero. With tp_size > 1,
  // tensor-parallel rank tp_index's slice of exactly those parameters (config: the whole model;
  // the state's config is tensor_parallel_shard's): columns of Wq, Wk, Wv, Wgate, Wup, rows of
  // Wo, Wdown, the rest whole.
  static ModelState create(const ModelConfig& config, int tp_size = 1, int tp_index = 0);
  Weights<T> weights() { return views(params); }
  Weights<T> gradients() { return views(grads); }
  // Whether weight decay applies to a block (matrices yes, norm gains no).
  static bool is_decayed(const std::string& block_name);
  // Whether tensor parallelism slices a block (the projections) rather than replicating it.
  static bool is_tp_sharded(const std::string& block_name);

 private:
  Weights<T> views(Arena<T>& arena) const;
};

// A backward phase has finished adding to these gradient blocks (Model::set_grads_done; the
// buckets of grad_sync.h): the head's (final norm, LM head); a layer's MLP and output projection
// (mlp_norm, w_gate, w_up, w_down, wo: backward_post_attention); a layer's attention input
// (attn_norm, wq, wk, wv: backward_pre_attention); or the embedding's.
struct GradsDone {
  enum class Kind { kHead, kLayerMlp, kLayerAttention, kEmbedding };
  Kind kind = Kind::kHead;
  int64_t layer = -1;  // kLayerMlp, kLayerAttention: the model's layer index
};

// One step's input on this rank: n tokens, the next token of the same document as the target
// (-1: none, the document's last token), and each token's position in its document.
struct StepTokens {
  std::span<const int32_t> tokens;
  std::span<const int32_t> targets;
  std::span<const int32_t> positions;
};

// Seconds of one pass, split by where they went (attention from the backend's times).
struct PassTimes {
  double total = 0;
  double attention = 0;
  double comm = 0;
  double linear() const { return total - attention - comm; }
};

// The layers a pipeline stage runs: [first, first + count). The first stage also embeds the
// tokens, the last also runs the final norm, the LM head and the loss.
struct LayerRange {
  int64_t first = 0;
  int64_t count = -1;  // -1: every layer from `first` on
};

// Tensor parallelism (Megatron, without sequence parallelism): a rank runs its shard's heads and
// FFN columns (its config is tensor_parallel_shard's) on the whole [n, d] activations, which are
// the same on every rank of the group. The row-parallel outputs (o Wo, s Wdown) and the input
// gradients of the column-parallel projections (dq Wq^T + dk Wk^T + dv Wv^T, dgate Wgate^T +
// dup Wup^T) are partial sums: all_reduce sums them over the group, four all-reduces of [n, d]
// per layer and step. With key/value heads shared by several ranks (fewer heads than ranks),
// their projections' gradients are partial too: kv_all_reduce sums them over the sharing ranks.
// size 1: none.
template <typename T>
struct TensorParallel {
  int size = 1;
  std::function<Status(T*, int64_t)> all_reduce;  // in place; bit-identical on every member
  std::function<Status(T*, int64_t)> kv_all_reduce;  // empty: every rank has key/value heads of its own
};

template <typename T>
class Model {
 public:
  // A workspace (activations and gradients scratch) for up to max_tokens rows, allocated here
  // once: a step allocates nothing. `range`: the layers this model runs (a pipeline stage).
  // `config`: the model (with tensor parallelism, this rank's shard of it).
  Model(const ModelConfig& config, int64_t max_tokens, LayerRange range = {}, TensorParallel<T> tp = {});
  // A model over rows [first_row, first_row + rows) of this one's workspace: the same layers,
  // config and tensor parallelism, its own passes. Two row slices of one workspace run two
  // nano-batches side by side (ping-pong) in the memory of one micro-batch. The slice owns
  // nothing (allocated_bytes 0) and must not outlive this model.
  std::unique_ptr<Model> slice(int64_t first_row, int64_t rows);
  int64_t max_tokens() const { return max_tokens_; }
  const ModelConfig& config() const { return config_; }
  // The bytes the constructor allocates, computed without allocating (memory estimates).
  static int64_t workspace_bytes(const ModelConfig& config, int64_t max_tokens, LayerRange range = {});
  int64_t first_layer() const { return first_; }
  int64_t num_stage_layers() const { return count_; }
  bool has_embedding() const { return first_ == 0; }
  bool has_head() const { return first_ + count_ == config_.num_layers; }
  int64_t allocated_bytes() const {
    return acts_.size() * static_cast<int64_t>(sizeof(T)) +
           static_cast<int64_t>(lse_.size() * sizeof(float) + ids_.size() * sizeof(int32_t));
  }

  // Runs the forward and the loss. Returns the sum over this rank's targets of the loss; keeps
  // dLoss/dlogits scaled by loss_scale (1 / the global number of targets) for backward.
  // A stage without the embedding takes its input activations `x_in` [n, d] (the previous
  // stage's output()); one without the head returns 0 and leaves its activations in output().
  Result<double> forward(ModelState<T>& state, const StepTokens& in, AttentionBackend<T>& attention,
                         double loss_scale, PassTimes* times = nullptr, const T* x_in = nullptr);
  // Gradients of loss_scale x the summed loss into state.grads (overwritten; the shared key/value
  // heads' summed over their ranks: reduce_shared_grads). A stage without
  // the head takes d loss / d output() as `dx_in` [n, d]; one without the embedding leaves
  // d loss / d x_in in input_grad().
  Status backward(ModelState<T>& state, AttentionBackend<T>& attention, PassTimes* times = nullptr,
                  const T* dx_in = nullptr);
  // The same passes in phases, for a caller that drives attention itself (ping-pong interleaves
  // two models' phases): forward() is begin_forward, then per layer slot l (0 .. stage layers - 1)
  // forward_pre_attention(l) (norm, Q/K/V, RoPE), attention on attention_io(l), forward_post_attention(l)
  // (Wo, residual, MLP), then finish_forward (head and loss; 0 without the head). backward() is
  // begin_backward (zeroes the gradients unless told to accumulate; head), then per slot from the
  // last backward_post_attention(l) (MLP, Wo: leaves dO), attention's backward on
  // attention_io(l), backward_pre_attention(l) (RoPE, Q/K/V, norm), then finish_backward
  // (embedding), then reduce_shared_grads. The phases add to state.grads, so passes begun with
  // zero_grads false (two nano-batches) sum their gradients; reduce_shared_grads runs once after
  // the last of them.
  struct AttentionIo {
    T *q, *k, *v, *o;
    float* lse;
    T *d_o, *dq, *dk, *dv;  // the backward's (shared by the layers: one layer's backward at a time)
  };
  Status begin_forward(ModelState<T>& state, const StepTokens& in, const T* x_in = nullptr);
  void forward_pre_attention(ModelState<T>& state, int64_t slot);
  Status forward_post_attention(ModelState<T>& state, int64_t slot);
  double finish_forward(ModelState<T>& state, double loss_scale);
  Status begin_backward(ModelState<T>& state, const T* dx_in = nullptr, bool zero_grads = true);
  Status backward_post_attention(ModelState<T>& state, int64_t slot);
  Status backward_pre_attention(ModelState<T>& state, int64_t slot);
  void finish_backward(ModelState<T>& state);
  // Key/value heads shared by several TP ranks: each rank saw some of their queries, so their
  // projections' gradients are summed over the sharing ranks (nothing without sharing).
  Status reduce_shared_grads(ModelState<T>& state);
  // Called between the GEMMs of the phases (nothing when empty): a rank whose communication
  // moves only inside its own calls (MPI) polls it there while it computes (ping-pong). A slice
  // takes its model's.
  void set_poll(std::function<void()> poll) { poll_ = std::move(poll); }
  // Called when a backward phase has finished its part of a gradient block: begin_backward the
  // head's, backward_post_attention(l) layer l's MLP and Wo, backward_pre_attention(l) its norm
  // and Q/K/V, finish_backward the embedding's (nothing when empty). A slice takes its model's.
  void set_grads_done(std::function<void(GradsDone)> fn) { grads_done_ = std::move(fn); }
  // Seconds this model spent in tensor-parallel all-reduces (communication), accumulated.
  double tp_seconds() const { return tp_seconds_; }
  AttentionIo attention_io(int64_t slot);

  // [n, d] the last forward's input activations of its first layer (a stage without the
  // embedding: its x_in).
  const T* stage_input() const { return layer_acts_.front().x; }
  // [n, d] the last forward's output activations (a stage without the head).
  const T* output() const { return x_final_; }
  // [n, d] the last backward's gradient of the input activations (a stage without the embedding).
  const T* input_grad() const { return dx_; }

  // [n, V] logits of the last forward.
  const T* logits() const { return logits_; }
  int64_t rows() const { return n_; }

 private:
  struct LayerActs {
    T *x, *h1, *rstd1, *q, *k, *v, *o, *x_mid, *h2, *rstd2, *gate, *up, *s;
    float* lse;
  };
  Model(Model& whole, int64_t first_row, int64_t rows);  // slice()
  // Sums a partial [rows, d] over the tensor-parallel group (nothing without one); its seconds
  // count as communication.
  Status tp_reduce(T* data, int64_t count);
  void add_times(PassTimes* times, std::chrono::steady_clock::time_point begin, const AttentionTimes& before,
                 const AttentionBackend<T>& attention, double tp_before) const;
  ModelConfig config_;
  TensorParallel<T> tp_;
  std::function<void()> poll_;
  std::function<void(GradsDone)> grads_done_;
  void grads_done(GradsDone part) const {
    if (grads_done_) grads_done_(part);
  }
  void poll() const {
    if (poll_) poll_();
  }
  double tp_seconds_ = 0;
  int64_t max_tokens_ = 0;
  int64_t first_ = 0, count_ = 0;  // the layers run: [first_, first_ + count_)
  int64_t n_ = 0;
  Arena<T> acts_;
  std::vector<float> lse_;  // [layers][max_tokens, Hq]
  std::vector<LayerActs> layer_acts_;
  T *x_final_, *hf_, *rstdf_, *logits_, *dlogits_, *cos_, *sin_;
  T *dx_, *dh_, *dq_, *dk_, *dv_, *do_, *dgate_, *dup_, *ds_;
  std::vector<int32_t> ids_;  // [2, max_tokens] token ids, then targets
  int32_t *tokens_ = nullptr, *targets_ = nullptr;
  // The state's weight and gradient views, cached for the phases.
  struct Views {
    const ModelState<T>* state = nullptr;
    const T* data = nullptr;
    const T* grad_data = nullptr;
    Weights<T> params, grads;
  };
  const Views& views(ModelState<T>& state);
  Views views_;
};

extern template struct ModelState<float>;
extern template struct ModelState<double>;
extern template class Model<float>;
extern template class Model<double>;

}  // namespace distca::model
