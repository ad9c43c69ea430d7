// Checkpoints: a versioned file with one or more named model states (parameters and AdamW
// moments, fp32) and the step they were taken at. Layout:
//   line 1   "distca-checkpoint <version>"
//   line 2   a JSON header: step, model config, the states' names, payload size and checksum
//   payload  per state: params, m, v as little-endian float32
// Written through a temporary file and a rename (never a partial file); every read is checked
// (magic, version, config, sizes, checksum) with a message naming the file.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/status.h"
#include "distca/model/model.h"

namespace distca::model {

inline constexpr int kCheckpointVersion = 1;

struct NamedState {
  std::string name;  // the backend it belongs to ("colocated", "cad")
  ModelState<float>* state = nullptr;
};

// `extra` is stored in the header as is (run metadata: data source, seed).
Status save_checkpoint(const std::string& path, const std::vector<NamedState>& states, const nlohmann::json& extra);
// Fills each state of `states` from the checkpoint's state of the same name; every state must
// have the checkpoint's model config. Returns the header.
Result<nlohmann::json> load_checkpoint(const std::string& path, const std::vector<NamedState>& states);

}  // namespace distca::model
