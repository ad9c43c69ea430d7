#include "distca/model/attention.h"

#include <chrono>

#include <fmt/format.h>

#include "distca/core/stopwatch.h"
#include "distca/kernels/ref.h"

namespace distca::model {

namespace {
using Clock = SteadyClock;
}  // namespace

template <typename T>
LocalAttention<T>::LocalAttention(const ModelConfig& config, int rank, int threads) : config_(config), rank_(rank) {
  if constexpr (std::is_same_v<T, float>) cpu_ = std::make_unique<kernels::CpuAttention>(kernels::CpuAttentionOptions{.num_threads = threads});
}

template <typename T>
Status LocalAttention<T>::begin_step(const plan::Batch& batch) {
  tasks_.clear();
  rows_ = 0;
  for (const plan::Piece& p : batch.pieces) {
    if (p.rank != rank_) continue;
    if (p.begin != 0 || p.end != batch.doc_lengths[p.doc]) {
      return invalid_argument(fmt::format("document {} is split across ranks; local attention needs whole documents "
                                          "(use the colocated or cad backend)",
                                          p.doc));
    }
    tasks_.push_back({rows_, p.length(), rows_, p.length(), true});
    rows_ += p.length();
  }
  return Status::ok();
}

template <typename T>
Status LocalAttention<T>::forward(int, const T* q, const T* k, const T* v, T* o, float* lse) {
  const auto begin = Clock::now();
  const ModelConfig& c = config_;
  if constexpr (std::is_same_v<T, float>) {
    kernels::AttnFwdParams<float> p;
    p.dims = {rows_, rows_, c.num_q_heads, c.num_kv_heads, c.head_dim};
    p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse, p.tasks = tasks_;
    DISTCA_RETURN_IF_ERROR(cpu_->forward(p));
  } else {
    for (const kernels::AttnTask& t : tasks_) {
      const kernels::ref::DenseDocument doc{t.q_len, c.num_q_heads, c.num_kv_heads, c.head_dim, std::nullopt};
      lse_.resize(static_cast<size_t>(t.q_len * c.num_q_heads));
      kernels::ref::dense_document_forward(doc, q + t.q_offset * c.q_width(), k + t.kv_offset * c.kv_width(),
                                           v + t.kv_offset * c.kv_width(), o + t.q_offset * c.q_width(), lse_.data());
      for (size_t i = 0; i < lse_.size(); ++i) lse[t.q_offset * c.num_q_heads + static_cast<int64_t>(i)] = static_cast<float>(lse_[i]);
    }
  }
  this->times.compute += seconds_since(begin);
  return Status::ok();
}

template <typename T>
Status LocalAttention<T>::backward(int, const T* q, const T* k, const T* v, const T* o, const float* lse, const T* d_o,
                                   T* dq, T* dk, T* dv) {
  const auto begin = Clock::now();
  const ModelConfig& c = config_;
  if constexpr (std::is_same_v<T, float>) {
    kernels::AttnBwdParams<float> p;
    p.dims = {rows_, rows_, c.num_q_heads, c.num_kv_heads, c.head_dim};
    p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse, p.d_o = d_o, p.dq = dq, p.dk = dk, p.dv = dv, p.tasks = tasks_;
    DISTCA_RETURN_IF_ERROR(cpu_->backward(p));
  } else {
    (void)o, (void)lse;
    for (const kernels::AttnTask& t : tasks_) {
      const kernels::ref::DenseDocument doc{t.q_len, c.num_q_heads, c.num_kv_heads, c.head_dim, std::nullopt};
      const int64_t qo = t.q_offset * c.q_width(), ko = t.kv_offset * c.kv_width();
      kernels::ref::dense_document_backward(doc, q + qo, k + ko, v + ko, d_o + qo, dq + qo, dk + ko, dv + ko);
    }
  }
  this->times.compute += seconds_since(begin);
  return Status::ok();
}

template class LocalAttention<float>;
template class LocalAttention<double>;

}  // namespace distca::model
