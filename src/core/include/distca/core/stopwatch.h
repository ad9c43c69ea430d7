// Wall-clock seconds for the time splits the records report (steady clock).
#pragma once
#include <chrono>
#include <utility>

namespace distca {

using SteadyClock = std::chrono::steady_clock;

inline double seconds_since(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

// Runs fn and adds its seconds to `seconds`; returns what fn returns.
template <typename Fn>
auto timed(double& seconds, Fn&& fn) {
  const auto t = SteadyClock::now();
  auto result = std::forward<Fn>(fn)();
  seconds += seconds_since(t);
  return result;
}

}  // namespace distca
