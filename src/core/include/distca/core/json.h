// JSON input that cannot take the process down: every file distca reads as JSON (batches, document
// lengths, profiles, plans, checkpoint headers, data lines) goes through parse_json.
//
// - Nesting deeper than kMaxJsonDepth is refused before nlohmann sees the text (its parser is
//   iterative, but every walk over the value — ours, dump(), the destructor of a deep tree in
//   older releases — recurses, and 100 000 brackets overflow the stack).
// - Every nlohmann exception (syntax, a number that overflows a double such as 1e400, invalid
//   UTF-8) becomes kInvalidArgument naming `origin`; nothing escapes as an exception.
// - Messages quote at most kMaxQuoted characters of the input (json_excerpt), so a huge value is
//   never echoed whole.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "distca/core/status.h"

namespace distca {

inline constexpr int kMaxJsonDepth = 64;
inline constexpr size_t kMaxQuoted = 80;

// Parses `text`; `origin` (a path, "batch", "--model") starts every error message.
Result<nlohmann::json> parse_json(std::string_view text, std::string_view origin);

// A value as compact JSON for a message, cut to kMaxQuoted characters with "... (N characters)".
std::string json_excerpt(const nlohmann::json& value);
// The same for plain text (a line of a data file, a flag's value).
std::string text_excerpt(std::string_view text);

// Thrown by the field readers below; parsers catch it with every other nlohmann::json::exception
// (its what() is the message alone, without a "[json.exception...]" tag).
class JsonValueError : public nlohmann::json::exception {
 public:
  explicit JsonValueError(const std::string& message) : exception(0, message.c_str()) {}
};

// A field that must be a JSON integer in [lo, hi] (2.5 and 1e30 are refused, not cast; a cast
// of an out-of-range double is undefined behaviour). `name` names it in the message.
int64_t json_int(const nlohmann::json& value, std::string_view name, int64_t lo, int64_t hi);
// A field that must be a JSON number (an integer or a float); JSON cannot hold inf or NaN.
double json_number(const nlohmann::json& value, std::string_view name);

// nlohmann's message without its "[json.exception.type_error.302] " tag.
std::string json_error_text(const nlohmann::json::exception& e);

}  // namespace distca
