#include "distca/core/progress.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <string_view>

#include "distca/core/knobs.h"
#include "distca/core/log.h"

namespace distca {

Result<double> progress_interval_from_env() {
  const char* v = knob(kProgressIntervalEnv);
  if (v == nullptr || *v == '\0') return kDefaultProgressInterval;
  const std::string_view text(v);
  double seconds = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), seconds);
  // 0 prints every stage at once; between 0 and the floor the heartbeat would print a line per
  // wake-up (1e-300 printed 26,262 lines in 1.9 s).
  const bool is_number = error == std::errc() && end == text.data() + text.size();
  if (!is_number || !(seconds == 0 || (seconds >= kMinProgressInterval && seconds <= kMaxProgressInterval))) {
    return invalid_argument(fmt::format("{} must be 0 (every stage at once) or a number of seconds in {:g}..{:g} between "
                                        "progress lines, got '{}'",
                                        kProgressIntervalEnv, kMinProgressInterval, kMaxProgressInterval, text));
  }
  return seconds;
}

Progress::Progress(std::string prefix, double interval_seconds)
    : prefix_(std::move(prefix)), interval_(interval_seconds), start_(Clock::now()) {
  if (interval_ > 0) thread_ = std::thread([this] { heartbeat(); });
}

namespace {
double interval_or_default() {
  const Result<double> seconds = progress_interval_from_env();
  return seconds.is_ok() ? seconds.value() : kDefaultProgressInterval;
}
}  // namespace

Progress::Progress(std::string prefix) : Progress(std::move(prefix), interval_or_default()) {}

Progress::~Progress() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    is_stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Progress::stage(std::string what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (what == stage_ && !stage_.empty()) return;
  stage_ = std::move(what);
  is_shown_ = false;
  const Clock::time_point now = Clock::now();
  if (is_due(now)) print(now);
}

void Progress::set_context(std::string context) {
  std::lock_guard<std::mutex> lock(mu_);
  context_ = std::move(context);
}

int Progress::lines() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lines_;
}

bool Progress::is_due(Clock::time_point now) const {
  if (stage_.empty() || log_level() > LogLevel::kInfo) return false;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (elapsed < 2 * interval_) return false;
  if (!has_printed_) return true;
  const double since = std::chrono::duration<double>(now - last_print_).count();
  if (since < interval_) return false;
  return !is_shown_ || (interval_ > 0 && since >= kProgressHeartbeat * interval_);
}

void Progress::print(Clock::time_point now) {
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const std::string line = fmt::format("{}: {} s: {}{}{}\n", prefix_,
                                       elapsed < 10 ? fmt::format("{:.1f}", elapsed) : fmt::format("{:.0f}", elapsed),
                                       context_, context_.empty() ? "" : ": ", stage_);
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  is_shown_ = true;
  has_printed_ = true;
  last_print_ = now;
  ++lines_;
}

void Progress::heartbeat() {
  const auto tick = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(interval_));
  std::unique_lock<std::mutex> lock(mu_);
  while (!is_stopping_) {
    cv_.wait_for(lock, tick, [this] { return is_stopping_; });
    if (is_stopping_) break;
    const Clock::time_point now = Clock::now();
    try {
      if (is_due(now)) print(now);
    } catch (const std::exception&) {
      // Out of memory formatting a line: the run goes on without it (the run itself reports).
    }
  }
}

}  // namespace distca
