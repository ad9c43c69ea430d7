"""distca.pipeline_schedule: a pipeline's tick table, the C++ trainer's (plan/pipeline_schedule.h).

    s = distca.pipeline_schedule("cad", stages=2, micro_batches=4)
    s.slot(tick, stage)   # ("F", 0), ("B", 3) or ("", None): idle
    print(s.text)         # one line per stage: F0 F1 B0 ...

"colocated" is plain 1F1B, each stage on its own clock; "cad" is the paper's lockstep: P - 1
warm-up forward ticks, M steady [forward, backward] pairs, P - 1 cool-down backward ticks, every
stage in the same direction in a tick, so that the core attention of every (stage, micro-batch)
of a tick is planned together and served by all ranks, idle stages included.
"""
from __future__ import annotations

from dataclasses import dataclass
from . import _distca
from .arguments import integer_arg, string_arg

SCHEDULE_NAMES = ("colocated", "cad")


@dataclass(frozen=True)
class PipelineSchedule:
    """Which micro-batch each stage runs, forward or backward, in each tick."""
    name: str
    stages: int
    micro_batches: int
    ticks: tuple   # [tick][stage] of (op, micro_batch): op "F", "B" or "" (idle, micro_batch None)
    text: str      # one line per stage, a token per tick: "F3", "B0", "." idle

    def slot(self, tick: int, stage: int) -> tuple:
        """(op, micro_batch) of a stage in a tick: ("F", m), ("B", m) or ("", None)."""
        return self.ticks[tick][stage]

    def idle_ticks(self, stage: int) -> int:
        """How many ticks a stage has no micro-batch of its own (its bubble, in ticks)."""
        return sum(1 for tick in self.ticks if not tick[stage][0])

    def direction(self, tick: int) -> str:
        """"F" or "B": what every busy stage of a lockstep tick runs (ValueError for a colocated
        tick that mixes both, or one where every stage idles)."""
        ops = {op for op, _ in self.ticks[tick] if op}
        if len(ops) != 1:
            raise ValueError(f"tick {tick} of the {self.name} schedule runs {sorted(ops) or 'nothing'}, not one direction")
        return ops.pop()


def pipeline_schedule(name: str, stages: int, micro_batches: int) -> PipelineSchedule:
    """The tick table of schedule `name` ("colocated" or "cad") for `stages` >= 1 pipeline stages
    and `micro_batches` >= 1 micro-batches, as the C++ trainer walks it. Bad arguments raise
    ValueError (TypeError for a non-integer size)."""
    name = string_arg(name, "name")
    stages, micro_batches = integer_arg(stages, "stages", 32), integer_arg(micro_batches, "micro_batches", 32)
    try:
        ticks, text = _distca.pipeline_schedule(name, stages, micro_batches)
    except ValueError as e:
        raise ValueError(str(e).replace("--pp ", "stages ").replace("--micro-batches ", "micro_batches ")) from None
    table = tuple(tuple((op, m if op else None) for op, m in tick) for tick in ticks)
    return PipelineSchedule(name, stages, micro_batches, table, text)

