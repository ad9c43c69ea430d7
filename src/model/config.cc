#include "distca/model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <set>

#include <fmt/format.h>

#include "distca/core/json.h"

namespace distca::model {

namespace {

// Reads the fields of one JSON object with their types, remembering which it read, so that a
// field of the wrong type or an unknown one is refused with a message naming it.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& j, std::string what) : j_(j), what_(std::move(what)) {}
  Status object() const {
    if (!j_.is_object()) return invalid_argument(fmt::format("{}: expected a JSON object, got {}", what_, json_excerpt(j_)));
    return Status::ok();
  }
  // Integers must be JSON integers (1.5 is refused, not rounded). A missing optional field
  // leaves `out` as it is.
  Status integer(const char* key, int64_t& out, bool required = true) {
    if (!present(key)) return missing(key, required);
    const nlohmann::json& v = j_[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX)) {
      return invalid_argument(fmt::format("{}: field \"{}\" must be an integer, got {}", what_, key, json_excerpt(v)));
    }
    out = v.get<int64_t>();
    return Status::ok();
  }
  Status unsigned_integer(const char* key, uint64_t& out) {
    if (!present(key)) return missing(key, true);
    const nlohmann::json& v = j_[key];
    if (!v.is_number_unsigned()) {
      return invalid_argument(fmt::format("{}: field \"{}\" must be an integer >= 0, got {}", what_, key, json_excerpt(v)));
    }
    out = v.get<uint64_t>();
    return Status::ok();
  }
  Status number(const char* key, double& out, bool required = true) {
    if (!present(key)) return missing(key, required);
    const nlohmann::json& v = j_[key];
    if (!v.is_number()) return invalid_argument(fmt::format("{}: field \"{}\" must be a number, got {}", what_, key, json_excerpt(v)));
    out = v.get<double>();
    return Status::ok();
  }
  Status string(const char* key, std::string& out, bool required = true) {
    if (!present(key)) return missing(key, required);
    const nlohmann::json& v = j_[key];
    if (!v.is_string()) return invalid_argument(fmt::format("{}: field \"{}\" must be a string, got {}", what_, key, json_excerpt(v)));
    out = v.get<std::string>();
    return Status::ok();
  }
  // Refuses every field no call above asked for.
  Status no_other_fields() const {
    for (const auto& [key, value] : j_.items()) {
      if (!read_.contains(key)) return invalid_argument(fmt::format("{}: unknown field \"{}\"", what_, key));
    }
    return Status::ok();
  }

 private:
  // Whether the field is there; either way it counts as read.
  bool present(const char* key) {
    read_.insert(key);
    return j_.contains(key);
  }
  Status missing(const char* key, bool required) const {
    if (!required) return Status::ok();
    return invalid_argument(fmt::format("{}: missing field \"{}\"", what_, key));
  }
  const nlohmann::json& j_;
  std::string what_;
  std::set<std::string> read_;
};

}  // namespace

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

Result<ModelConfig> tensor_parallel_shard(const ModelConfig& c, int tp) {
  DISTCA_RETURN_IF_ERROR(c.validate());
  if (tp < 1 || tp > 1024) return invalid_argument(fmt::format("--tp must be 1..1024, got {}", tp));
  const std::pair<const char*, int64_t> split[] = {{"query heads", c.num_q_heads}, {"ffn dim", c.ffn_dim}};
  for (const auto& [what, value] : split) {
    if (value % tp != 0) {
      return invalid_argument(fmt::format("--tp {} must divide the model's {} ({}): each tensor-parallel rank takes an "
                                          "equal slice; change --tp or the model",
                                          tp, what, value));
    }
  }
  if (c.num_kv_heads % tp != 0 && tp % c.num_kv_heads != 0) {
    return invalid_argument(fmt::format("--tp {} and the model's {} key/value heads: one must divide the other (a rank "
                                        "takes a slice of them, or tp / heads ranks share one); change --tp or the model",
                                        tp, c.num_kv_heads));
  }
  ModelConfig s = c;
  s.num_q_heads /= tp;
  s.num_kv_heads = std::max<int64_t>(c.num_kv_heads / tp, 1);
  s.ffn_dim /= tp;
  return s;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t layer = 2 * d_model + d_model * (q_width() + 2 * kv_width()) + q_width() * d_model + 3 * d_model * ffn_dim;
  return 2 * vocab_size * d_model + num_layers * layer + d_model;
}

Status OptimConfig::validate() const {
  if (!(lr > 0) || lr > 1) return invalid_argument(fmt::format("--lr must be in (0, 1], got {}", lr));
  if (warmup_steps < 0) return invalid_argument("warm-up steps must be >= 0");
  if (schedule != "constant" && schedule != "cosine" && schedule != "linear") {
    return invalid_argument(fmt::format("--lr-schedule must be constant, cosine or linear, got '{}'", schedule));
  }
  if (min_lr && (!(*min_lr >= 0) || *min_lr > lr)) {
    return invalid_argument(fmt::format("--min-lr must be in [0, lr = {}], got {}", lr, *min_lr));
  }
  if (total_steps < 0) return invalid_argument(fmt::format("total steps must be >= 0, got {}", total_steps));
  if (schedule != "constant") {
    if (total_steps < 1) {
      return invalid_argument(fmt::format("the {} schedule decays to the floor at the last step: it needs the total "
                                          "steps (>= 1), got {}",
                                          schedule, total_steps));
    }
    if (warmup_steps >= total_steps) {
      return invalid_argument(fmt::format("the {} schedule needs the warm-up ({} steps) to end before the last step "
                                          "(of {}): lower the warm-up or train more steps",
                                          schedule, warmup_steps, total_steps));
    }
  }
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1)) return invalid_argument("AdamW betas must be in [0, 1)");
  if (!(eps > 0)) return invalid_argument("AdamW eps must be > 0");
  if (!(weight_decay >= 0) || weight_decay > 1) return invalid_argument("weight decay must be in [0, 1]");
  if (!(clip_norm >= 0) || !std::isfinite(clip_norm)) return invalid_argument("clip norm must be >= 0 (0: off)");
  return Status::ok();
}

double OptimConfig::lr_at(int64_t step) const {
  step = std::max<int64_t>(step, 0);
  if (step < warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (schedule == "constant") return lr;
  const double floor = floor_lr();
  const int64_t last = total_steps - 1;
  if (step >= last) return floor;
  // validate() keeps the warm-up before the last step, so the decay spans at least one step.
  const int64_t peak = std::max<int64_t>(warmup_steps - 1, 0);
  const double x = static_cast<double>(step - peak) / static_cast<double>(last - peak);
  if (schedule == "cosine") return floor + (lr - floor) * 0.5 * (1.0 + std::cos(std::numbers::pi * x));
  return lr - (lr - floor) * x;
}

std::vector<std::string> lr_schedules() { return {"constant", "cosine", "linear"}; }

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
  return {{"lr", c.lr},
          {"warmup_steps", c.warmup_steps},
          {"schedule", c.schedule},
          {"min_lr", c.floor_lr()},
          {"total_steps", c.total_steps},
          {"beta1", c.beta1},
          {"beta2", c.beta2},
          {"eps", c.eps},
          {"weight_decay", c.weight_decay},
          {"clip_norm", c.clip_norm}};
}

Result<ModelConfig> model_config_from_json(const nlohmann::json& j) {
  ModelConfig c;
  FieldReader r(j, "model config");
  DISTCA_RETURN_IF_ERROR(r.object());
  DISTCA_RETURN_IF_ERROR(r.integer("vocab_size", c.vocab_size));
  DISTCA_RETURN_IF_ERROR(r.integer("d_model", c.d_model));
  DISTCA_RETURN_IF_ERROR(r.integer("num_layers", c.num_layers));
  DISTCA_RETURN_IF_ERROR(r.integer("num_q_heads", c.num_q_heads));
  DISTCA_RETURN_IF_ERROR(r.integer("num_kv_heads", c.num_kv_heads));
  DISTCA_RETURN_IF_ERROR(r.integer("head_dim", c.head_dim));
  DISTCA_RETURN_IF_ERROR(r.integer("ffn_dim", c.ffn_dim));
  DISTCA_RETURN_IF_ERROR(r.number("rope_base", c.rope_base));
  DISTCA_RETURN_IF_ERROR(r.number("norm_eps", c.norm_eps));
  DISTCA_RETURN_IF_ERROR(r.number("init_std", c.init_std));
  DISTCA_RETURN_IF_ERROR(r.unsigned_integer("init_seed", c.init_seed));
  int64_t parameters = -1;
  DISTCA_RETURN_IF_ERROR(r.integer("parameters", parameters, /*required=*/false));
  DISTCA_RETURN_IF_ERROR(r.no_other_fields());
  DISTCA_RETURN_IF_ERROR(c.validate());
  if (parameters != -1 && parameters != c.num_parameters()) {
    return invalid_argument(fmt::format("model config: field \"parameters\" is {}, but the config has {} parameters",
                                        parameters, c.num_parameters()));
  }
  return c;
}

Result<OptimConfig> optim_config_from_json(const nlohmann::json& j) {
  OptimConfig c;
  FieldReader r(j, "optimizer config");
  DISTCA_RETURN_IF_ERROR(r.object());
  DISTCA_RETURN_IF_ERROR(r.number("lr", c.lr));
  DISTCA_RETURN_IF_ERROR(r.integer("warmup_steps", c.warmup_steps));
  // Optional: JSON from before the schedules is the constant schedule it always was.
  DISTCA_RETURN_IF_ERROR(r.string("schedule", c.schedule, /*required=*/false));
  double min_lr = -1;
  DISTCA_RETURN_IF_ERROR(r.number("min_lr", min_lr, /*required=*/false));
  if (j.contains("min_lr")) c.min_lr = min_lr;
  DISTCA_RETURN_IF_ERROR(r.integer("total_steps", c.total_steps, /*required=*/false));
  DISTCA_RETURN_IF_ERROR(r.number("beta1", c.beta1));
  DISTCA_RETURN_IF_ERROR(r.number("beta2", c.beta2));
  DISTCA_RETURN_IF_ERROR(r.number("eps", c.eps));
  DISTCA_RETURN_IF_ERROR(r.number("weight_decay", c.weight_decay));
  DISTCA_RETURN_IF_ERROR(r.number("clip_norm", c.clip_norm));
  DISTCA_RETURN_IF_ERROR(r.no_other_fields());
  DISTCA_RETURN_IF_ERROR(c.validate());
  return c;
}

}  // namespace distca::model
