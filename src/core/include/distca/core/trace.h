// A rank's timeline: named spans of the step's parts, kept for the last steps and written as
// Chrome trace-event JSON (distca train --trace; opens in Perfetto and chrome://tracing; the
// same document as distca.torch's trainer writes, so python -m distca.torch.trace_report reads
// both). A span carries the part of the step record it is time of ("linear", "attention",
// "comm", "wait", "optimizer", "other"; "" for one that only marks a phase, as the whole step),
// so that a rank's spans of a part add up to that part. Track 0 ("main") holds what the rank's
// thread does; track 1 ("exchange") each all-to-all from posted to completed, in flight while
// track 0 goes on (ping-pong's overlap).
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/core/stopwatch.h"

namespace distca::trace {

enum Track : int { kMain = 0, kExchange = 1 };

struct Event {
  const char* name = "";  // static strings: a span costs no allocation
  const char* part = "";
  int track = kMain;
  int layer = -1;  // -1: none
  int nano = -1;   // ping-pong's nano-batch (0, 1); -1: none
  int64_t start_ns = 0, end_ns = 0;  // steady clock
};

class Recorder {
 public:
  explicit Recorder(int64_t max_steps) : max_steps_(max_steps < 1 ? 1 : max_steps) {}
  // Spans from here belong to a new step, labelled as the step lines are ("4 cad"); the oldest
  // step beyond max_steps is dropped.
  void begin_step(std::string label);
  void add(const Event& e);
  // (label, events) of the steps kept, oldest first.
  const std::deque<std::pair<std::string, std::vector<Event>>>& steps() const { return steps_; }

 private:
  int64_t max_steps_;
  std::deque<std::pair<std::string, std::vector<Event>>> steps_;
};

// This thread's recorder (a rank: ranks may be threads of one process); nullptr: tracing off.
Recorder* active();
void set_active(Recorder* recorder);

int64_t ns(SteadyClock::time_point t);
// A span of this thread's recorder, if any.
inline void add(const char* name, const char* part, SteadyClock::time_point t0, SteadyClock::time_point t1,
                int track = kMain, int layer = -1, int nano = -1) {
  if (Recorder* r = active()) r->add(Event{name, part, track, layer, nano, ns(t0), ns(t1)});
}

// Runs fn, adds its seconds to `seconds` and its span to the recorder; returns what fn returns.
template <typename Fn>
auto timed_span(double& seconds, const char* name, const char* part, int layer, int nano, Fn&& fn) {
  const auto t = SteadyClock::now();
  auto result = std::forward<Fn>(fn)();
  const auto e = SteadyClock::now();
  seconds += std::chrono::duration<double>(e - t).count();
  add(name, part, t, e, kMain, layer, nano);
  return result;
}

// A span from construction to destruction (when tracing is on at construction).
class Scope {
 public:
  Scope(const char* name, const char* part, int layer = -1, int nano = -1)
      : name_(name), part_(part), layer_(layer), nano_(nano), is_on_(active() != nullptr) {
    if (is_on_) start_ = SteadyClock::now();
  }
  ~Scope() {
    if (is_on_) add(name_, part_, start_, SteadyClock::now(), kMain, layer_, nano_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  const char* part_;
  int layer_, nano_;
  bool is_on_;
  SteadyClock::time_point start_{};
};

// Every rank's recorder as its steps() serialized (to_json), rank by rank -> the trace
// document: a process a rank, a thread a track, microseconds from the earliest span.
nlohmann::json to_json(const Recorder& r);
nlohmann::json chrome_trace(const std::vector<nlohmann::json>& ranks, const nlohmann::json& meta);

}  // namespace distca::trace
