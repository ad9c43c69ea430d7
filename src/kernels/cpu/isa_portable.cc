// The block routines built for the compiler's baseline instruction set: any x86-64 (or other)
// CPU runs them.
#define DISTCA_ISA_NAMESPACE portable
#include "blocks.h"

namespace distca::kernels::cpu_detail {
const BlockRoutines& portable_routines() {
  static const BlockRoutines r{"portable", portable::forward_any, portable::pack_any,
                               portable::unit_any, portable::store_dq_any, portable::softmax_row};
  return r;
}
const BlockRoutines& best_routines(bool is_portable) {
  return !is_portable && __builtin_cpu_supports("avx512f") ? avx512_routines() : portable_routines();
}
bool supports_head_dim(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
}  // namespace distca::kernels::cpu_detail
