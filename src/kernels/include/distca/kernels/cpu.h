// CpuAttention: the attention server's compute on the CPU. Flash-style (tiled, online softmax)
// forward and backward over a task list, vectorized (AVX-512 where the CPU has it, a portable
// build of the same code elsewhere) and multi-threaded over (task, head, query block) in the
// forward and dQ pass, and over (KV head, KV row block) in the dK/dV pass.
//
// Results are bit-identical for any thread count: every output element is computed by one work
// item whose arithmetic and summation order depend only on the inputs. dK/dV of a row shared by
// several tasks are summed in fp32 in task order.
//
// Memory: the workspace grows to the largest problem seen and is reused; a call on a problem no
// larger than an earlier one allocates nothing.
// Thread safety: one call at a time per object.
#pragma once

#include <memory>
#include <string>

#include "distca/kernels/attention.h"

namespace distca::kernels {

struct CpuAttentionOptions {
  int num_threads = 0;        // <= 0: one per hardware thread
  bool is_portable = false;   // force the portable build even where AVX-512 is available
};

class CpuAttention {
 public:
  explicit CpuAttention(CpuAttentionOptions options = {});
  ~CpuAttention();
  CpuAttention(const CpuAttention&) = delete;
  CpuAttention& operator=(const CpuAttention&) = delete;

  // Head dims 32, 64, 128, 256 are built; others are rejected with a message.
  template <typename T>
  Status forward(const AttnFwdParams<T>& p);
  template <typename T>
  Status backward(const AttnBwdParams<T>& p);

  int num_threads() const;
  // "avx512" or "portable": the build of the block routines this object runs.
  std::string isa() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace distca::kernels
