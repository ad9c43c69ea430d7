// Pipeline schedules as plain data (issue 18): which micro-batch each stage runs, forward or
// backward, in each tick, for P stages and M micro-batches. A tick is one unit of work of a
// stage (one micro-batch through its layers, forward or backward); the training loop walks the
// table, and tests compare it with hand-written ones.
//
//   colocated  plain 1F1B (PipeDream-Flush, Megatron's default): stage r runs min(P - 1 - r, M)
//              forwards, then alternates one forward and one backward, then the backwards left.
//              Each op starts at the first tick its input is there: F(r, m) after F(r - 1, m),
//              B(r, m) after B(r + 1, m) (after F(P - 1, m) on the last stage), one op per stage
//              per tick. Each stage attends its own micro-batch.
//   cad        the lockstep ticks of the paper's system: P - 1 warm-up forward ticks, M steady
//              [forward, backward] pairs, P - 1 cool-down backward ticks. In forward tick t
//              stage r runs micro-batch t - r, in backward tick u micro-batch u - (P - 1 - r)
//              (none when outside [0, M)). Every stage is in the same phase in a tick, so the
//              core attention of every active (stage, micro-batch) of the tick is planned
//              together and served by all ranks, idle stages included.
#pragma once

#include <string>
#include <vector>

#include "distca/core/status.h"

namespace distca::plan {

enum class PipeOp { kIdle, kForward, kBackward };

struct PipeSlot {
  PipeOp op = PipeOp::kIdle;
  int micro_batch = -1;  // -1 when idle
  bool operator==(const PipeSlot&) const = default;
};

struct PipelineSchedule {
  std::string name;  // "colocated" or "cad"
  int stages = 0;
  int micro_batches = 0;
  std::vector<std::vector<PipeSlot>> ticks;  // [tick][stage]

  // One line per stage, a token per tick: "F3" forward of micro-batch 3, "B0", "." idle.
  std::string to_text() const;
  // How many ticks stage r idles (its bubble, in ticks).
  int idle_ticks(int stage) const;
};

// P >= 1 stages, M >= 1 micro-batches; else kInvalidArgument naming the flag (--pp,
// --micro-batches).
Result<PipelineSchedule> colocated_schedule(int stages, int micro_batches);
Result<PipelineSchedule> cad_schedule(int stages, int micro_batches);
// By name ("colocated" or "cad").
Result<PipelineSchedule> pipeline_schedule(const std::string& name, int stages, int micro_batches);

// Every stage runs every micro-batch forward once and backward once, each after its inputs:
// F(r, m) in a later tick than F(r - 1, m), B(r, m) later than B(r + 1, m) and than F(r, m).
// With `lockstep`, no tick mixes forwards and backwards. OK, or what is wrong.
Status check_schedule(const PipelineSchedule& s, bool lockstep);

}  // namespace distca::plan
