// GEMM-based attention: the benchmark's baseline, the way attention is written without a fused
// kernel. For each (task, query head, block of queries) it materializes the scores
// S = scale * Q K^T with OpenBLAS sgemm over the keys the block can see, takes the softmax row by
// row (with the same vectorized exp as the fused kernel) and multiplies O = P V with sgemm.
// Forward only, fp32. Parallel over blocks on its own pool, one BLAS thread per call.
#pragma once

#include <memory>
#include <string>

#include "distca/kernels/attention.h"

namespace distca::kernels {

class GemmAttention {
 public:
  explicit GemmAttention(int num_threads = 0);
  ~GemmAttention();
  GemmAttention(const GemmAttention&) = delete;
  GemmAttention& operator=(const GemmAttention&) = delete;

  Status forward(const AttnFwdParams<float>& p);
  int num_threads() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// OpenBLAS controls, for benchmarks that measure it.
void blas_set_num_threads(int num_threads);
std::string blas_core_name();  // the kernel family OpenBLAS picked for this CPU

}  // namespace distca::kernels
