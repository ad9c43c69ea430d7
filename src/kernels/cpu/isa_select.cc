// Which build of the block routines runs: the builds compiled in (per architecture), the ones
// this CPU runs, and DISTCA_CPU_ISA, the one environment knob that forces a build (for tests and
// benchmarks: every build the machine runs is tested against the reference).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <span>

#include "distca/core/knobs.h"
#include "distca/kernels/cpu.h"
#include "isa.h"

namespace distca::kernels {

namespace {

struct Build {
  const char* name;
  const cpu_detail::BlockRoutines& (*routines)();
  bool (*cpu_runs)();
};

bool always() { return true; }

#if defined(__x86_64__)
// The AVX-512 build is compiled with -mavx512f -mavx512vl -mavx512bw -mavx512dq (and FMA, AVX2).
bool cpu_runs_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool cpu_runs_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
// Fastest first.
constexpr Build kBuilds[] = {{"avx512", cpu_detail::avx512_routines, cpu_runs_avx512},
                             {"avx2", cpu_detail::avx2_routines, cpu_runs_avx2},
                             {"portable", cpu_detail::portable_routines, always}};
#else
constexpr Build kBuilds[] = {{"portable", cpu_detail::portable_routines, always}};
#endif

const Build* find_build(std::string_view isa) {
  for (const Build& b : kBuilds) {
    if (isa == b.name) return &b;
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> cpu_isas_built() {
  std::vector<std::string> names;
  for (const Build& b : kBuilds) names.emplace_back(b.name);
  return names;
}

std::vector<std::string> cpu_isas_supported() {
  std::vector<std::string> names;
  for (const Build& b : kBuilds) {
    if (b.cpu_runs()) names.emplace_back(b.name);
  }
  return names;
}

Status check_cpu_isa(std::string_view isa) {
  if (isa.empty() || isa == "auto") return Status::ok();
  const Build* b = find_build(isa);
  if (b == nullptr) {
    return invalid_argument(fmt::format(
        "no '{}' build of the CPU attention kernels: this build has {} (or auto: the fastest this CPU runs)", isa,
        fmt::join(cpu_isas_built(), ", ")));
  }
  if (!b->cpu_runs()) {
    return invalid_argument(fmt::format("this CPU cannot run the '{}' build of the CPU attention kernels; it runs {}",
                                        isa, fmt::join(cpu_isas_supported(), ", ")));
  }
  return Status::ok();
}

Result<std::string> resolve_cpu_isa(std::string_view isa) {
  std::string want(isa);
  bool from_env = false;
  if (want.empty()) {
    const char* env = knob(kCpuIsaEnv);
    if (env != nullptr && *env != '\0') {
      want = env;
      from_env = true;
    }
  }
  if (want.empty() || want == "auto") return cpu_isas_supported().front();
  const Status st = check_cpu_isa(want);
  if (!st.is_ok()) {
    return from_env ? invalid_argument(fmt::format("{}={}: {}; unset it for the fastest", kCpuIsaEnv, want, st.message()))
                    : st;
  }
  return want;
}

namespace cpu_detail {

const BlockRoutines& routines_for(const std::string& isa) {
  const Build* b = find_build(isa);
  DISTCA_CHECK(b != nullptr && b->cpu_runs()) << "CPU attention build '" << isa << "' is not built or not runnable here";
  return b->routines();
}

const BlockRoutines& default_routines() {
  const Result<std::string> isa = resolve_cpu_isa("");
  DISTCA_CHECK(isa.is_ok()) << isa.status().message();
  return routines_for(isa.value());
}

}  // namespace cpu_detail
}  // namespace distca::kernels
