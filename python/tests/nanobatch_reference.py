"""THE REFERENCE for distca.torch's nano-batch split, kept for tests only: the NumPy
implementation that distca.torch ran before the split moved to C++ (layout::split_attention_tasks,
src/layout/include/distca/layout/task_split.h, which states the algorithm). test_torch_nanobatch.py
checks that the _distca split gives exactly what this code gives (every task list and number) on
a set of plans. Not part of the package; do not import it from distca."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from distca.torch.cad.nanobatch import NanoSplit


def split_plan(tasks: np.ndarray, batch: Any, *, tolerance: float, kv_budget: float) -> NanoSplit:
    """The reference split of a plan's valid tasks (distca.torch.cad.nanobatch.split_plan's contract)."""
    num_ranks, pieces = int(batch.num_ranks), np.asarray(batch.to_dict()["pieces"], dtype=np.int64)
    pairs = _task_pairs(tasks)
    owned = _owned_rows(pieces, tasks, num_ranks)
    remote = _remote_kv_rows(tasks, owned)
    whole = np.bincount(tasks["server"].astype(np.int64), weights=pairs, minlength=num_ranks)
    cap = (1.0 + tolerance) * float(whole.max(initial=0.0)) / 2
    out = NanoSplit(parts=(tasks,), cap=cap, level=cap, num_cuts=0, extra_kv_rows=0, remote_kv_rows=remote)
    if len(tasks) < 2:
        return out
    atom_of = _kv_atoms(tasks)
    side_of_atom, loads = _deal_atoms(tasks["server"].astype(np.int64), atom_of, pairs, num_ranks)
    side = side_of_atom[atom_of]
    # Cuts: the lowest level (from cap up) that every server's heavier half can be brought to,
    # one cut each, within the budget of duplicated K/V rows.
    budget = math.floor(kv_budget * remote)
    by_server = np.argsort(tasks["server"], kind="stable")
    bounds = np.searchsorted(tasks["server"][by_server], np.arange(num_ranks + 1))
    servers = [_ServerCuts(tasks, pairs, side, s, by_server[bounds[s]:bounds[s + 1]], loads[s], owned)
               for s in np.flatnonzero(loads.max(axis=1) > cap).tolist()]
    level = _lowest_level(servers, cap, budget)
    out.level = level
    cuts = [cut for cut in (sc.cut(level) for sc in servers) if cut is not None]
    kept = tasks.copy()            # the cut tasks replaced by the piece that stays in their half
    moved, moved_side = [], []     # the pieces that go to the other half
    for cost, s, i, c, moves_early in cuts:
        out.extra_kv_rows += cost
        out.num_cuts += 1
        early, late = tasks[i].copy(), tasks[i].copy()
        early["q1"] = c
        if tasks[i]["k1"] == tasks[i]["q1"]:   # causal: the early rows see keys up to the cut
            early["k1"] = c
        late["q0"] = c
        kept[i], piece = (late, early) if moves_early else (early, late)
        moved.append(piece)
        moved_side.append(1 - side[i])
    every = np.concatenate([kept, np.array(moved, dtype=tasks.dtype)])
    every_side = np.concatenate([side, np.asarray(moved_side, dtype=np.int64)])
    # Every server's heavier half in nano-batch 0 (free: a server's halves only trade places):
    # each nano-batch's attention takes as long as its busiest server, so aligned halves keep
    # the two together shortest, max(heavier) + max(lighter).
    every_pairs = _task_pairs(every)
    server = every["server"].astype(np.int64)
    halves = np.stack([np.bincount(server[every_side == h], weights=every_pairs[every_side == h],
                                   minlength=num_ranks) for h in (0, 1)])
    every_side = np.where((halves[1] > halves[0])[server], 1 - every_side, every_side)
    halves = np.stack([halves.max(axis=0), halves.min(axis=0)])
    if level > cap:
        every_side = _fill_to_level(every, every_side, every_pairs, halves, level, 2 * cap / (1 + tolerance))
    out.busiest = (float(halves[0].max()), float(halves[1].max()))
    # Plan order within each half (server, doc, q0, k0), as the plan lists its tasks.
    order = np.lexsort((every["k0"], every["q0"], every["doc"], every["server"]))
    every, every_side = every[order], every_side[order]
    a, b = every[every_side == 0], every[every_side == 1]
    if len(a) and len(b):
        out.parts = (a, b)
        out.travel_rows = tuple((_remote_q_rows(x, owned), _remote_kv_rows(x, owned)) for x in out.parts)
    # The servers left above cap (+ one row's pairs): the budget, or no task to cut, stopped them.
    out.over = np.flatnonzero(halves[0] > cap + _row_pairs(tasks, num_ranks)).tolist()
    return out


def _task_pairs(tasks: np.ndarray) -> np.ndarray:
    """(query, key) pairs of each task: causal tasks (k1 == q1) count the triangle."""
    q0, q1, k0, k1 = (tasks[f].astype(np.float64) for f in ("q0", "q1", "k0", "k1"))
    causal = k1 == q1
    full = (q1 - q0) * (k1 - k0)
    tri = (q1 - q0) * (q0 - k0) + (q1 - q0) * (q1 - q0 + 1) / 2
    return np.where(causal, tri, full)


def _kv_atoms(tasks: np.ndarray) -> np.ndarray:
    """(tasks) the atom of each task: tasks of one document on one server whose key ranges
    overlap, transitively (they share K/V rows on that server)."""
    return _overlap_groups(tasks, ("server", "doc"), "k0", "k1")


def _overlap_groups(tasks: np.ndarray, keys: tuple, lo: str, hi: str) -> np.ndarray:
    """Groups of tasks with equal `keys` fields whose [lo, hi) ranges overlap, transitively,
    numbered in sorted order."""
    if len(tasks) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((tasks[lo],) + tuple(tasks[k] for k in reversed(keys)))
    begin, end = tasks[lo][order].astype(np.int64), tasks[hi][order].astype(np.int64)
    same = np.ones(len(order) - 1, dtype=bool)
    for k in keys:
        col = tasks[k][order]
        same &= col[1:] == col[:-1]
    # Within a run of equal keys (sorted by lo), a task starts a new group when it begins at or
    # after the furthest end so far; runs are offset apart so one running maximum serves all.
    run = np.concatenate([[0], np.cumsum(~same)])
    offset = run * (int(end.max()) + 1)
    reach = np.maximum.accumulate(offset + end)
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = ~same | (offset[1:] + begin[1:] >= reach[:-1])
    group_of = np.empty(len(order), dtype=np.int64)
    group_of[order] = np.cumsum(starts) - 1
    return group_of


def _deal_atoms(server: np.ndarray, atom_of: np.ndarray, pairs: np.ndarray, num_ranks: int) -> tuple:
    """Each server's atoms dealt to two halves: largest first to the lighter half (ties: half 0),
    then single moves of the atom that narrows the gap most, while one does.
    -> (side of each atom, (R, 2) pairs per server and half)."""
    num_atoms = int(atom_of.max()) + 1
    weight = np.bincount(atom_of, weights=pairs, minlength=num_atoms)
    atom_server = np.zeros(num_atoms, dtype=np.int64)
    atom_server[atom_of] = server
    side = np.zeros(num_atoms, dtype=np.int64)
    loads = np.zeros((num_ranks, 2))
    order = np.lexsort((np.arange(num_atoms), -weight, atom_server))
    bounds = np.searchsorted(atom_server[order], np.arange(num_ranks + 1))
    for s in range(num_ranks):
        mine = order[bounds[s]:bounds[s + 1]]
        if len(mine) == 0:
            continue
        w = weight[mine].tolist()
        half = [0.0, 0.0]
        where = []
        for x in w:
            h = 0 if half[0] <= half[1] else 1
            half[h] += x
            where.append(h)
        for _ in range(min(len(w), 8)):   # a few narrowing moves (each O(atoms)); they rarely need more
            heavy = 0 if half[0] >= half[1] else 1
            gap = half[heavy] - half[1 - heavy]
            # Moving an atom of x from the heavier half leaves a gap of |gap - 2x|.
            best, best_gap = -1, gap
            for j, x in enumerate(w):
                if where[j] == heavy and abs(gap - 2 * x) < best_gap:
                    best, best_gap = j, abs(gap - 2 * x)
            if best < 0:
                break
            where[best] = 1 - heavy
            half[heavy] -= w[best]
            half[1 - heavy] += w[best]
        side[mine] = where
        loads[s] = half
    return side, loads


class _ServerCuts:
    """One server's heavier half and the tasks in it that a cut could divide, for cut(level)."""

    def __init__(self, tasks: np.ndarray, pairs: np.ndarray, side: np.ndarray, server: int, on_server: np.ndarray,
                 load: np.ndarray, owned: dict):
        self.server = int(server)
        self.heavy = 0 if load[0] >= load[1] else 1
        self.heavy_load = float(load[self.heavy])
        mine = on_server[side[on_server] == self.heavy]
        mine = mine[np.argsort(-pairs[mine], kind="stable")]
        # (task, pairs, doc, q0, q1, k0, k1), largest first
        self.candidates: list[tuple[int, float, int, int, int, int, int]] = [
            (i, float(pairs[i]), int(tasks["doc"][i]), int(tasks["q0"][i]), int(tasks["q1"][i]), int(tasks["k0"][i]),
             int(tasks["k1"][i])) for i in mine.tolist()]
        self.owned = owned
        self._memo: dict = {}

    def cut(self, level: float) -> Any:
        """The cut bringing the heavier half to at most `level` pairs with the fewest K/V rows
        travelling twice: (cost, server, task, row, moves_early); None when none is needed;
        (inf, ...) when no task of the half is larger than what must move."""
        need = self.heavy_load - level
        if need <= 0:
            return None
        if level in self._memo:
            return self._memo[level]
        best: Any = (math.inf, self.server, -1, 0, True)
        for i, p, doc, q0, q1, k0, k1 in self.candidates:
            if p <= need:
                break   # sorted by pairs: no later task is larger
            causal = k1 == q1
            for moves_early in (True, False):
                early_pairs = need if moves_early else p - need   # pairs of rows [q0, c)
                c = _cut_row(q0, q1, k0, k1, causal, early_pairs, round_up=moves_early)
                if not q0 < c < q1:
                    continue
                # The early piece's keys are read by both pieces: they travel twice unless the
                # server owns them.
                end = c if causal else k1
                cost = (end - k0) - _owned_in(self.owned, doc, self.server, k0, end)
                if (cost, c) < (best[0], best[3]):
                    best = (cost, self.server, i, c, moves_early)
        self._memo[level] = best
        return best


def _fill_to_level(every: np.ndarray, side: np.ndarray, pairs: np.ndarray, halves: np.ndarray, level: float,
                   busiest: float) -> np.ndarray:
    """Where the budget left some server's heavier half at `level` (above cap), nano-batch 1 lasts
    as long as its busiest server, so no server's lighter half need be above busiest - level.
    Moves whole atoms (tasks sharing K/V rows, none of them cut) from a lighter half to its
    heavier half, largest first, while that one stays within level: free, and it shortens
    nano-batch 1 (rows of `halves` updated in place) -> the new sides."""
    side = side.copy()
    atom_of = _kv_atoms(every)
    num_atoms = int(atom_of.max()) + 1
    weight = np.bincount(atom_of, weights=pairs, minlength=num_atoms)
    # Atoms wholly in the lighter half (none of their tasks cut), by server, largest first.
    movable = np.bincount(atom_of, weights=side == 1, minlength=num_atoms) == np.bincount(atom_of, minlength=num_atoms)
    atom_server = np.zeros(num_atoms, dtype=np.int64)
    atom_server[atom_of] = every["server"]
    light = busiest - level
    moved = np.zeros(num_atoms, dtype=bool)
    over = set(np.flatnonzero(halves[1] > light).tolist())
    for a in np.lexsort((-weight, atom_server)).tolist():
        s = int(atom_server[a])
        if s not in over or not movable[a] or halves[1, s] <= light:
            continue
        if halves[0, s] + weight[a] <= level:
            moved[a] = True
            halves[0, s] += weight[a]
            halves[1, s] -= weight[a]
    side[moved[atom_of]] = 0
    return side


def _lowest_level(servers: list, cap: float, budget: int) -> float:
    """The lowest level >= cap (in pairs) to which every server's heavier half can be cut, one
    cut each, with at most `budget` K/V rows travelling twice in all (bisection: a higher level
    needs smaller cuts, never more rows)."""
    def cost(level: float) -> float:
        return sum(c[0] for c in (sc.cut(level) for sc in servers) if c is not None)
    if not servers or cost(cap) <= budget:
        return cap
    lo, hi = cap, max(sc.heavy_load for sc in servers)   # cost(hi) = 0: no cut needed
    for _ in range(48):
        mid = (lo + hi) / 2
        if cost(mid) <= budget:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1:
            break
    return hi


def _row_pairs(tasks: np.ndarray, num_ranks: int) -> np.ndarray:
    """(R) the most pairs one query row of a task holds on each server (a cut's rounding)."""
    span = (tasks["k1"] - tasks["k0"]).astype(np.float64)
    out = np.zeros(num_ranks)
    np.maximum.at(out, tasks["server"].astype(np.int64), span)
    return out


def _cut_row(q0: int, q1: int, k0: int, k1: int, causal: bool, early_pairs: float, round_up: bool) -> int:
    """The row c at which rows [q0, c) of a task hold `early_pairs` pairs: the first such c
    (round_up) or the last with no more than that."""
    if causal:
        # rows [q0, c) hold F(c) - F(q0) pairs, F(x) = (x - k0)(x - k0 + 1) / 2
        f0 = (q0 - k0) * (q0 - k0 + 1) / 2
        x = (-1 + math.sqrt(1 + 8 * (early_pairs + f0))) / 2
    else:
        x = (q0 - k0) + early_pairs / max(k1 - k0, 1)
    c = k0 + (math.ceil(x - 1e-9) if round_up else math.floor(x + 1e-9))
    return min(max(c, q0), q1)


def _owned_rows(pieces: np.ndarray, tasks: np.ndarray, num_ranks: int) -> dict:
    """(doc, rank) -> the (begin, end) rows of the document that rank holds, for the (doc,
    server) pairs of the tasks only (a batch of 512 ranks has tens of thousands of pieces)."""
    owned: dict = {}
    if len(pieces) == 0 or len(tasks) == 0:
        return owned
    wanted = np.unique(tasks["doc"].astype(np.int64) * num_ranks + tasks["server"].astype(np.int64))
    pieces = pieces[np.isin(pieces[:, 0] * num_ranks + pieces[:, 3], wanted)]
    for doc, begin, end, rank in pieces.tolist():
        owned.setdefault((doc, rank), []).append((begin, end))
    return owned


def _owned_in(owned: dict, doc: int, rank: int, begin: int, end: int) -> int:
    """How many of document rows [begin, end) the rank holds."""
    return sum(max(0, min(end, e) - max(begin, b)) for b, e in owned.get((doc, rank), ()))


def _remote_q_rows(tasks: np.ndarray, owned: dict) -> int:
    """Q rows the tasks move between ranks: each task's query rows less those its server holds."""
    return sum((q1 - q0) - _owned_in(owned, d, s, q0, q1)
               for d, q0, q1, s in zip(*(tasks[f].tolist() for f in ("doc", "q0", "q1", "server"))))


def _remote_kv_rows(tasks: np.ndarray, owned: dict) -> int:
    """K/V rows the plan moves between ranks: per (server, document), the union of the tasks' key
    ranges (layout/route.h), less the rows the server holds."""
    total = 0
    order = np.lexsort((tasks["k0"], tasks["doc"], tasks["server"]))
    key: Any = None
    lo = hi = 0
    for s, d, k0, k1 in zip(*(tasks[f][order].tolist() for f in ("server", "doc", "k0", "k1"))):
        if (s, d) == key and k0 <= hi:
            hi = max(hi, k1)
            continue
        if key is not None:
            total += (hi - lo) - _owned_in(owned, key[1], key[0], lo, hi)
        key, lo, hi = (s, d), k0, k1
    if key is not None:
        total += (hi - lo) - _owned_in(owned, key[1], key[0], lo, hi)
    return total
