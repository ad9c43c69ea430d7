#include "distca/core/json.h"

#include <fmt/format.h>

namespace distca {

namespace {

// The deepest nesting of [ and { outside strings, stopping once it passes `limit`.
int nesting_depth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest && (deepest = depth) > limit) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

std::string text_excerpt(std::string_view text) {
  if (text.size() <= kMaxQuoted) return std::string(text);
  return fmt::format("{}... ({} characters)", text.substr(0, kMaxQuoted), text.size());
}

std::string json_excerpt(const nlohmann::json& value) {
  // Containers are cut before they are dumped: a dump of a large array is itself large.
  if (value.is_array() && value.size() > kMaxQuoted) return fmt::format("an array of {} values", value.size());
  if (value.is_object() && value.size() > kMaxQuoted) return fmt::format("an object of {} keys", value.size());
  return text_excerpt(value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

int64_t json_int(const nlohmann::json& value, std::string_view name, int64_t lo, int64_t hi) {
  const bool fits = value.is_number_unsigned()  ? value.get<uint64_t>() <= static_cast<uint64_t>(hi)
                    : value.is_number_integer() ? value.get<int64_t>() <= hi
                                                : false;
  if (!fits || value.get<int64_t>() < lo) {
    throw JsonValueError(fmt::format("{} must be an integer in [{}, {}], got {}", name, lo, hi, json_excerpt(value)));
  }
  return value.get<int64_t>();
}

double json_number(const nlohmann::json& value, std::string_view name) {
  if (!value.is_number()) throw JsonValueError(fmt::format("{} must be a number, got {}", name, json_excerpt(value)));
  return value.get<double>();
}

std::string json_error_text(const nlohmann::json::exception& e) {
  const std::string what = e.what();
  const size_t tag = what.find("] ");
  // nlohmann quotes the token it stopped at, which can be a whole long line.
  const std::string text = tag == std::string::npos ? what : what.substr(tag + 2);
  return text.size() <= 3 * kMaxQuoted ? text : text.substr(0, 3 * kMaxQuoted) + "...";
}

Result<nlohmann::json> parse_json(std::string_view text, std::string_view origin) {
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    return invalid_argument(fmt::format("{}: is empty, expected JSON", origin));
  }
  if (nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return invalid_argument(
        fmt::format("{}: malformed JSON: nested more than {} levels deep", origin, kMaxJsonDepth));
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(fmt::format("{}: malformed JSON: {}", origin, json_error_text(e)));
  }
}

}  // namespace distca
