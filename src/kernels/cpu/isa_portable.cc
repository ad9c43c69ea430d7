// The block routines built for the compiler's baseline instruction set, which every CPU of the
// architecture runs: 4-lane vectors, SSE2's 16 registers on x86-64, NEON's 32 on aarch64 (where
// this is the only build, and NEON has FMA).
#define DISTCA_ISA_NAMESPACE portable
#define DISTCA_VECTOR_BYTES 16
#if defined(__aarch64__)
#define DISTCA_VECTOR_REGISTERS 32
#else
#define DISTCA_VECTOR_REGISTERS 16
#endif
#include "blocks.h"

namespace distca::kernels::cpu_detail {
const BlockRoutines& portable_routines() { return portable::routines_named("portable"); }
}  // namespace distca::kernels::cpu_detail
