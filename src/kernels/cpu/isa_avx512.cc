// The block routines built for AVX-512 (this file is compiled with -mavx512f and friends; the
// driver calls it only where the CPU reports AVX-512F, VL, BW and DQ).
#define DISTCA_ISA_NAMESPACE avx512
#define DISTCA_VECTOR_BYTES 64
#define DISTCA_VECTOR_REGISTERS 32
#include "blocks.h"

namespace distca::kernels::cpu_detail {
const BlockRoutines& avx512_routines() {
  static const BlockRoutines r{"avx512", avx512::forward_any, avx512::pack_any, avx512::unit_any,
                               avx512::store_dq_any, avx512::softmax_row};
  return r;
}
}  // namespace distca::kernels::cpu_detail
