#include "distca/runtime/pingpong.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>

#include "distca/core/stopwatch.h"

namespace distca::runtime {

namespace {

using Clock = SteadyClock;

// Adds fn's time to `seconds` and to the nano-batch's own counter.
Status timed(const std::function<Status()>& fn, double& seconds, double& nano_seconds) {
  if (!fn) return Status::ok();
  const auto t = Clock::now();
  Status st = fn();
  const double s = seconds_since(t);
  seconds += s;
  nano_seconds += s;
  return st;
}

Status check_chains(const std::vector<Stage>& a, const std::vector<Stage>& b) {
  if (a.size() != b.size()) {
    return invalid_argument(fmt::format("ping-pong: the nano-batches have {} and {} stages; they must match",
                                        a.size(), b.size()));
  }
  for (const auto* chain : {&a, &b}) {
    for (const Stage& s : *chain) {
      if (!s.compute || static_cast<bool>(s.start_comm) != static_cast<bool>(s.finish_comm)) {
        return invalid_argument("ping-pong: every stage computes, and starts and finishes its communication together");
      }
    }
  }
  return Status::ok();
}

// Every stage computed once, in chain order, after the previous stage's communication finished;
// every communication started after its compute and finished once.
Status check_schedule(const std::vector<ScheduleOp>& schedule, int stages) {
  std::array<std::vector<int>, 2> state;  // per stage: 0 nothing, 1 computed, 2 started, 3 finished
  for (auto& s : state) s.assign(static_cast<size_t>(stages), 0);
  for (const ScheduleOp& op : schedule) {
    if (op.nano < 0 || op.nano > 1 || op.stage < 0 || op.stage >= stages) {
      return invalid_argument(fmt::format("schedule: no stage {} of nano-batch {}", op.stage, op.nano));
    }
    int& at = state[op.nano][op.stage];
    const int want = op.kind == OpKind::kCompute ? 0 : op.kind == OpKind::kStart ? 1 : 2;
    const bool ready = op.kind != OpKind::kCompute || op.stage == 0 || state[op.nano][op.stage - 1] == 3;
    if (at != want || !ready) {
      return invalid_argument(fmt::format("schedule: stage {} of nano-batch {} out of order", op.stage, op.nano));
    }
    at = want + 1;
  }
  for (const auto& s : state) {
    for (int i = 0; i < stages; ++i) {
      if (s[i] != 3) return invalid_argument(fmt::format("schedule: stage {} is not run to its end", i));
    }
  }
  return Status::ok();
}

}  // namespace

std::vector<ScheduleOp> sequential_schedule(int stages, int b_leads_from) {
  const int turn = b_leads_from < 0 || b_leads_from > stages ? stages : b_leads_from;
  std::vector<ScheduleOp> out;
  auto chain = [&](int n, int from, int to) {
    for (int i = from; i < to; ++i) {
      for (OpKind k : {OpKind::kCompute, OpKind::kStart, OpKind::kFinish}) out.push_back({k, n, i});
    }
  };
  chain(0, 0, turn);
  chain(1, 0, turn);
  chain(1, turn, stages);
  chain(0, turn, stages);
  return out;
}

std::vector<ScheduleOp> pingpong_schedule(int stages, int b_leads_from) {
  const int turn = b_leads_from < 0 || b_leads_from > stages ? stages : b_leads_from;
  std::vector<ScheduleOp> out;
  for (int i = 0; i < stages; ++i) {
    const int first = i < turn ? 0 : 1;
    for (int n : {first, 1 - first}) {
      if (i > 0) out.push_back({OpKind::kFinish, n, i - 1});
      out.push_back({OpKind::kCompute, n, i});
      out.push_back({OpKind::kStart, n, i});
    }
  }
  if (stages > 0) {
    const int first = stages - 1 < turn ? 0 : 1;
    out.push_back({OpKind::kFinish, first, stages - 1});
    out.push_back({OpKind::kFinish, 1 - first, stages - 1});
  }
  return out;
}

std::vector<ComputeOverlap> overlaps(const std::vector<ScheduleOp>& schedule) {
  std::vector<std::pair<int, int>> in_flight;
  std::vector<ComputeOverlap> out;
  for (const ScheduleOp& op : schedule) {
    const std::pair<int, int> me{op.nano, op.stage};
    if (op.kind == OpKind::kStart) in_flight.push_back(me);
    if (op.kind == OpKind::kFinish) std::erase(in_flight, me);
    if (op.kind == OpKind::kCompute) out.push_back({op.nano, op.stage, in_flight});
  }
  return out;
}

std::vector<std::string> describe(const std::vector<ScheduleOp>& schedule, const std::vector<Stage>& a,
                                  const std::vector<Stage>& b) {
  auto chain = [&](int n) -> const std::vector<Stage>& { return n == 0 ? a : b; };
  auto label = [](int n) { return n == 0 ? "A" : "B"; };
  std::vector<std::string> out;
  for (const ComputeOverlap& c : overlaps(schedule)) {
    std::string line = fmt::format("{} {}", label(c.nano), chain(c.nano).at(c.stage).name);
    std::vector<std::string> flying;
    for (auto [n, i] : c.in_flight) {
      if (chain(n).at(i).start_comm) flying.push_back(fmt::format("{} {}", label(n), chain(n).at(i).comm_name));
    }
    line += flying.empty() ? " | nothing in flight" : fmt::format(" | in flight: {}", fmt::join(flying, ", "));
    out.push_back(line);
  }
  return out;
}

Result<ScheduleTiming> run_schedule(const std::vector<ScheduleOp>& schedule, std::vector<Stage>& a,
                                    std::vector<Stage>& b) {
  DISTCA_RETURN_IF_ERROR(check_chains(a, b));
  DISTCA_RETURN_IF_ERROR(check_schedule(schedule, static_cast<int>(a.size())));
  ScheduleTiming t;
  const auto start = Clock::now();
  for (const ScheduleOp& op : schedule) {
    Stage& s = (op.nano == 0 ? a : b)[op.stage];
    switch (op.kind) {
      case OpKind::kCompute:
        DISTCA_RETURN_IF_ERROR(timed(s.compute, t.compute_seconds, t.nano_compute_seconds[op.nano]));
        break;
      case OpKind::kStart:
        DISTCA_RETURN_IF_ERROR(timed(s.start_comm, t.comm_seconds, t.nano_comm_seconds[op.nano]));
        break;
      case OpKind::kFinish:
        DISTCA_RETURN_IF_ERROR(timed(s.finish_comm, t.comm_seconds, t.nano_comm_seconds[op.nano]));
        break;
    }
  }
  t.seconds = seconds_since(start);
  return t;
}

Result<ScheduleTiming> run_sequential(std::vector<Stage>& a, std::vector<Stage>& b, int b_leads_from) {
  return run_schedule(sequential_schedule(static_cast<int>(a.size()), b_leads_from), a, b);
}

Result<ScheduleTiming> run_pingpong(std::vector<Stage>& a, std::vector<Stage>& b, int b_leads_from) {
  return run_schedule(pingpong_schedule(static_cast<int>(a.size()), b_leads_from), a, b);
}

ProgressThread::ProgressThread(std::function<Status()> poll, std::chrono::microseconds interval)
    : poll_(std::move(poll)), interval_(interval) {
  thread_ = std::thread([this] {
    while (!stop_.load(std::memory_order_relaxed)) {
      Status st = poll_();
      polls_.fetch_add(1, std::memory_order_relaxed);
      if (!st.is_ok()) {
        error_ = std::move(st);
        return;
      }
      std::this_thread::sleep_for(interval_);
    }
  });
}

Status ProgressThread::stop() {
  if (thread_.joinable()) {
    stop_.store(true);
    thread_.join();
  }
  return error_;
}

ProgressThread::~ProgressThread() { (void)stop(); }

}  // namespace distca::runtime
