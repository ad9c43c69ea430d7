// AdamW (decoupled weight decay on matrices, none on norm gains) with global-norm gradient
// clipping, over the flat arenas of a ModelState.
#pragma once
#include "distca/model/config.h"
#include "distca/model/model.h"

namespace distca::model {

// The L2 norm of all gradients.
template <typename T>
double gradient_norm(const ModelState<T>& state);

// Clips the gradients to options.clip_norm (when > 0), then takes one AdamW step at
// options.lr_at(state.step) and counts it. Returns the norm before clipping.
template <typename T>
double adamw_step(ModelState<T>& state, const OptimConfig& options);

// Pipeline stages: the sum of squares of the gradients of the blocks in [begin, end) (arena
// elements; a stage owns one contiguous range), and one AdamW step of just those blocks with
// `norm`, the global norm every stage agreed on, for clipping. Counts the step.
template <typename T>
double gradient_square_sum(const ModelState<T>& state, int64_t begin, int64_t end);
template <typename T>
void adamw_step_range(ModelState<T>& state, const OptimConfig& options, int64_t begin, int64_t end, double norm);

}  // namespace distca::model
