// Reference attention: plain loops with double accumulation. This is the specification the fast
// kernels are tested against; it is slow on purpose and never used on a hot path.
#pragma once

#include <cstdint>
#include <optional>

#include "distca/kernels/attention.h"

namespace distca::kernels::ref {

// Over a task list, as AttnFwdParams describes. Validates first. Acc is the accumulator type:
// double is the specification; float runs the same loops at the fast kernels' precision, and its
// error against double is what tests derive their tolerances from.
template <typename T, typename Acc = double>
Status attention_forward(const AttnFwdParams<T>& p);

// The exact gradient of the forward, recomputed from Q, K, V: p.lse is not read, and p.o is read
// only with is_using_given_output, where rowsum(dO * O) takes the O it was handed instead of the
// recomputed one. That is what fast kernels do, and with bf16 storage the rounding of O then
// enters the gradient in both, so they can be compared tightly.
template <typename T, typename Acc = double>
Status attention_backward(const AttnBwdParams<T>& p, bool is_using_given_output = false);

// Dense attention over one whole document of L tokens (causal, positions 0..L-1), with the
// score matrix materialized per head: an independent formulation (the backward uses
// dS = P * (dP - rowsum(P * dP))) against which task decompositions are checked. All double.
struct DenseDocument {
  int64_t length = 0;  // L
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  std::optional<double> scale;
};
// q [L, Hq, D], k/v [L, Hkv, D]; o [L, Hq, D], lse [L, Hq] out.
void dense_document_forward(const DenseDocument& doc, const double* q, const double* k,
                            const double* v, double* o, double* lse);
// d_o [L, Hq, D]; dq [L, Hq, D], dk/dv [L, Hkv, D] out.
void dense_document_backward(const DenseDocument& doc, const double* q, const double* k,
                             const double* v, const double* d_o, double* dq, double* dk,
                             double* dv);

}  // namespace distca::kernels::ref
