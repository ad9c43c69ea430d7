// Fuzz target: checkpoint files ("distca-checkpoint 1", a JSON header line, a float32 payload)
// through load_checkpoint, which reads a path: the input is written to a scratch file first. The
// state to fill is the smallest model ModelConfig::validate() accepts (16 parameters, a
// 192-byte payload per state), so that inputs can be whole, valid checkpoints. It is laid out by
// hand as one block per arena rather than by ModelState::create, which is model.cc (BLAS, the
// attention backends): load_checkpoint reads only the config, the arenas' sizes and data.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "distca/model/checkpoint.h"
#include "distca/model/model.h"
#include "fuzz_file.h"

namespace {

distca::model::ModelConfig smallest_config() {
  distca::model::ModelConfig c;
  c.vocab_size = 1;
  c.d_model = 1;
  c.num_layers = 1;
  c.num_q_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.ffn_dim = 1;
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const distca::model::ModelConfig config = smallest_config();
  const std::string path = distca::fuzz::write_scratch_file("checkpoint", ".ckpt", data, size);
  distca::model::ModelState<float> state;
  state.config = config;
  state.params.add("all", config.num_parameters());
  state.params.allocate();
  state.m.copy_layout(state.params);
  state.v.copy_layout(state.params);
  distca::Result<nlohmann::json> header = distca::model::load_checkpoint(path, {{"cad", &state}});
  if (!header.is_ok()) return 0;
  distca::fuzz::require(header.value().is_object(), "a loaded checkpoint's header is not an object");
  distca::fuzz::require(state.step >= 0 && state.step <= distca::model::kMaxCheckpointStep, "a step out of range");
  return 0;
}
