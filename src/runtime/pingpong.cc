#include "distca/runtime/pingpong.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "distca/core/stopwatch.h"
#include "distca/plan/cost.h"

namespace distca::runtime {

Result<NanoBatches> split_nano_batches(const plan::Batch& batch) {
  DISTCA_RETURN_IF_ERROR(batch.validate());
  const int32_t num_docs = batch.num_docs();
  std::vector<int32_t> order(num_docs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return batch.doc_lengths[a] > batch.doc_lengths[b]; });
  std::vector<int> nano_of(num_docs, 0);
  std::array<int64_t, 2> pairs{0, 0}, tokens{0, 0};
  for (int32_t doc : order) {
    const int64_t len = batch.doc_lengths[doc];
    const int n = std::tie(pairs[1], tokens[1]) < std::tie(pairs[0], tokens[0]) ? 1 : 0;
    nano_of[doc] = n;
    pairs[n] += plan::causal_pairs(0, len);
    tokens[n] += len;
  }

  // Piece rows in the micro-batch's linear layout.
  std::vector<int64_t> piece_row(batch.pieces.size());
  std::vector<int64_t> rank_rows(batch.num_ranks, 0);
  for (size_t i = 0; i < batch.pieces.size(); ++i) {
    piece_row[i] = rank_rows[batch.pieces[i].rank];
    rank_rows[batch.pieces[i].rank] += batch.pieces[i].length();
  }

  NanoBatches out;
  std::vector<int32_t> new_id(num_docs, -1);
  for (int32_t doc = 0; doc < num_docs; ++doc) {
    const int n = nano_of[doc];
    new_id[doc] = static_cast<int32_t>(out.docs[n].size());
    out.docs[n].push_back(doc);
  }
  for (int n = 0; n < 2; ++n) {
    plan::Batch& b = out.batches[n];
    b.num_ranks = batch.num_ranks;
    for (int32_t doc : out.docs[n]) b.doc_lengths.push_back(batch.doc_lengths[doc]);
    out.rows[n].assign(batch.num_ranks, {});
  }
  for (size_t i = 0; i < batch.pieces.size(); ++i) {  // by rank, then position: the order kept
    const plan::Piece& p = batch.pieces[i];
    const int n = nano_of[p.doc];
    out.batches[n].pieces.push_back(plan::Piece{new_id[p.doc], p.begin, p.end, p.rank});
    for (int64_t r = 0; r < p.length(); ++r) out.rows[n][p.rank].push_back(piece_row[i] + r);
  }
  for (int n = 0; n < 2; ++n) {
    plan::Batch& b = out.batches[n];
    int64_t most = 1;
    for (const auto& rows : out.rows[n]) most = std::max<int64_t>(most, static_cast<int64_t>(rows.size()));
    b.tokens_per_rank = most;
    b.index();
    DISTCA_RETURN_IF_ERROR(b.validate());
  }
  return out;
}

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

std::vector<ScheduleOp> sequential_schedule(int stages) {
  std::vector<ScheduleOp> out;
  for (int n = 0; n < 2; ++n) {
    for (int i = 0; i < stages; ++i) {
      for (OpKind k : {OpKind::kCompute, OpKind::kStart, OpKind::kFinish}) out.push_back({k, n, i});
    }
  }
  return out;
}

std::vector<ScheduleOp> pingpong_schedule(int stages) {
  std::vector<ScheduleOp> out;
  for (int i = 0; i < stages; ++i) {
    for (int n = 0; n < 2; ++n) {
      if (i > 0) out.push_back({OpKind::kFinish, n, i - 1});
      out.push_back({OpKind::kCompute, n, i});
      out.push_back({OpKind::kStart, n, i});
    }
  }
  if (stages > 0) {
    out.push_back({OpKind::kFinish, 0, stages - 1});
    out.push_back({OpKind::kFinish, 1, stages - 1});
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

Result<ScheduleTiming> run_sequential(std::vector<Stage>& a, std::vector<Stage>& b) {
  return run_schedule(sequential_schedule(static_cast<int>(a.size())), a, b);
}

Result<ScheduleTiming> run_pingpong(std::vector<Stage>& a, std::vector<Stage>& b) {
  return run_schedule(pingpong_schedule(static_cast<int>(a.size())), a, b);
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
