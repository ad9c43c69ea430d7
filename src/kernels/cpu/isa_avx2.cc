// The block routines built for AVX2 with FMA (this file is compiled with -mavx2 -mfma; the driver
// calls it only where the CPU reports both): 8-lane vectors, 16 registers, so the tiles of
// blocks.h are sized for 16 (a quarter of a block's queries at a time).
#define DISTCA_ISA_NAMESPACE avx2
#define DISTCA_VECTOR_BYTES 32
#define DISTCA_VECTOR_REGISTERS 16
#include "blocks.h"

namespace distca::kernels::cpu_detail {
const BlockRoutines& avx2_routines() { return avx2::routines_named("avx2"); }
}  // namespace distca::kernels::cpu_detail
