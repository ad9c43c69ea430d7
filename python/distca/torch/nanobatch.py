"""Ping-pong's two nano-batches: split_tasks divides a plan's tasks between them, each server's
causal pairs balanced, the tasks of a key-split row kept together.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import distca

from .agreement import _describe


def split_tasks(tasks: np.ndarray, num_ranks: int) -> tuple:
    """The plan's tasks in two nano-batches, each server's causal pairs balanced between them.
    Tasks whose query rows overlap (a row's key splits, which may come from tasks of different
    query ranges) stay together, so a row is merged, and its dQ summed, within one nano-batch.
    Greedy, largest group first: a group goes to the side where the busiest of its servers ends
    up lighter (ties: the lighter side overall). Returns two index arrays into `tasks` (each in
    plan order), or one (all tasks) when there are fewer than two such groups."""
    num_ranks = _checked_tasks(tasks, num_ranks)
    group_of = _row_groups(tasks)
    num_groups = int(group_of.max()) + 1 if len(group_of) else 0
    if num_groups < 2:
        return (np.arange(len(tasks)),)
    pairs = _task_pairs(tasks)
    # Each group's cost per server it uses, as flat lists (groups in order).
    key = group_of * num_ranks + tasks["server"].astype(np.int64)
    cells, inverse = np.unique(key, return_inverse=True)
    cost = np.bincount(inverse, weights=pairs).tolist()
    servers = (cells % num_ranks).tolist()
    bounds = np.searchsorted(cells // num_ranks, np.arange(num_groups + 1)).tolist()
    totals_by_group = np.bincount(group_of, weights=pairs, minlength=num_groups)
    order = np.lexsort((np.arange(num_groups), -totals_by_group)).tolist()
    loads = ([0.0] * num_ranks, [0.0] * num_ranks)
    totals = [0.0, 0.0]
    side_of = np.zeros(num_groups, dtype=np.int64)
    for g in order:
        cells_g = range(bounds[g], bounds[g + 1])
        after = [max(loads[side][servers[c]] + cost[c] for c in cells_g) for side in (0, 1)]
        side = 0 if (after[0], totals[0]) <= (after[1], totals[1]) else 1
        for c in cells_g:
            loads[side][servers[c]] += cost[c]
        totals[side] += totals_by_group[g]
        side_of[g] = side
    part_of = side_of[group_of]
    a, b = np.flatnonzero(part_of == 0), np.flatnonzero(part_of == 1)
    return (a, b) if len(a) and len(b) else (np.arange(len(tasks)),)


def _checked_tasks(tasks: Any, num_ranks: Any) -> int:
    """split_tasks' arguments checked (TypeError / ValueError naming the first fault) -> num_ranks."""
    num_ranks = distca._integer(num_ranks, "num_ranks", 32)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    names: tuple = distca.TASK_DTYPE.names or ()
    if not isinstance(tasks, np.ndarray) or tasks.dtype.names is None or tasks.ndim != 1:
        got = f"an array of {tasks.dtype}, shape {tasks.shape}" if isinstance(tasks, np.ndarray) else _describe(tasks)
        raise TypeError(f"tasks must be a one-dimensional array of distca.TASK_DTYPE (Plan.tasks), got {got}")
    for name in names:
        if name not in tasks.dtype.names:
            raise ValueError(f"tasks: no field {name!r} (distca.TASK_DTYPE: {', '.join(names)})")
        if tasks.dtype[name].kind not in "iu":
            raise TypeError(f"tasks: field {name!r} must hold integers, got {tasks.dtype[name]}")
    if len(tasks):
        doc, q0, q1, k0, k1, server = (tasks[f].astype(np.int64) for f in names)
        bad = np.flatnonzero((server < 0) | (server >= num_ranks))
        if bad.size:
            raise ValueError(f"tasks[{bad[0]}]: server {server[bad[0]]} outside [0, {num_ranks}) "
                             f"(num_ranks {num_ranks})")
        bad = np.flatnonzero((doc < 0) | (q0 < 0) | (q1 <= q0) | (k0 < 0) | (k1 < k0))
        if bad.size:
            i = bad[0]
            raise ValueError(f"tasks[{i}]: need doc >= 0, 0 <= q0 < q1 and 0 <= k0 <= k1, got doc {doc[i]}, "
                             f"q [{q0[i]}, {q1[i]}), kv [{k0[i]}, {k1[i]})")
    return num_ranks


def _row_groups(tasks: np.ndarray) -> np.ndarray:
    """(tasks) the group of each task: tasks whose query ranges overlap, transitively, within a
    document share one; groups numbered in (doc, q0) order."""
    if len(tasks) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((tasks["q0"], tasks["doc"]))
    doc, q0, q1 = (tasks[f][order].astype(np.int64) for f in ("doc", "q0", "q1"))
    # Within a document (sorted by q0), a task starts a new group when it begins at or after the
    # furthest query end so far; documents are offset apart so one running maximum serves all.
    offset = doc * (int(q1.max()) + 1)
    reach = np.maximum.accumulate(offset + q1)
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (doc[1:] != doc[:-1]) | (offset[1:] + q0[1:] >= reach[:-1])
    group_of = np.empty(len(order), dtype=np.int64)
    group_of[order] = np.cumsum(starts) - 1
    return group_of


def _task_pairs(tasks: np.ndarray) -> np.ndarray:
    """(query, key) pairs of each task: causal tasks (k1 == q1) count the triangle."""
    q0, q1, k0, k1 = (tasks[f].astype(np.float64) for f in ("q0", "q1", "k0", "k1"))
    causal = k1 == q1
    full = (q1 - q0) * (k1 - k0)
    tri = (q1 - q0) * (q0 - k0) + (q1 - q0) * (q1 - q0 + 1) / 2
    return np.where(causal, tri, full)
