// OpenBLAS chooses its kernel family (its "core") once, when the library is loaded, before
// main(): from OPENBLAS_CORETYPE if set, else from its own CPU detection, which some versions
// get wrong on AVX-512 CPUs (they fall back to the AVX2 Haswell/Zen kernels, half the sgemm
// speed). The benchmarks' sgemm ceiling and the model's linear layers run on that core, so the
// program settles it before anything else runs.
#pragma once

#include <string>

namespace distca::kernels {

// Call as the first statement of main(). On a CPU with AVX-512 where OPENBLAS_CORETYPE is
// unset, sets it to SkylakeX and re-executes this binary (/proc/self/exe) with the same
// arguments, once (a marker variable stops a second round), so that OpenBLAS loads with its
// AVX-512 kernels. A variable the user set is left alone (blas_check() reports a wrong one).
// Under mpirun each rank re-executes itself before MPI starts; its process id stays the same.
// Returns when there is nothing to do, or when the re-exec failed (OpenBLAS keeps its own choice).
void prepare_blas(char** argv);

// The OpenBLAS core in use against what this CPU can run.
struct BlasCheck {
  std::string core;      // openblas_get_corename(): "SkylakeX", "Haswell", ...
  std::string cpu_isa;   // the CPU's widest vector unit: "AVX-512", "AVX2", or "" (not judged)
  std::string coretype;  // OPENBLAS_CORETYPE as this process saw it ("" when unset)
  bool is_set_by_distca = false;  // prepare_blas set OPENBLAS_CORETYPE
  bool is_trusted = true;         // the core uses the CPU's widest vector unit
  std::string warning;            // one line when not trusted, else ""
};
BlasCheck blas_check();

}  // namespace distca::kernels
