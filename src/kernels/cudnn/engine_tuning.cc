#include "engine_tuning.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "distca/core/file.h"
#include "distca/core/json.h"

namespace distca::kernels::cudnn {

namespace {

constexpr const char* kFormat = "distca-cudnn-engines";
constexpr int kVersion = 1;

}  // namespace

Result<EngineChoice> choose_engine(int64_t count, const std::function<std::string(int64_t)>& name,
                                   const std::function<Result<double>(int64_t)>& time_ms, double cap_seconds,
                                   const std::function<double()>& seconds) {
  if (count <= 0) return invalid_argument("cuDNN autotuning: the graph has no engine configuration to run");
  EngineChoice best;
  best.candidates = count;
  std::string first_failure;
  const double start = seconds();
  for (int64_t i = 0; i < count; ++i) {
    if (i > 0 && seconds() - start >= cap_seconds) break;
    ++best.timed;
    Result<double> ms = time_ms(i);
    if (!ms.is_ok() || !std::isfinite(ms.value()) || ms.value() < 0) {
      if (first_failure.empty()) {
        first_failure = ms.is_ok() ? fmt::format("candidate {} timed at {} ms", i, ms.value())
                                   : fmt::format("candidate {}: {}", i, ms.status().message());
      }
      continue;
    }
    if (best.index < 0 || ms.value() < best.ms) {
      best.index = i;
      best.ms = ms.value();
    }
  }
  if (best.index < 0) {
    return internal_error(fmt::format("cuDNN autotuning: none of the {} engine configurations timed ran ({})", best.timed,
                                      first_failure));
  }
  best.name = name(best.index);
  return best;
}

Result<bool> parse_autotune(const char* value) {
  const std::string v = value ? value : "";
  if (v.empty() || v == "0") return false;
  if (v == "1") return true;
  return invalid_argument(fmt::format("DISTCA_CUDNN_AUTOTUNE must be 0 or 1, got '{}'", text_excerpt(v)));
}

Result<double> parse_autotune_ms(const char* value) {
  if (value == nullptr || *value == '\0') return 0.5;
  char* end = nullptr;
  const double ms = std::strtod(value, &end);
  if (end == value || *end != '\0' || !std::isfinite(ms) || ms < 0 || ms > 600000) {
    return invalid_argument(
        fmt::format("DISTCA_CUDNN_AUTOTUNE_MS must be milliseconds in [0, 600000], got '{}'", text_excerpt(value)));
  }
  return ms / 1000;
}

EngineCache EngineCache::load(std::string path, std::string device, std::string cudnn, std::string* warning) {
  EngineCache cache;
  cache.path_ = std::move(path);
  cache.device_ = std::move(device);
  cache.cudnn_ = std::move(cudnn);
  if (cache.path_.empty()) return cache;
  std::error_code ec;
  if (!std::filesystem::exists(cache.path_, ec)) return cache;  // none yet
  auto ignore = [&](const std::string& why) {
    if (warning != nullptr) *warning = fmt::format("cuDNN engine cache {} ignored: {}", cache.path_, why);
    cache.engines_.clear();
    return cache;
  };
  Result<std::string> text = read_text_file(cache.path_);
  if (!text.is_ok()) return ignore(text.status().message());
  Result<nlohmann::json> parsed = parse_json(text.value(), cache.path_);
  if (!parsed.is_ok()) return ignore(parsed.status().message());
  const nlohmann::json& j = parsed.value();
  if (!j.is_object()) return ignore("not a JSON object");
  if (j.value("format", "") != kFormat || j.value("version", 0) != kVersion) {
    return ignore(fmt::format("not format {} version {}", kFormat, kVersion));
  }
  if (j.value("device", "") != cache.device_ || j.value("cudnn", "") != cache.cudnn_) {
    return ignore(fmt::format("made on {} with {}, not {} with {}", j.value("device", "?"), j.value("cudnn", "?"),
                              cache.device_, cache.cudnn_));
  }
  const auto engines = j.find("engines");
  if (engines == j.end() || !engines->is_object()) return ignore("no engines object");
  for (const auto& [key, e] : engines->items()) {
    if (!e.is_object() || !e.contains("index") || !e["index"].is_number_integer() || e["index"].get<int64_t>() < 0 ||
        !e.contains("name") || !e["name"].is_string() || !e.contains("ms") || !e["ms"].is_number()) {
      return ignore(fmt::format("entry '{}' is not {{index >= 0, name, ms}}", key));
    }
    EngineChoice c;
    c.index = e["index"].get<int64_t>();
    c.name = e["name"].get<std::string>();
    c.ms = e["ms"].get<double>();
    c.from_cache = true;
    cache.engines_[key] = std::move(c);
  }
  return cache;
}

std::optional<EngineChoice> EngineCache::find(const std::string& key) const {
  const auto it = engines_.find(key);
  if (it == engines_.end()) return std::nullopt;
  return it->second;
}

void EngineCache::put(const std::string& key, const EngineChoice& choice) { engines_[key] = choice; }

Status EngineCache::save() const {
  if (path_.empty()) return Status::ok();
  nlohmann::json engines = nlohmann::json::object();
  for (const auto& [key, c] : engines_) engines[key] = {{"index", c.index}, {"name", c.name}, {"ms", c.ms}};
  const nlohmann::json j = {{"format", kFormat}, {"version", kVersion}, {"device", device_}, {"cudnn", cudnn_},
                            {"engines", engines}};
  return write_file_atomic(path_, j.dump(1) + "\n");
}

}  // namespace distca::kernels::cudnn
