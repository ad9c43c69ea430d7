#include "distca/core/log.h"

#include <atomic>
#include <cstdio>

namespace distca {
namespace {
std::atomic<LogLevel> g_level{LogLevel::kInfo};
const char* level_tag(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "";
  }
  return "";
}
}  // namespace

void set_log_level(LogLevel level) { g_level.store(level); }
LogLevel log_level() { return g_level.load(); }

void log_line(LogLevel level, std::string_view message) {
  if (level < log_level()) return;
  std::fprintf(stderr, "distca %s: %.*s\n", level_tag(level), static_cast<int>(message.size()),
               message.data());
}

}  // namespace distca
