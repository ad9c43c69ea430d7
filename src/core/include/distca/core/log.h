// Leveled logging to stderr. The level is process-wide and set once by the CLI (--verbose,
// --quiet); libraries only log, they never configure.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace distca {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_line(LogLevel level, std::string_view message);

template <typename... Args>
void log_at(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level < log_level()) return;
  log_line(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace distca

#define DISTCA_LOG_DEBUG(...) ::distca::log_at(::distca::LogLevel::kDebug, __VA_ARGS__)
#define DISTCA_LOG_INFO(...) ::distca::log_at(::distca::LogLevel::kInfo, __VA_ARGS__)
#define DISTCA_LOG_WARN(...) ::distca::log_at(::distca::LogLevel::kWarn, __VA_ARGS__)
