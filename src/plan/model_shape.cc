#include "distca/plan/model_shape.h"

#include <fmt/format.h>

#include "distca/core/json.h"

namespace distca::plan {

Status ModelShape::validate() const {
  const std::string name = text_excerpt(this->name);  // a name read from a file may be huge
  if (num_layers <= 0 || hidden <= 0 || num_q_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 ||
      ffn_hidden <= 0 || dtype_bytes <= 0 || tp <= 0) {
    return invalid_argument(fmt::format(
        "model '{}': layers, hidden, heads, kv heads, head dim, ffn, dtype bytes and tp must all "
        "be positive (got {}, {}, {}, {}, {}, {}, {}, {})",
        name, num_layers, hidden, num_q_heads, num_kv_heads, head_dim, ffn_hidden, dtype_bytes, tp));
  }
  if (num_q_heads % num_kv_heads != 0) {
    return invalid_argument(fmt::format("model '{}': {} query heads is not a multiple of {} kv heads",
                                        name, num_q_heads, num_kv_heads));
  }
  if (num_q_heads % tp != 0) {
    return invalid_argument(
        fmt::format("model '{}': tp {} does not divide {} query heads", name, tp, num_q_heads));
  }
  if (num_kv_heads % tp != 0 && tp % num_kv_heads != 0) {
    return invalid_argument(fmt::format(
        "model '{}': tp {} and {} kv heads: one must divide the other", name, tp, num_kv_heads));
  }
  if (grad_return != GradReturn::kFp32 && grad_return != GradReturn::kBf16) {
    return invalid_argument(fmt::format("model '{}': grad_return {} is neither fp32 nor bf16", name,
                                        static_cast<int>(grad_return)));
  }
  return Status::ok();
}

const char* grad_return_name(GradReturn g) { return g == GradReturn::kBf16 ? "bf16" : "fp32"; }

Result<GradReturn> parse_grad_return(std::string_view text) {
  if (text == "fp32") return GradReturn::kFp32;
  if (text == "bf16") return GradReturn::kBf16;
  return invalid_argument(fmt::format("--grad-return must be bf16 or fp32, got '{}' (the dtype of the dK/dV partial "
                                      "sums on the backward return)",
                                      text_excerpt(text)));
}

Result<ModelShape> model_preset(std::string_view name) {
  if (name == "llama-8b") {
    return ModelShape{"llama-8b", 32, 4096, 32, 8, 128, 14336, 2, 1};
  }
  if (name == "llama-34b") {
    return ModelShape{"llama-34b", 48, 8192, 64, 16, 128, 22016, 2, 1};
  }
  return not_found(fmt::format("unknown model preset '{}' (expected llama-8b or llama-34b)", name));
}

std::vector<std::string> model_preset_names() { return {"llama-8b", "llama-34b"}; }

}  // namespace distca::plan
