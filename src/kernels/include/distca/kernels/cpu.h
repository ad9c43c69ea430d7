// CpuAttention: the attention server's compute on the CPU. Flash-style (tiled, online softmax)
// forward and backward over a task list, vectorized (one source built for AVX-512, for AVX2 with
// FMA, and for the baseline instruction set: SSE2 on x86-64, NEON on aarch64; the fastest the CPU
// runs is chosen at run time) and multi-threaded over (task, head, query block) in the
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

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "distca/kernels/attention.h"

namespace distca::kernels {

// The environment variable that forces a build of the block routines where
// CpuAttentionOptions::isa is empty (tests and benchmarks run every build the CPU runs).
inline constexpr const char* kCpuIsaEnv = "DISTCA_CPU_ISA";

// The builds of the block routines compiled in, fastest first: "avx512", "avx2", "portable" on
// x86-64; "portable" (NEON) on aarch64.
std::vector<std::string> cpu_isas_built();
// The ones this CPU runs, fastest first ("portable" always).
std::vector<std::string> cpu_isas_supported();
// Ok for "", "auto" and a build this CPU runs; else a message naming the choices.
Status check_cpu_isa(std::string_view isa);
// The build an isa option names: "" takes DISTCA_CPU_ISA where set; "" or "auto" then the fastest
// this CPU runs. An error says what was wrong (a bad DISTCA_CPU_ISA named as such).
Result<std::string> resolve_cpu_isa(std::string_view isa);

struct CpuAttentionOptions {
  int num_threads = 0;  // <= 0: one per hardware thread
  // The build of the block routines: "" (DISTCA_CPU_ISA, else the fastest this CPU runs), "auto",
  // or one of cpu_isas_supported(). REQUIRES: resolve_cpu_isa(isa) is ok (callers check input).
  std::string isa = {};
  // Called by the calling thread between work items and inside the backward's long ones, at most
  // every `poll_interval` (none when empty): a caller whose communication moves only inside its
  // own calls (MPI) keeps it moving while the kernel computes (ping-pong,
  // runtime::DispatchOptions::poll). Results do not depend on it.
  std::function<void()> poll = {};
  std::chrono::microseconds poll_interval{200};
};

class CpuAttention {
 public:
  explicit CpuAttention(CpuAttentionOptions options = {});
  ~CpuAttention();
  CpuAttention(const CpuAttention&) = delete;
  CpuAttention& operator=(const CpuAttention&) = delete;

  // The head dims of the registry's "cpu" entry (registry.h) are built; others are rejected with
  // a message.
  template <typename T>
  Status forward(const AttnFwdParams<T>& p);
  template <typename T>
  Status backward(const AttnBwdParams<T>& p);

  int num_threads() const;
  // "avx512", "avx2" or "portable": the build of the block routines this object runs.
  std::string isa() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace distca::kernels
