// Progress lines for work that can run long: what a run is doing and how long it has run, on
// stderr, as "distca plan: 12 s: planning minlink at eps 0.1 (plan 2 of at most 3)".
//
// Quiet for quick runs and rate-limited for long ones:
//   - nothing until the run has lasted 2 intervals (2 s by default);
//   - then at most one line per interval: the stage when it changes (the latest one, if several
//     changed within the interval), and the same stage again every kProgressHeartbeat intervals
//     while it lasts, from a background thread, so that a long loop that reports nothing is still
//     seen to be alive.
// The command line owns one Progress per run and passes it down; a library takes a `Progress*`
// (nullptr: no lines) and calls stage(). Lines go out only at log level info or below (not with
// --quiet).
//
// DISTCA_PROGRESS_INTERVAL sets the interval in seconds: 0.1..3600 (default 1), or 0, which prints
// every stage at once, with no delay and no heartbeat (what the tests use).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "distca/core/status.h"

namespace distca {

inline constexpr const char* kProgressIntervalEnv = "DISTCA_PROGRESS_INTERVAL";
inline constexpr double kDefaultProgressInterval = 1.0;
inline constexpr double kMinProgressInterval = 0.1;  // a positive interval's floor
inline constexpr double kMaxProgressInterval = 3600;
inline constexpr int kProgressHeartbeat = 10;  // an unchanged stage is shown again after this many intervals

// The interval DISTCA_PROGRESS_INTERVAL sets, else the default; kInvalidArgument naming the
// variable for anything but 0 or a number in 0.1..3600.
Result<double> progress_interval_from_env();

class Progress {
 public:
  // `prefix` starts every line ("distca plan"); `interval_seconds` as above.
  Progress(std::string prefix, double interval_seconds);
  // The interval from the environment (a bad value was refused up front: the default here).
  explicit Progress(std::string prefix);
  ~Progress();  // stops the heartbeat
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // What the run does now. Thread-safe; prints the line when one is due.
  void stage(std::string what);
  // Text put before every stage from now on ("configuration 3 of 54"; "" for none), for a caller
  // that runs a library which sets its own stages several times.
  void set_context(std::string context);
  // Lines printed so far (for tests of the rate limit).
  int lines() const;

 private:
  using Clock = std::chrono::steady_clock;
  bool is_due(Clock::time_point now) const;  // REQUIRES: mu_ held
  void print(Clock::time_point now);         // REQUIRES: mu_ held
  void heartbeat();

  const std::string prefix_;
  const double interval_;
  const Clock::time_point start_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string context_;             // guarded by mu_
  std::string stage_;               // guarded by mu_
  bool is_shown_ = true;            // stage_ printed since it last changed (nothing to show at first)
  bool has_printed_ = false;
  Clock::time_point last_print_{};  // of the latest line
  int lines_ = 0;
  bool is_stopping_ = false;
  std::thread thread_;  // the heartbeat (interval > 0 only)
};

}  // namespace distca
