#include "distca/train/options.h"

#include <algorithm>

#include <fmt/format.h>

#include "distca/model/model.h"

namespace distca::train {

Status TrainOptions::validate(int world_size) const {
  DISTCA_RETURN_IF_ERROR(model.validate());
  DISTCA_RETURN_IF_ERROR(optim.validate());
  if (context < 16 || context > plan::kMaxTokens) {
    return invalid_argument(fmt::format("--context must be 16..{} tokens per rank, got {}", plan::kMaxTokens, context));
  }
  if (steps < 1 || steps > 100000000) return invalid_argument(fmt::format("--steps must be >= 1, got {}", steps));
  if (backends.empty()) return invalid_argument("no attention backend to train with");
  for (const std::string& b : backends) {
    if (b != "colocated" && b != "cad") {
      return invalid_argument(fmt::format("--attention must be colocated or cad, got '{}'", b));
    }
  }
  DISTCA_RETURN_IF_ERROR(plan::find_planner(policy).status());
  if (grad_return != plan::GradReturn::kFp32 && grad_return != plan::GradReturn::kBf16) {
    return invalid_argument(fmt::format("--grad-return must be bf16 or fp32, got value {}", static_cast<int>(grad_return)));
  }
  if (tp < 1 || tp > 1024) return invalid_argument(fmt::format("--tp must be 1..1024, got {}", tp));
  if (tp > 1) {
    DISTCA_RETURN_IF_ERROR(model::tensor_parallel_shard(model, tp).status());
    if (!checkpoint_path.empty() || !resume_path.empty()) {
      return invalid_argument("--tp does not support --checkpoint or --resume yet (each rank holds a slice of the model): drop them");
    }
  }
  if (pp < 1 || pp > 1024) return invalid_argument(fmt::format("--pp must be 1..1024, got {}", pp));
  if (micro_batches < 0 || micro_batches > 4096) {
    return invalid_argument(fmt::format("--micro-batches must be 1..4096 (0: 2 x --pp), got {}", micro_batches));
  }
  if (pp > 1) {
    if (model.num_layers % pp != 0) {
      return invalid_argument(fmt::format("--pp {} must divide the model's {} layers (equal layers per stage); change "
                                          "--layers or --pp", pp, model.num_layers));
    }
    if (!checkpoint_path.empty() || !resume_path.empty() || eval_every > 0) {
      return invalid_argument("--pp does not support --checkpoint, --resume or --eval-every yet: drop them");
    }
  }
  if (world_size < 1 || world_size % (tp * pp) != 0) {
    return invalid_argument(fmt::format("--tp {} x --pp {} must divide the {} ranks (the rest is data parallelism); "
                                        "change --ranks (mpirun -np) or the layout",
                                        tp, pp, world_size));
  }
  if (attention_link) DISTCA_RETURN_IF_ERROR(attention_link->validate());
  if (pingpong != "auto" && pingpong != "on" && pingpong != "off" && pingpong != "sequential") {
    return invalid_argument(fmt::format("--pingpong must be on or off (auto: on for cad, off for colocated), got '{}'", pingpong));
  }
  if (progress != "none" && progress != "poll" && progress != "thread") {
    return invalid_argument(fmt::format("--progress must be none, poll or thread, got '{}'", progress));
  }
  if (progress_interval_us < 10 || progress_interval_us > 100000) {
    return invalid_argument(fmt::format("--progress-interval-us must be 10..100000, got {}", progress_interval_us));
  }
  if (grad_sync != "overlap" && grad_sync != "eager" && grad_sync != "after") {
    return invalid_argument(fmt::format("--grad-sync must be overlap, eager or after, got '{}'", grad_sync));
  }
  if (memory_budget < kAutoBudget) {
    return invalid_argument(fmt::format("--memory-budget must be MiB, auto or unlimited, got {} bytes", memory_budget));
  }
  if (pp > 1 && memory_budget > 0) {
    return invalid_argument("--memory-budget governs the data-parallel trainer; with --pp the pipeline's memory is its "
                            "schedule's (--recompute evens it across stages): drop --memory-budget or --pp");
  }
  if (threads < 1 || threads > 1024) return invalid_argument(fmt::format("--threads must be 1..1024, got {}", threads));
  if (granularity < 0) return invalid_argument(fmt::format("--granularity must be >= 0 (0: auto), got {}", granularity));
  if (!(tolerance >= 0) || tolerance > 10) return invalid_argument(fmt::format("--tolerance must be 0..10, got {}", tolerance));
  if (save_every < 0) return invalid_argument("--save-every must be >= 0");
  if (save_every > 0 && checkpoint_path.empty()) return invalid_argument("--save-every needs --checkpoint FILE");
  if (eval_every < 0 || eval_every > steps) {
    return invalid_argument(fmt::format("--eval-every must be 0 (never) to --steps ({}), got {}", steps, eval_every));
  }
  if (eval_docs < 1 || eval_docs > 10000000) return invalid_argument(fmt::format("--eval-docs must be >= 1, got {}", eval_docs));
  if (eval_steps < 1 || eval_steps > 10000) return invalid_argument(fmt::format("--eval-steps must be 1..10000, got {}", eval_steps));
  return Status::ok();
}

nlohmann::json TrainOptions::to_json() const {
  return {{"model", model::to_json(model)},
          {"optimizer", model::to_json(optim)},
          {"context", context},
          {"steps", steps},
          {"data", data_path.empty() ? "synthetic" : data_path},
          {"workload", workload},
          {"data_seed", data_seed},
          {"backends", backends},
          {"policy", policy},
          {"backward_mode", plan::backward_mode_name(backward_mode)},
          {"grad_return", plan::grad_return_name(grad_return)},
          {"tp", tp},
          {"pp", pp},
          {"micro_batches", micro_batches},
          {"recompute", recompute},
          {"pingpong", pingpong},
          {"memory_budget", memory_budget == kAutoBudget ? nlohmann::json("auto") : nlohmann::json(memory_budget)},
          {"progress", progress},
          {"progress_interval_us", progress_interval_us},
          {"grad_sync", grad_sync},
          {"threads", threads},
          {"granularity", granularity},
          {"tolerance", tolerance},
          {"eval_every", eval_every},
          {"eval_docs", eval_docs},
          {"eval_steps", eval_steps}};
}

int64_t default_granularity(int64_t context) {
  int64_t g = 16;
  while (g * 2 <= std::min<int64_t>(context / 32, 128)) g *= 2;
  return g;
}

MemoryEstimate estimate_memory(const TrainOptions& o, int ranks) {
  MemoryEstimate e;
  auto shard = model::tensor_parallel_shard(o.model, std::max(o.tp, 1));
  const model::ModelConfig m = shard.is_ok() ? shard.value() : o.model;
  ranks = std::max(ranks / std::max(o.tp, 1), 1);
  const int64_t f = static_cast<int64_t>(sizeof(float));
  // Parameters, gradients and two AdamW moments per backend.
  e.states_bytes = static_cast<int64_t>(o.backends.size()) * 4 * m.num_parameters() * f;
  if (o.pp > 1) {
    // A stage holds up to 2P - 1 micro-batches between their forward and backward (cad's lockstep
    // first stage; 1F1B's holds P), each in a workspace of its L / P layers.
    e.activations_bytes = (2 * o.pp - 1) * model::Model<float>::workspace_bytes(m, o.context, {0, m.num_layers / o.pp});
  } else {
    e.activations_bytes = model::Model<float>::workspace_bytes(m, o.context);
  }
  // The attention exchange: Q, K, V, O, their gradients and LSE for up to twice this rank's
  // rows (a server may take more than its own share), send and receive buffers; the stateful
  // backward keeps the forward's per layer.
  const int64_t row = 2 * (m.q_width() + m.kv_width()) + m.num_q_heads;
  const int64_t layers_kept = o.backward_mode == plan::BackwardMode::kStateful ? m.num_layers + 1 : 2;
  e.attention_bytes = 2 * (2 * o.context) * row * f * layers_kept;
  // Every rank packs the whole step (tokens, targets, positions of all ranks).
  e.data_bytes = 3 * static_cast<int64_t>(ranks) * o.context * static_cast<int64_t>(sizeof(int32_t));
  return e;
}

}  // namespace distca::train
