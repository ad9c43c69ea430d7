// Model, optimizer and run configuration of the training loop, and the named presets.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/status.h"

namespace distca::model {

// A Llama-style decoder: pre-norm (RMSNorm) blocks of GQA attention with RoPE and a SwiGLU MLP,
// untied embedding and LM head.
struct ModelConfig {
  int64_t vocab_size = 256;  // byte-level tokens
  int64_t d_model = 64;
  int64_t num_layers = 2;
  int64_t num_q_heads = 2;   // Hq
  int64_t num_kv_heads = 1;  // Hkv; Hq % Hkv == 0
  int64_t head_dim = 32;     // D, even (RoPE rotates pairs)
  int64_t ffn_dim = 128;
  double rope_base = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  uint64_t init_seed = 1;

  Status validate() const;
  int64_t q_width() const { return num_q_heads * head_dim; }
  int64_t kv_width() const { return num_kv_heads * head_dim; }
  int64_t num_parameters() const;
};

struct OptimConfig {
  double lr = 1e-3;
  int64_t warmup_steps = 5;  // linear warm-up from lr / warmup_steps, then constant
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled; matrices only (not norms)
  double clip_norm = 1.0;     // global gradient norm; 0: no clipping

  Status validate() const;
  double lr_at(int64_t step) const;  // step counts from 0
};

// A named starting point for `distca train`; every field can be overridden by a flag.
struct Preset {
  std::string name;
  std::string description;
  ModelConfig model;
  OptimConfig optim;
  int64_t context = 0;  // tokens per rank per step
  int64_t steps = 0;
  std::string workload;  // document lengths of the embedded source (see data.h)
};

// "tiny" (tests, seconds) and "demo" (attention-dominant, one rank holds the long documents).
Result<Preset> find_preset(const std::string& name);
std::vector<std::string> preset_names();

nlohmann::json to_json(const ModelConfig& c);
nlohmann::json to_json(const OptimConfig& c);
// Reads a ModelConfig written by to_json; every field is required.
Result<ModelConfig> model_config_from_json(const nlohmann::json& j);

}  // namespace distca::model
