// Model, optimizer and run configuration of the training loop, and the named presets.
#pragma once
#include <cstdint>
#include <optional>
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

// One tensor-parallel rank's slice of a model (Megatron): query heads and the FFN width divided
// by `tp` (column-parallel Wq/Wk/Wv and Wgate/Wup, row-parallel Wo and Wdown); key/value heads
// divided too, or, with fewer of them than ranks (GQA), one per rank, shared by tp / Hkv ranks
// (Megatron's replicated KV heads); embedding, norms and LM head whole. An error names what `tp`
// does not divide.
Result<ModelConfig> tensor_parallel_shard(const ModelConfig& config, int tp);
// How many tensor-parallel ranks hold each key/value head: tp / Hkv with fewer heads than
// ranks, else 1.
inline int kv_head_replicas(const ModelConfig& config, int tp) {
  return config.num_kv_heads < tp ? tp / static_cast<int>(config.num_kv_heads) : 1;
}

// AdamW and its learning-rate schedule. Every schedule starts with a linear warm-up: step s < W
// (W = warmup_steps) uses lr * (s + 1) / W, so the peak `lr` is reached at step P = max(W - 1, 0).
// After it:
//   constant  lr on every later step
//   cosine    from lr at step P down to the floor at the last step N - 1 (N = total_steps):
//             floor + (lr - floor) * (1 + cos(pi * x)) / 2, x = (s - P) / (N - 1 - P)
//   linear    the same endpoints on a straight line: lr - (lr - floor) * x
// Steps past the last one stay at the floor. The decaying schedules need total_steps
// (`distca train` sets it to --steps) with the warm-up ending before the last step (W < N).
struct OptimConfig {
  double lr = 1e-3;          // the peak
  int64_t warmup_steps = 5;  // linear warm-up from lr / warmup_steps; 0: none
  std::string schedule = "constant";  // constant | cosine | linear (see lr_schedules())
  std::optional<double> min_lr;       // the floor of cosine and linear, 0..lr; unset: 0.1 * lr
  int64_t total_steps = 0;            // the step count the decay ends at; not used by constant
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled; matrices only (not norms)
  double clip_norm = 1.0;     // global gradient norm; 0: no clipping

  Status validate() const;
  double lr_at(int64_t step) const;  // step counts from 0; negative steps are step 0
  double floor_lr() const { return min_lr.value_or(0.1 * lr); }
};

// The names OptimConfig::schedule accepts.
std::vector<std::string> lr_schedules();

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
// Every field; "min_lr" is the floor in effect (floor_lr()), so the JSON reads back to the same
// schedule.
nlohmann::json to_json(const OptimConfig& c);
// Reads a ModelConfig written by to_json; every field is required and has its type (integer
// fields must be JSON integers: 2.5 layers is refused, not rounded); "parameters", written by
// to_json, is optional and must match; any other field is refused.
Result<ModelConfig> model_config_from_json(const nlohmann::json& j);
// Reads an OptimConfig written by to_json, with the same checks. JSON written before the
// schedules existed (no "schedule", "min_lr", "total_steps") reads as the constant schedule.
Result<OptimConfig> optim_config_from_json(const nlohmann::json& j);

}  // namespace distca::model
