#include "distca/model/checkpoint.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "distca/core/file.h"

namespace distca::model {

namespace {

const char* const kMagic = "distca-checkpoint";

uint64_t fnv1a(const char* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  return h;
}

}  // namespace

Status save_checkpoint(const std::string& path, const std::vector<NamedState>& states, const nlohmann::json& extra) {
  if (states.empty()) return invalid_argument("a checkpoint needs at least one state");
  std::string payload;
  nlohmann::json names = nlohmann::json::array();
  for (const NamedState& s : states) {
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
  const size_t line1 = text.find('\n');
  const size_t line2 = line1 == std::string::npos ? line1 : text.find('\n', line1 + 1);
  if (line2 == std::string::npos || text.compare(0, std::strlen(kMagic), kMagic) != 0) {
    return invalid_argument(fmt::format("{}: not a distca checkpoint", path));
  }
  const std::string version = text.substr(std::strlen(kMagic) + 1, line1 - std::strlen(kMagic) - 1);
  if (version != std::to_string(kCheckpointVersion)) {
    return invalid_argument(fmt::format("{}: checkpoint version {} (this build reads version {})", path, version,
                                        kCheckpointVersion));
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text.substr(line1 + 1, line2 - line1 - 1));
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(fmt::format("{}: bad checkpoint header ({})", path, e.what()));
  }
  const char* payload = text.data() + line2 + 1;
  const size_t payload_bytes = text.size() - line2 - 1;
  ModelConfig config;
  int64_t step = 0;
  std::vector<std::string> names;
  try {
    DISTCA_ASSIGN_OR_RETURN(config, model_config_from_json(header.at("model")));
    step = header.at("step").get<int64_t>();
    names = header.at("states").get<std::vector<std::string>>();
    if (header.at("payload_bytes").get<size_t>() != payload_bytes) {
      return invalid_argument(fmt::format("{}: truncated checkpoint ({} payload bytes, the header says {})", path,
                                          payload_bytes, header.at("payload_bytes").get<size_t>()));
    }
    if (header.at("fnv1a").get<std::string>() != fmt::format("{:016x}", fnv1a(payload, payload_bytes))) {
      return invalid_argument(fmt::format("{}: checksum mismatch (a corrupt checkpoint)", path));
    }
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(fmt::format("{}: bad checkpoint header ({})", path, e.what()));
  }
  for (const NamedState& s : states) {
    ModelState<float>& st = *s.state;
    if (to_json(st.config) != to_json(config)) {
      return invalid_argument(fmt::format("{}: the checkpoint's model ({}) differs from this run's ({})", path,
                                          to_json(config).dump(), to_json(st.config).dump()));
    }
    const auto it = std::find(names.begin(), names.end(), s.name);
    if (it == names.end()) {
      return not_found(fmt::format("{}: no state '{}' (it holds: {})", path, s.name, fmt::join(names, ", ")));
    }
    const size_t floats = 3 * static_cast<size_t>(st.params.size());
    const size_t at = static_cast<size_t>(it - names.begin()) * floats * sizeof(float);
    if (at + floats * sizeof(float) > payload_bytes) return invalid_argument(fmt::format("{}: state sizes do not match", path));
    const char* p = payload + at;
    for (Arena<float>* a : {&st.params, &st.m, &st.v}) {
      std::memcpy(a->data(), p, sizeof(float) * static_cast<size_t>(a->size()));
      p += sizeof(float) * static_cast<size_t>(a->size());
    }
    st.step = step;
  }
  return header;
}

}  // namespace distca::model
