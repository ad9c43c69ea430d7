#include "distca/core/trace.h"

#include <algorithm>
#include <limits>

namespace distca::trace {

namespace {
thread_local Recorder* active_recorder = nullptr;
constexpr const char* kTracks[] = {"main", "exchange"};
}  // namespace

Recorder* active() { return active_recorder; }
void set_active(Recorder* recorder) { active_recorder = recorder; }

int64_t ns(SteadyClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

void Recorder::begin_step(std::string label) {
  steps_.emplace_back(std::move(label), std::vector<Event>{});
  while (static_cast<int64_t>(steps_.size()) > max_steps_) steps_.pop_front();
}

void Recorder::add(const Event& e) {
  if (!steps_.empty()) steps_.back().second.push_back(e);
}

nlohmann::json to_json(const Recorder& r) {
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& [label, events] : r.steps()) {
    nlohmann::json list = nlohmann::json::array();
    for (const Event& e : events) list.push_back({e.name, e.part, e.track, e.layer, e.nano, e.start_ns, e.end_ns});
    steps.push_back({{"step", label}, {"events", std::move(list)}});
  }
  return steps;
}

nlohmann::json chrome_trace(const std::vector<nlohmann::json>& ranks, const nlohmann::json& meta) {
  int64_t origin = std::numeric_limits<int64_t>::max();
  for (const nlohmann::json& steps : ranks) {
    for (const auto& s : steps) {
      for (const auto& e : s["events"]) origin = std::min(origin, e[5].get<int64_t>());
    }
  }
  nlohmann::json out = nlohmann::json::array();
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const int pid = static_cast<int>(rank);
    out.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
    out.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"tid", 0}, {"args", {{"sort_index", pid}}}});
    for (int tid = 0; tid < 2; ++tid) {
      out.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", kTracks[tid]}}}});
    }
    for (const auto& s : ranks[rank]) {
      for (const auto& e : s["events"]) {
        const int track = e[2].get<int>();
        nlohmann::json args = {{"step", s["step"]}};
        if (!e[1].get<std::string>().empty()) args["part"] = e[1];
        if (e[3].get<int>() >= 0) args["layer"] = e[3];
        if (e[4].get<int>() >= 0) args["nano"] = e[4];
        const int64_t start = e[5].get<int64_t>(), end = e[6].get<int64_t>();
        out.push_back({{"name", e[0]}, {"cat", kTracks[track == kExchange ? 1 : 0]}, {"ph", "X"}, {"pid", pid}, {"tid", track},
                       {"ts", static_cast<double>(start - origin) / 1e3}, {"dur", static_cast<double>(end - start) / 1e3},
                       {"args", std::move(args)}});
      }
    }
  }
  nlohmann::json other = meta;
  other["format"] = "distca-trace";
  other["version"] = 1;
  return {{"traceEvents", std::move(out)}, {"displayTimeUnit", "ms"}, {"otherData", std::move(other)}};
}

}  // namespace distca::trace
