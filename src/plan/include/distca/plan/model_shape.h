// Model shape: the numbers the cost model and the byte counter need (docs/design.md §6).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "distca/core/status.h"

namespace distca::plan {

// The dtype dK/dV partial sums travel in on the backward return; the owner sums them in fp32
// either way. bf16 (the paper's) halves those bytes at the cost of one rounding of each partial
// that crosses ranks (round to nearest, ties to even); fp32 returns them exactly.
enum class GradReturn { kFp32 = 0, kBf16 = 1 };
const char* grad_return_name(GradReturn g);  // "fp32" or "bf16"
// "fp32" or "bf16" (what --grad-return takes); anything else is an error that says so.
Result<GradReturn> parse_grad_return(std::string_view text);
// Bytes of one returned dK/dV element.
inline int grad_return_bytes(GradReturn g) { return g == GradReturn::kBf16 ? 2 : 4; }

struct ModelShape {
  std::string name = "custom";
  int num_layers = 0;
  int hidden = 0;
  int num_q_heads = 0;   // Hq
  int num_kv_heads = 0;  // Hkv; Hq is a multiple of Hkv (GQA)
  int head_dim = 0;      // D
  int ffn_hidden = 0;
  int dtype_bytes = 2;   // bytes of one activation element (bf16)
  int tp = 1;            // tensor-parallel degree: each rank holds Hq/tp query heads
  GradReturn grad_return = GradReturn::kFp32;  // dK/dV on the backward return (the runtime's default)

  // Every field positive, Hq % Hkv == 0, Hq % tp == 0, tp divides Hkv or Hkv divides tp, and
  // grad_return one of the enum's values.
  Status validate() const;
  int q_heads_per_rank() const { return num_q_heads / tp; }
  // KV heads are replicated when tp > Hkv, so a rank holds at least one.
  int kv_heads_per_rank() const { return num_kv_heads >= tp ? num_kv_heads / tp : 1; }
};

// "llama-8b" or "llama-34b".
Result<ModelShape> model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

}  // namespace distca::plan
