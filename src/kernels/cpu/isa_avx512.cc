// The block routines built for AVX-512 (this file is compiled with -mavx512f and friends; the
// driver calls it only where the CPU reports AVX-512F, VL, BW and DQ).
#define DISTCA_ISA_NAMESPACE avx512
#define DISTCA_VECTOR_BYTES 64
#define DISTCA_VECTOR_REGISTERS 32
#include "blocks.h"

namespace distca::kernels::cpu_detail {
const BlockRoutines& avx512_routines() { return avx512::routines_named("avx512"); }
}  // namespace distca::kernels::cpu_detail
