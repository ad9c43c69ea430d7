#include "distca/model/config.h"

#include <cmath>

#include <fmt/format.h>

namespace distca::model {

Status ModelConfig::validate() const {
  auto positive = [](const char* what, int64_t v, int64_t max) -> Status {
    if (v < 1 || v > max) return invalid_argument(fmt::format("{} must be 1..{}, got {}", what, max, v));
    return Status::ok();
  };
  DISTCA_RETURN_IF_ERROR(positive("vocab size", vocab_size, 1 << 20));
  DISTCA_RETURN_IF_ERROR(positive("d_model", d_model, 1 << 16));
  DISTCA_RETURN_IF_ERROR(positive("layers", num_layers, 1024));
  DISTCA_RETURN_IF_ERROR(positive("query heads", num_q_heads, 1024));
  DISTCA_RETURN_IF_ERROR(positive("key/value heads", num_kv_heads, 1024));
  DISTCA_RETURN_IF_ERROR(positive("head dim", head_dim, 1024));
  DISTCA_RETURN_IF_ERROR(positive("ffn dim", ffn_dim, 1 << 18));
  if (num_q_heads % num_kv_heads != 0) {
    return invalid_argument(fmt::format("query heads ({}) must be a multiple of key/value heads ({})", num_q_heads, num_kv_heads));
  }
  if (head_dim % 2 != 0) return invalid_argument(fmt::format("head dim must be even for RoPE, got {}", head_dim));
  if (!(rope_base > 1) || !std::isfinite(rope_base)) return invalid_argument("rope base must be > 1");
  if (!(norm_eps > 0) || norm_eps > 1) return invalid_argument("norm eps must be in (0, 1]");
  if (!(init_std > 0) || init_std > 1) return invalid_argument("init std must be in (0, 1]");
  return Status::ok();
}

int64_t ModelConfig::num_parameters() const {
  const int64_t layer = 2 * d_model + d_model * (q_width() + 2 * kv_width()) + q_width() * d_model + 3 * d_model * ffn_dim;
  return 2 * vocab_size * d_model + num_layers * layer + d_model;
}

Status OptimConfig::validate() const {
  if (!(lr > 0) || lr > 1) return invalid_argument(fmt::format("--lr must be in (0, 1], got {}", lr));
  if (warmup_steps < 0) return invalid_argument("warm-up steps must be >= 0");
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1)) return invalid_argument("AdamW betas must be in [0, 1)");
  if (!(eps > 0)) return invalid_argument("AdamW eps must be > 0");
  if (!(weight_decay >= 0) || weight_decay > 1) return invalid_argument("weight decay must be in [0, 1]");
  if (!(clip_norm >= 0) || !std::isfinite(clip_norm)) return invalid_argument("clip norm must be >= 0 (0: off)");
  return Status::ok();
}

double OptimConfig::lr_at(int64_t step) const {
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  return lr;
}

std::vector<std::string> preset_names() { return {"tiny", "demo"}; }

Result<Preset> find_preset(const std::string& name) {
  Preset p;
  p.name = name;
  if (name == "tiny") {
    p.description = "2 layers, d 64, 2/1 heads of 32, 256 tokens per rank: seconds; the tests' model";
    p.model = ModelConfig{};
    p.context = 256;
    p.steps = 20;
    p.workload = "pretrain";
    return p;
  }
  if (name == "demo") {
    p.description = "2 layers, d 256, 4/1 heads of 64, 6144 tokens per rank, every other rank holding one "
                    "whole long document per step: attention dominates and colocated ranks straggle";
    p.model.d_model = 256;
    p.model.num_layers = 2;
    p.model.num_q_heads = 4;
    p.model.num_kv_heads = 1;
    p.model.head_dim = 64;
    p.model.ffn_dim = 512;
    p.context = 6144;
    p.steps = 30;
    p.workload = "skewed";
    return p;
  }
  return not_found(fmt::format("no preset '{}' (known: tiny, demo)", name));
}

nlohmann::json to_json(const ModelConfig& c) {
  return {{"vocab_size", c.vocab_size}, {"d_model", c.d_model},       {"num_layers", c.num_layers},
          {"num_q_heads", c.num_q_heads}, {"num_kv_heads", c.num_kv_heads}, {"head_dim", c.head_dim},
          {"ffn_dim", c.ffn_dim},       {"rope_base", c.rope_base},   {"norm_eps", c.norm_eps},
          {"init_std", c.init_std},     {"init_seed", c.init_seed},   {"parameters", c.num_parameters()}};
}

nlohmann::json to_json(const OptimConfig& c) {
  return {{"lr", c.lr},       {"warmup_steps", c.warmup_steps}, {"beta1", c.beta1},
          {"beta2", c.beta2}, {"eps", c.eps},                   {"weight_decay", c.weight_decay},
          {"clip_norm", c.clip_norm}};
}

Result<ModelConfig> model_config_from_json(const nlohmann::json& j) {
  ModelConfig c;
  try {
    c.vocab_size = j.at("vocab_size").get<int64_t>();
    c.d_model = j.at("d_model").get<int64_t>();
    c.num_layers = j.at("num_layers").get<int64_t>();
    c.num_q_heads = j.at("num_q_heads").get<int64_t>();
    c.num_kv_heads = j.at("num_kv_heads").get<int64_t>();
    c.head_dim = j.at("head_dim").get<int64_t>();
    c.ffn_dim = j.at("ffn_dim").get<int64_t>();
    c.rope_base = j.at("rope_base").get<double>();
    c.norm_eps = j.at("norm_eps").get<double>();
    c.init_std = j.at("init_std").get<double>();
    c.init_seed = j.at("init_seed").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(fmt::format("model config: {}", e.what()));
  }
  DISTCA_RETURN_IF_ERROR(c.validate());
  return c;
}

}  // namespace distca::model
