#include "distca/model/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "distca/core/file.h"
#include "distca/core/json.h"

namespace distca::model {

namespace {

const char* const kMagic = "distca-checkpoint";
const std::vector<std::string> kStateNames = {"colocated", "cad"};  // the attention backends
const std::set<std::string> kHeaderFields = {"step", "model", "states", "floats_per_state", "payload_bytes", "fnv1a", "run"};

uint64_t fnv1a(const char* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  return h;
}

bool known_state(const std::string& name) { return std::find(kStateNames.begin(), kStateNames.end(), name) != kStateNames.end(); }

// The header's fields, each checked for its type and range against the payload that follows.
struct Header {
  int64_t step = 0;
  ModelConfig config;
  std::vector<std::string> states;
};

Result<Header> read_header(const std::string& path, const nlohmann::json& h, const char* payload, size_t payload_bytes) {
  auto bad = [&](const char* field, const std::string& expected) {
    return invalid_argument(fmt::format("{}: checkpoint header field \"{}\" must be {}, got {}", path, field, expected,
                                        h.contains(field) ? json_excerpt(h[field]) : std::string("nothing")));
  };
  if (!h.is_object()) return invalid_argument(fmt::format("{}: the checkpoint header is not a JSON object", path));
  for (const auto& [key, value] : h.items()) {
    if (!kHeaderFields.contains(key)) {
      return invalid_argument(fmt::format("{}: unknown checkpoint header field \"{}\" (version {} has: {})", path, key,
                                          kCheckpointVersion, fmt::join(kHeaderFields, ", ")));
    }
  }
  Header out;
  // step: a JSON integer (1.5 is not rounded), in range, so a resume starts where it says.
  const std::string step_range = fmt::format("an integer 0..{} (the optimizer steps taken)", kMaxCheckpointStep);
  if (!h.contains("step") || !h["step"].is_number_integer() ||
      (h["step"].is_number_unsigned() && h["step"].get<uint64_t>() > static_cast<uint64_t>(kMaxCheckpointStep))) {
    return bad("step", step_range);
  }
  out.step = h["step"].get<int64_t>();
  if (out.step < 0 || out.step > kMaxCheckpointStep) return bad("step", step_range);
  if (!h.contains("model")) return bad("model", "the model config");
  Result<ModelConfig> config = model_config_from_json(h["model"]);
  if (!config.is_ok()) {
    return invalid_argument(fmt::format("{}: checkpoint header field \"model\": {}", path, config.status().message()));
  }
  out.config = config.value();
  // states: distinct known names.
  const std::string names = fmt::format("a non-empty array of distinct state names ({})", fmt::join(kStateNames, ", "));
  if (!h.contains("states") || !h["states"].is_array() || h["states"].empty()) return bad("states", names);
  for (const nlohmann::json& name : h["states"]) {
    if (!name.is_string() || !known_state(name.get<std::string>())) return bad("states", names);
    if (std::find(out.states.begin(), out.states.end(), name.get<std::string>()) != out.states.end()) {
      return bad("states", names);
    }
    out.states.push_back(name.get<std::string>());
  }
  // floats_per_state and payload_bytes: what the model and the states make.
  const auto floats = static_cast<uint64_t>(3 * out.config.num_parameters());
  if (!h.contains("floats_per_state") || !h["floats_per_state"].is_number_unsigned() ||
      h["floats_per_state"].get<uint64_t>() != floats) {
    return bad("floats_per_state", fmt::format("{} (3 x the model's {} parameters)", floats, out.config.num_parameters()));
  }
  const uint64_t bytes = out.states.size() * floats * sizeof(float);
  if (!h.contains("payload_bytes") || !h["payload_bytes"].is_number_unsigned() || h["payload_bytes"].get<uint64_t>() != bytes) {
    return bad("payload_bytes", fmt::format("{} ({} states of {} floats)", bytes, out.states.size(), floats));
  }
  if (payload_bytes != bytes) {
    return invalid_argument(fmt::format("{}: {} checkpoint ({} payload bytes, the header says {})", path,
                                        payload_bytes < bytes ? "truncated" : "overlong", payload_bytes, bytes));
  }
  if (!h.contains("fnv1a") || !h["fnv1a"].is_string() || h["fnv1a"].get<std::string>().size() != 16 ||
      h["fnv1a"].get<std::string>().find_first_not_of("0123456789abcdef") != std::string::npos) {
    return bad("fnv1a", "16 lowercase hex digits");
  }
  if (h["fnv1a"].get<std::string>() != fmt::format("{:016x}", fnv1a(payload, payload_bytes))) {
    return invalid_argument(fmt::format("{}: checksum mismatch (a corrupt checkpoint)", path));
  }
  if (!h.contains("run") || !h["run"].is_object()) return bad("run", "a JSON object (the run's metadata)");
  return out;
}

}  // namespace

Status save_checkpoint(const std::string& path, const std::vector<NamedState>& states, const nlohmann::json& extra) {
  if (states.empty()) return invalid_argument("a checkpoint needs at least one state");
  if (!extra.is_object()) return invalid_argument("a checkpoint's run metadata must be a JSON object");
  std::string payload;
  nlohmann::json names = nlohmann::json::array();
  for (const NamedState& s : states) {
    if (s.state == nullptr) return invalid_argument(fmt::format("checkpoint state '{}' is missing", s.name));
    if (!known_state(s.name) || std::find(names.begin(), names.end(), s.name) != names.end()) {
      return invalid_argument(fmt::format("checkpoint state names must be distinct, each one of {}; got '{}'",
                                          fmt::join(kStateNames, ", "), s.name));
    }
    if (to_json(s.state->config) != to_json(states[0].state->config) || s.state->step != states[0].state->step) {
      return invalid_argument(fmt::format("checkpoint state '{}' has another model or step than '{}'", s.name,
                                          states[0].name));
    }
    names.push_back(s.name);
    for (const Arena<float>* a : {&s.state->params, &s.state->m, &s.state->v}) {
      payload.append(reinterpret_cast<const char*>(a->data()), sizeof(float) * static_cast<size_t>(a->size()));
    }
  }
  nlohmann::json header = {{"step", states[0].state->step},
                           {"model", to_json(states[0].state->config)},
                           {"states", names},
                           {"floats_per_state", 3 * states[0].state->params.size()},
                           {"payload_bytes", payload.size()},
                           {"fnv1a", fmt::format("{:016x}", fnv1a(payload.data(), payload.size()))},
                           {"run", extra}};
  std::string text = fmt::format("{} {}\n{}\n", kMagic, kCheckpointVersion, header.dump());
  text += payload;
  return write_file_atomic(path, text);
}

Result<nlohmann::json> load_checkpoint(const std::string& path, const std::vector<NamedState>& states) {
  DISTCA_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  const size_t magic = std::strlen(kMagic);
  const size_t line1 = text.find('\n');
  const size_t line2 = line1 == std::string::npos ? line1 : text.find('\n', line1 + 1);
  if (line2 == std::string::npos || line1 <= magic + 1 || text.compare(0, magic, kMagic) != 0 || text[magic] != ' ') {
    return invalid_argument(fmt::format("{}: not a distca checkpoint", path));
  }
  const std::string version = text.substr(magic + 1, line1 - magic - 1);
  if (version != std::to_string(kCheckpointVersion)) {
    return invalid_argument(fmt::format("{}: checkpoint version {} (this build reads version {})", path, version,
                                        kCheckpointVersion));
  }
  DISTCA_ASSIGN_OR_RETURN(const nlohmann::json header,
                          parse_json(std::string_view(text).substr(line1 + 1, line2 - line1 - 1),
                                     fmt::format("{}: checkpoint header", path)));
  const char* payload = text.data() + line2 + 1;
  const size_t payload_bytes = text.size() - line2 - 1;
  DISTCA_ASSIGN_OR_RETURN(Header h, read_header(path, header, payload, payload_bytes));
  for (const NamedState& s : states) {
    ModelState<float>& st = *s.state;
    if (to_json(st.config) != to_json(h.config)) {
      return invalid_argument(fmt::format("{}: the checkpoint's model ({}) differs from this run's ({})", path,
                                          to_json(h.config).dump(), to_json(st.config).dump()));
    }
    const auto it = std::find(h.states.begin(), h.states.end(), s.name);
    if (it == h.states.end()) {
      return not_found(fmt::format("{}: no state '{}' (it holds: {})", path, s.name, fmt::join(h.states, ", ")));
    }
    // read_header checked the payload: every state is 3 x num_parameters floats.
    const size_t floats = 3 * static_cast<size_t>(h.config.num_parameters());
    if (3 * static_cast<size_t>(st.params.size()) != floats) {
      return invalid_argument(fmt::format("{}: state '{}' has {} parameters, the checkpoint's model {}", path, s.name,
                                          st.params.size(), h.config.num_parameters()));
    }
    const char* p = payload + static_cast<size_t>(it - h.states.begin()) * floats * sizeof(float);
    for (Arena<float>* a : {&st.params, &st.m, &st.v}) {
      std::memcpy(a->data(), p, sizeof(float) * static_cast<size_t>(a->size()));
      p += sizeof(float) * static_cast<size_t>(a->size());
    }
    st.step = h.step;
  }
  return header;
}

}  // namespace distca::model
