"""Spans of distca.torch's phases: marked for the user's own profiler, and kept for a trace file.

Every span is a `torch.profiler.record_function` range (and an NVTX range on CUDA), so the
phases appear in a user's `torch.profiler` trace or Nsight Systems timeline under their names.
While a Tracer is active (the trainer's `--trace FILE`), the spans are also kept, on this rank's
tracks ("main": the step's phases, the attention calls and the server kernels; "exchange": each
all-to-all from posted to completed), the last `steps` steps' worth, and written as Chrome
trace-event JSON (one process a rank; opens in Perfetto and chrome://tracing).

Times are time.perf_counter_ns(): one clock for every process of a machine. Ranks on other
machines are aligned at the first step's start (after its barrier, the same instant everywhere).
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Iterator, Optional

import torch

TRACKS = ("main", "exchange")
FORMAT = "distca-trace"


class Tracer:
    """The spans of the last `steps` steps of this rank (a step: begin_step .. the next one)."""

    def __init__(self, rank: int, steps: int):
        self.rank = rank
        self._steps: collections.deque = collections.deque(maxlen=max(int(steps), 1))
        self._events: Optional[list] = None
        self.origin_ns: Optional[int] = None   # the first step's start

    def begin_step(self, label: str, start_ns: int) -> None:
        if self.origin_ns is None:
            self.origin_ns = start_ns
        self._events = []
        self._steps.append((label, self._events))

    def add(self, name: str, start_ns: int, end_ns: int, track: str = "main", **args: Any) -> None:
        if self._events is not None:
            self._events.append((name, start_ns, end_ns, track, args))

    def events(self) -> list:
        """(step label, name, start_ns, end_ns, track, args) of the steps kept, oldest first."""
        return [(label, *e) for label, events in self._steps for e in events]


_active: Optional[Tracer] = None


def activate(tracer: Optional[Tracer]) -> None:
    global _active
    _active = tracer


def active() -> Optional[Tracer]:
    return _active


def now() -> int:
    return time.perf_counter_ns()


@contextlib.contextmanager
def span(name: str, track: str = "main", keep: bool = True, **args: Any) -> Iterator[None]:
    """A phase: a record_function range (NVTX too on CUDA) and, under a Tracer, a kept span (keep
    False: the caller keeps it with interval(), timed by the clock readings its record uses)."""
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    start = now()
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if keep and _active is not None:
            _active.add(name, start, now(), track, **args)
        if nvtx:
            torch.cuda.nvtx.range_pop()


def interval(name: str, start_ns: int, end_ns: int, track: str = "main", **args: Any) -> None:
    """A span measured by the caller (an exchange, from its post to its completion)."""
    if _active is not None:
        _active.add(name, start_ns, end_ns, track, **args)


def chrome_trace(ranks: list, meta: dict) -> dict:
    """Every rank's Tracer.events() and origin (as gathered: [(origin_ns, events)] by rank) ->
    a Chrome trace-event document: process = rank, thread = track, microseconds from rank 0's
    first step."""
    out: list = []
    base = ranks[0][0] or 0
    for rank, (origin, events) in enumerate(ranks):
        shift = base - (origin if origin is not None else base)   # this rank's first step onto rank 0's
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, track in enumerate(TRACKS):
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for label, name, start, end, track, args in events:
            out.append({"name": name, "cat": track, "ph": "X", "pid": rank, "tid": TRACKS.index(track),
                        "ts": (start + shift - base) / 1e3, "dur": (end - start) / 1e3,
                        "args": {"step": label, **args}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"format": FORMAT, "version": 1, **meta}}
