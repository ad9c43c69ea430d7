#include "distca/model/optimizer.h"

#include <cmath>

namespace distca::model {

template <typename T>
double gradient_norm(const ModelState<T>& state) {
  double ss = 0;
  const T* g = state.grads.data();
  for (int64_t i = 0; i < state.grads.size(); ++i) ss += static_cast<double>(g[i]) * g[i];
  return std::sqrt(ss);
}

template <typename T>
double gradient_square_sum(const ModelState<T>& state, int64_t begin, int64_t end) {
  double ss = 0;
  const T* g = state.grads.data();
  for (int64_t i = begin; i < end; ++i) ss += static_cast<double>(g[i]) * g[i];
  return ss;
}

template <typename T>
double adamw_step(ModelState<T>& state, const OptimConfig& o) {
  const double norm = gradient_norm(state);
  adamw_step_range(state, o, 0, state.params.size(), norm);
  return norm;
}

template <typename T>
void adamw_step_range(ModelState<T>& state, const OptimConfig& o, int64_t begin, int64_t end, double norm) {
  const double clip = o.clip_norm > 0 && norm > o.clip_norm ? o.clip_norm / norm : 1.0;
  const double lr = o.lr_at(state.step);
  const double t = static_cast<double>(state.step + 1);
  const double c1 = 1.0 - std::pow(o.beta1, t), c2 = 1.0 - std::pow(o.beta2, t);
  for (const auto& b : state.params.blocks()) {
    if (b.offset < begin || b.offset + b.count > end) continue;
    const double decay = ModelState<T>::is_decayed(b.name) ? o.weight_decay : 0.0;
    T* p = state.params.at(b.offset);
    const T* g = state.grads.at(b.offset);
    T* m = state.m.at(b.offset);
    T* v = state.v.at(b.offset);
    for (int64_t i = 0; i < b.count; ++i) {
      const double gi = static_cast<double>(g[i]) * clip;
      const double mi = o.beta1 * m[i] + (1 - o.beta1) * gi;
      const double vi = o.beta2 * v[i] + (1 - o.beta2) * gi * gi;
      m[i] = static_cast<T>(mi);
      v[i] = static_cast<T>(vi);
      const double update = (mi / c1) / (std::sqrt(vi / c2) + o.eps) + decay * static_cast<double>(p[i]);
      p[i] = static_cast<T>(static_cast<double>(p[i]) - lr * update);
    }
  }
  ++state.step;
}

template double gradient_norm(const ModelState<float>&);
template double gradient_norm(const ModelState<double>&);
template double adamw_step(ModelState<float>&, const OptimConfig&);
template double adamw_step(ModelState<double>&, const OptimConfig&);
template double gradient_square_sum(const ModelState<float>&, int64_t, int64_t);
template double gradient_square_sum(const ModelState<double>&, int64_t, int64_t);
template void adamw_step_range(ModelState<float>&, const OptimConfig&, int64_t, int64_t, double);
template void adamw_step_range(ModelState<double>&, const OptimConfig&, int64_t, int64_t, double);

}  // namespace distca::model
