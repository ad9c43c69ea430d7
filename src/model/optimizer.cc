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
double adamw_step(ModelState<T>& state, const OptimConfig& o) {
  const double norm = gradient_norm(state);
  const double clip = o.clip_norm > 0 && norm > o.clip_norm ? o.clip_norm / norm : 1.0;
  const double lr = o.lr_at(state.step);
  const double t = static_cast<double>(state.step + 1);
  const double c1 = 1.0 - std::pow(o.beta1, t), c2 = 1.0 - std::pow(o.beta2, t);
  for (const auto& b : state.params.blocks()) {
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
  return norm;
}

template double gradient_norm(const ModelState<float>&);
template double gradient_norm(const ModelState<double>&);
template double adamw_step(ModelState<float>&, const OptimConfig&);
template double adamw_step(ModelState<double>&, const OptimConfig&);

}  // namespace distca::model
