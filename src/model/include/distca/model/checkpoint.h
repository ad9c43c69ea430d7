// Checkpoints: a versioned file with one or more named model states (parameters and AdamW
// moments, fp32) and the step they were taken at. Layout:
//   line 1   "distca-checkpoint <version>"
//   line 2   a JSON header: step, model config, the states' names, payload size and checksum
//   payload  per state: params, m, v as little-endian float32
// Written through a temporary file and a rename (never a partial file); every read is checked
// (magic, version, every header field's type and range, sizes, checksum) with a message naming
// the file and the field.
//
// Header fields (all required; any other field is refused, a newer format gets a new version):
//   step              JSON integer 0..kMaxCheckpointStep: the optimizer steps taken (each state's
//                     ModelState::step; the payload has no step counter of its own)
//   model             the ModelConfig as to_json writes it (integers as integers, no other field)
//   states            a non-empty array of distinct names, each "colocated" or "cad" (the
//                     attention backends); the payload holds them in this order
//   floats_per_state  3 x the model's parameter count (params, m, v)
//   payload_bytes     4 x floats_per_state x the number of states, and the bytes after the header
//   fnv1a             16 lowercase hex digits: FNV-1a-64 of the payload
//   run               a JSON object, the caller's `extra` as saved (not interpreted here)
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/status.h"
#include "distca/model/model.h"

namespace distca::model {

inline constexpr int kCheckpointVersion = 1;
// The largest step a checkpoint may hold: the most steps `distca train` runs (--steps).
inline constexpr int64_t kMaxCheckpointStep = 100000000;

struct NamedState {
  std::string name;  // the backend it belongs to ("colocated", "cad")
  ModelState<float>* state = nullptr;
};

// `extra`, a JSON object, is stored in the header as is (run metadata: data source, seed). The
// states must have distinct known names ("colocated", "cad"), one model config and one step.
Status save_checkpoint(const std::string& path, const std::vector<NamedState>& states, const nlohmann::json& extra);
// Fills each state of `states` from the checkpoint's state of the same name (the checkpoint may
// hold more); every state must have the checkpoint's model config. Returns the header, every
// field checked as listed above.
Result<nlohmann::json> load_checkpoint(const std::string& path, const std::vector<NamedState>& states);

}  // namespace distca::model
