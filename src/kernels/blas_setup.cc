#include "distca/kernels/blas_setup.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "distca/core/knobs.h"
#include "distca/kernels/gemm_attention.h"

namespace distca::kernels {

namespace {

constexpr const char* kCoretype = "OPENBLAS_CORETYPE";
constexpr const char* kMarker = "DISTCA_BLAS_REEXEC";  // set before the re-exec: never twice
constexpr const char* kAvx512Core = "SkylakeX";

std::string cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "AVX-512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "AVX2";
  return "";
}

// The vector unit an OpenBLAS x86-64 core's kernels use: "AVX-512", "AVX2", or "" (older).
std::string core_isa(std::string core) {
  core.erase(std::remove_if(core.begin(), core.end(), [](unsigned char c) { return !std::isalnum(c); }), core.end());
  std::transform(core.begin(), core.end(), core.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* name : {"skylakex", "cooperlake", "sapphirerapids"}) {
    if (core == name) return "AVX-512";
  }
  for (const char* name : {"haswell", "zen"}) {
    if (core == name) return "AVX2";
  }
  return "";
}

int rank_of(const std::string& isa) { return isa == "AVX-512" ? 2 : (isa == "AVX2" ? 1 : 0); }

}  // namespace

void prepare_blas(char** argv) {
  if (std::getenv(kCoretype) != nullptr || knob(kMarker) != nullptr) return;
  if (cpu_isa() != "AVX-512") return;
  setenv(kCoretype, kAvx512Core, 1);
  setenv(kMarker, "1", 1);
  execv("/proc/self/exe", argv);
  // Still here: the exec failed and OpenBLAS keeps the core it loaded with; say nothing was set.
  unsetenv(kCoretype);
}

BlasCheck blas_check() {
  BlasCheck c;
  c.core = blas_core_name();
  c.cpu_isa = cpu_isa();
  const char* coretype = std::getenv(kCoretype);
  c.coretype = coretype != nullptr ? coretype : "";
  c.is_set_by_distca = knob(kMarker) != nullptr && c.coretype == kAvx512Core;
  c.is_trusted = rank_of(core_isa(c.core)) >= rank_of(c.cpu_isa);
  if (!c.is_trusted) {
    const std::string fix = c.cpu_isa == "AVX-512"
                                ? fmt::format("unset OPENBLAS_CORETYPE (distca then sets {0}) or set it to {0}", kAvx512Core)
                                : std::string("unset OPENBLAS_CORETYPE so that OpenBLAS detects the CPU");
    c.warning = fmt::format("WARNING: OpenBLAS runs its {} kernels{} on this {} CPU: its sgemm (the ceiling, the GEMM "
                            "baselines, the linear layers) is not this machine's; {}",
                            c.core, c.coretype.empty() ? "" : fmt::format(" (OPENBLAS_CORETYPE={})", c.coretype),
                            c.cpu_isa, fix);
  }
  return c;
}

}  // namespace distca::kernels
