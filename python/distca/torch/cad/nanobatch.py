"""Ping-pong's two nano-batches: split_plan divides one plan's tasks between them (issue 54, "one
plan, split"), split_tasks returns just the two task lists.

The split is C++ (layout::split_attention_tasks, src/layout/include/distca/layout/task_split.h,
through _distca): it divides only the attention tasks, since PyTorch runs the user's linear
layers on the whole step's rows. That header says what a split keeps (each nano-batch moves the
plan's bytes, but for K/V rows sent twice within `kv_budget`), how it balances every server's
pairs between the two (cap, level), and what holds. This module checks the arguments' types and
converts the arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import distca
from distca import _distca
from distca.arguments import number_arg

from .agreement import describe

KV_BUDGET = _distca.task_split_kv_budget   # ping-pong may move at most 1.05x the plan's bytes (issue 54)


@dataclass
class NanoSplit:
    """Two nano-batches of one plan (see the module docstring): `parts` holds one task array
    (TASK_DTYPE) per nano-batch, or one with every task where there is nothing to split."""
    parts: tuple
    cap: float                     # pairs: (1 + tolerance) x the plan's busiest server / 2
    level: float                   # pairs every server's halves are cut to (cap, or above where the budget ran out)
    num_cuts: int                  # tasks cut in two at a query row
    extra_kv_rows: int             # K/V rows that travel twice because of the cuts
    remote_kv_rows: int            # K/V rows the whole plan moves between ranks
    travel_rows: tuple = ()        # per nano-batch (Q rows, K/V rows) sent between ranks: cad_attention orders
                                   # its nano-batches by them (attention.py)
    busiest: tuple = (0.0, 0.0)    # pairs of each nano-batch's busiest server (their sum against the plan's: the
                                   # attention stages' length against the unsplit one's)
    over: list = field(default_factory=list)   # servers whose heavier half stays above cap


def split_tasks(tasks: np.ndarray, batch: Any, *, tolerance: float = 0.0,
                kv_budget: float = KV_BUDGET) -> tuple:
    """The plan's tasks as two nano-batches (split_plan(...).parts): two TASK_DTYPE arrays, each
    in plan order, or one (all tasks) when there is nothing to split."""
    return split_plan(tasks, batch, tolerance=tolerance, kv_budget=kv_budget).parts


def split_plan(tasks: np.ndarray, batch: Any, *, tolerance: float = 0.0, kv_budget: float = KV_BUDGET) -> NanoSplit:
    """Splits a plan's tasks (Plan.tasks of `batch`, its tolerance) into two nano-batches: every
    server's pairs balanced between them within (1 + tolerance) x half the busiest server's, the
    tasks sharing K/V rows on a server kept together unless a cut is free or fits `kv_budget` (a
    share of the plan's travelling K/V rows). See the module docstring for what holds. Bad
    arguments raise TypeError / ValueError naming the first fault."""
    matrix, tolerance, kv_budget = _checked(tasks, batch, tolerance, kv_budget)
    s = _distca.split_attention_tasks(batch, matrix, tolerance, kv_budget)
    parts = (tasks,) if len(s["parts"]) == 1 else tuple(
        np.ascontiguousarray(p).view(distca.TASK_DTYPE).reshape(-1) for p in s["parts"])
    return NanoSplit(parts=parts, cap=s["cap"], level=s["level"], num_cuts=s["num_cuts"],
                     extra_kv_rows=s["extra_kv_rows"], remote_kv_rows=s["remote_kv_rows"],
                     travel_rows=s["travel_rows"], busiest=s["busiest"], over=s["over"])


def _checked(tasks: Any, batch: Any, tolerance: Any, kv_budget: Any) -> tuple:
    """split_plan's arguments' types checked (TypeError / ValueError naming the first fault; their
    values are checked in C++) -> (the tasks as an (n, 6) int64 matrix, tolerance, kv_budget)."""
    if not isinstance(batch, distca.Batch):
        raise TypeError(f"batch must be a distca.Batch (the plan's batch, Plan.batch), got {describe(batch)}")
    tolerance = number_arg(tolerance, "tolerance")
    kv_budget = number_arg(kv_budget, "kv_budget")
    names: tuple = distca.TASK_DTYPE.names or ()
    if not isinstance(tasks, np.ndarray) or tasks.dtype.names is None or tasks.ndim != 1:
        got = f"an array of {tasks.dtype}, shape {tasks.shape}" if isinstance(tasks, np.ndarray) else describe(tasks)
        raise TypeError(f"tasks must be a one-dimensional array of distca.TASK_DTYPE (Plan.tasks), got {got}")
    for name in names:
        if name not in tasks.dtype.names:
            raise ValueError(f"tasks: no field {name!r} (distca.TASK_DTYPE: {', '.join(names)})")
        if tasks.dtype[name].kind not in "iu":
            raise TypeError(f"tasks: field {name!r} must hold integers, got {tasks.dtype[name]}")
    matrix = np.stack([tasks[name].astype(np.int64) for name in names], axis=1)
    return matrix, tolerance, kv_budget
