#include "distca/plan/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>

namespace distca::plan {
namespace {

constexpr int kMaxStages = 1024;
constexpr int kMaxMicroBatches = 1 << 16;

Status check_sizes(int stages, int micro_batches) {
  if (stages < 1 || stages > kMaxStages) return invalid_argument(fmt::format("--pp must be 1..{}, got {}", kMaxStages, stages));
  if (micro_batches < 1 || micro_batches > kMaxMicroBatches) {
    return invalid_argument(fmt::format("--micro-batches must be 1..{}, got {}", kMaxMicroBatches, micro_batches));
  }
  return Status::ok();
}

std::string token(const PipeSlot& s) {
  if (s.op == PipeOp::kIdle) return ".";
  return fmt::format("{}{}", s.op == PipeOp::kForward ? 'F' : 'B', s.micro_batch);
}

}  // namespace

std::string PipelineSchedule::to_text() const {
  size_t width = 1;
  for (const auto& tick : ticks) {
    for (const PipeSlot& s : tick) width = std::max(width, token(s).size());
  }
  std::string out;
  for (int r = 0; r < stages; ++r) {
    out += fmt::format("stage {:>{}}:", r, fmt::formatted_size("{}", stages - 1));
    for (const auto& tick : ticks) out += fmt::format(" {:<{}}", token(tick[r]), width);
    while (!out.empty() && out.back() == ' ') out.pop_back();
    out += '\n';
  }
  return out;
}

int PipelineSchedule::idle_ticks(int stage) const {
  int idle = 0;
  for (const auto& tick : ticks) idle += tick[stage].op == PipeOp::kIdle ? 1 : 0;
  return idle;
}

Result<PipelineSchedule> colocated_schedule(int P, int M) {
  DISTCA_RETURN_IF_ERROR(check_sizes(P, M));
  // Each stage's own order of operations.
  std::vector<std::vector<PipeSlot>> order(P);
  for (int r = 0; r < P; ++r) {
    const int warm = std::min(P - 1 - r, M);
    for (int m = 0; m < warm; ++m) order[r].push_back({PipeOp::kForward, m});
    for (int i = 0; i < M - warm; ++i) {
      order[r].push_back({PipeOp::kForward, warm + i});
      order[r].push_back({PipeOp::kBackward, i});
    }
    for (int m = M - warm; m < M; ++m) order[r].push_back({PipeOp::kBackward, m});
  }
  // Each op at the first tick its input is there: done_f[r][m] / done_b[r][m] = the tick it ran.
  std::vector<std::vector<int>> done_f(P, std::vector<int>(M, -1)), done_b = done_f;
  std::vector<size_t> next(P, 0);
  PipelineSchedule s{"colocated", P, M, {}};
  for (int t = 0;; ++t) {
    bool is_left = false;
    std::vector<PipeSlot> tick(P);
    for (int r = 0; r < P; ++r) {
      if (next[r] == order[r].size()) continue;
      is_left = true;
      const PipeSlot op = order[r][next[r]];
      const int m = op.micro_batch;
      auto before = [t](int when) { return when >= 0 && when < t; };
      const bool ready = op.op == PipeOp::kForward ? (r == 0 || before(done_f[r - 1][m]))
                                                   : (r == P - 1 ? before(done_f[r][m]) : before(done_b[r + 1][m]));
      if (!ready) continue;
      tick[r] = op;
      (op.op == PipeOp::kForward ? done_f : done_b)[r][m] = t;
      ++next[r];
    }
    if (!is_left) break;
    s.ticks.push_back(std::move(tick));
  }
  return s;
}

Result<PipelineSchedule> cad_schedule(int P, int M) {
  DISTCA_RETURN_IF_ERROR(check_sizes(P, M));
  PipelineSchedule s{"cad", P, M, {}};
  auto forward = [&](int t) {
    std::vector<PipeSlot> tick(P);
    for (int r = 0; r < P; ++r) {
      if (const int m = t - r; m >= 0 && m < M) tick[r] = {PipeOp::kForward, m};
    }
    s.ticks.push_back(std::move(tick));
  };
  auto backward = [&](int u) {
    std::vector<PipeSlot> tick(P);
    for (int r = 0; r < P; ++r) {
      if (const int m = u - (P - 1 - r); m >= 0 && m < M) tick[r] = {PipeOp::kBackward, m};
    }
    s.ticks.push_back(std::move(tick));
  };
  for (int t = 0; t < P - 1; ++t) forward(t);
  for (int i = 0; i < M; ++i) {
    forward(P - 1 + i);
    backward(i);
  }
  for (int u = M; u < M + P - 1; ++u) backward(u);
  return s;
}

Result<PipelineSchedule> pipeline_schedule(const std::string& name, int stages, int micro_batches) {
  if (name == "colocated") return colocated_schedule(stages, micro_batches);
  if (name == "cad") return cad_schedule(stages, micro_batches);
  return invalid_argument(fmt::format("no pipeline schedule '{}' (colocated or cad)", name));
}

Status check_schedule(const PipelineSchedule& s, bool lockstep) {
  const int P = s.stages, M = s.micro_batches;
  std::vector<std::vector<int>> f(P, std::vector<int>(M, -1)), b = f;
  for (size_t t = 0; t < s.ticks.size(); ++t) {
    if (static_cast<int>(s.ticks[t].size()) != P) return internal_error(fmt::format("tick {} has {} stages, not {}", t, s.ticks[t].size(), P));
    bool has_f = false, has_b = false;
    for (int r = 0; r < P; ++r) {
      const PipeSlot& x = s.ticks[t][r];
      if (x.op == PipeOp::kIdle) continue;
      if (x.micro_batch < 0 || x.micro_batch >= M) return internal_error(fmt::format("tick {} stage {}: micro-batch {}", t, r, x.micro_batch));
      auto& when = (x.op == PipeOp::kForward ? f : b)[r][x.micro_batch];
      if (when >= 0) return internal_error(fmt::format("stage {} runs {} twice (ticks {} and {})", r, token(x), when, t));
      when = static_cast<int>(t);
      (x.op == PipeOp::kForward ? has_f : has_b) = true;
    }
    if (lockstep && has_f && has_b) return internal_error(fmt::format("tick {} mixes forwards and backwards", t));
  }
  for (int r = 0; r < P; ++r) {
    for (int m = 0; m < M; ++m) {
      if (f[r][m] < 0 || b[r][m] < 0) return internal_error(fmt::format("stage {} never runs micro-batch {} {}", r, m, f[r][m] < 0 ? "forward" : "backward"));
      if (r > 0 && f[r][m] <= f[r - 1][m]) return internal_error(fmt::format("stage {} runs F{} before its input", r, m));
      if (b[r][m] <= f[r][m]) return internal_error(fmt::format("stage {} runs B{} before F{}", r, m, m));
      if (r + 1 < P && b[r][m] <= b[r + 1][m]) return internal_error(fmt::format("stage {} runs B{} before its gradient", r, m));
    }
  }
  return Status::ok();
}

}  // namespace distca::plan
