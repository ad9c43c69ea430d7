"""Ranks agreeing on bad input: the call header that starts every public collective call
(StepPlanner.plan, plan_async, cad_attention with check_inputs; see "Identity and agreement" in
distca.torch.cad.planner's docstring), InputError, which every rank raises with the same one-line
message, agree() for a check of one's own, and the helpers that word those messages.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

# The calls that start with a call header (see distca.torch.cad.planner's docstring), by code.
CALL_PLAN, CALL_PLAN_ASYNC, CALL_CAD_ATTENTION, CALL_FINISH = 1, 2, 3, 4
CALL_NAMES = {CALL_PLAN: "StepPlanner.plan", CALL_PLAN_ASYNC: "StepPlanner.plan_async",
               CALL_CAD_ATTENTION: "cad_attention", CALL_FINISH: "StepPlanner.finish"}


def describe(x: Any) -> str:
    """A value for a message: its type, and its repr when that is short."""
    if x is None:
        return "None"
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 (a repr that raises: the type alone)
        text = ""
    return f"{type(x).__name__} {text}" if 0 < len(text) <= 40 else f"a {type(x).__name__}"


class InputError(ValueError):
    """Bad input found on some rank, raised on every rank of the group with the same message."""


def agree(control_group: Any, message: Optional[str], what: str) -> None:
    """Collective: raises InputError on every rank when any rank has a message (the lowest such
    rank's, prefixed with its rank), so a bad input on one rank cannot leave the others waiting in
    the next collective. One small all-reduce when every rank is fine."""
    flag = torch.tensor([0 if message is None else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group)
    if flag.item() == 0:
        return
    messages: list = [None] * dist.get_world_size(control_group)
    dist.all_gather_object(messages, message, group=control_group)
    rank, first = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise InputError(f"{what}: rank {rank}: {first}")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def error_message(e: BaseException) -> str:
    """An exception of a local check as one line (TypeError and ValueError say what they are)."""
    text = _one_line(e)
    return text if isinstance(e, (TypeError, ValueError)) and text else f"{type(e).__name__}: {text}"


def _ranks_text(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _by_value(values: list) -> dict:
    """value -> the ranks holding it, in order of first appearance."""
    out: dict = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def call_header(control_group: Any, call: int, planner_id: int, serial: int, message: Optional[str],
                details: Any = None) -> None:
    """Collective, the first of every public collective call (see distca.torch.cad.planner's docstring): an
    all_gather of [call, planner_id, serial, error] (int64) over the planner's control group, in
    the caller's thread. Raises the same one-line InputError on every rank when
      1. the ranks are in different calls (it names each call and its ranks);
      2. any rank has a message, its local check's finding (the lowest such rank's);
      3. the ranks name different planners (plan: planners made with other settings or in another
         order, told apart by `details`, (config digest, ordinal), gathered then; cad_attention:
         layouts of different planners);
      4. the ranks are at different steps of one planner (cad_attention: a stale layout).
    One all_gather of 4 int64 per rank when every rank is fine; a failing header adds at most one
    all_gather_object. Ranks in different calls cannot deadlock here: every call's first
    collective has this one shape and op."""
    what = CALL_NAMES[call]
    header = torch.tensor([call, planner_id, serial, 0 if message is None else 1], dtype=torch.int64)
    world = dist.get_world_size(control_group)
    gathered = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(gathered, header, group=control_group)
    rows = [g.tolist() for g in gathered]
    # 1. Different calls: nothing else in the headers is comparable, except that a rank in finish
    #    has made its last plan (its serial counts them) while another is still planning.
    calls = _by_value([r[0] for r in rows])
    if len(calls) > 1 and CALL_FINISH in calls:
        done = calls[CALL_FINISH]
        ended = ", ".join(f"rank {r} after {rows[r][2]} plan{'s' if rows[r][2] != 1 else ''}" for r in done)
        busy = ", ".join(f"rank {r} in {CALL_NAMES.get(rows[r][0], f'call {rows[r][0]}')} of plan {rows[r][2]}"
                         for r in range(world) if r not in done)
        raise InputError(f"finished planning ({ended}) while still planning ({busy}): every rank must make the "
                         f"same number of plans")
    if len(calls) > 1:
        where = [f"{_ranks_text(ranks)} {('is' if len(ranks) == 1 else 'are') + ' ' if i == 0 else ''}in "
                 f"{CALL_NAMES.get(c, f'call {c}')}" for i, (c, ranks) in enumerate(calls.items())]
        raise InputError(f"{', '.join(where)}: every rank must make the same calls in the same order")
    # 2. Bad input somewhere: every rank gathers the messages.
    bad = [r for r, row in enumerate(rows) if row[3]]
    if bad:
        messages: list = [None] * world
        dist.all_gather_object(messages, None if message is None else _one_line(message), group=control_group)
        also = f" (bad input on {_ranks_text(bad[1:])} too)" if len(bad) > 1 else ""
        raise InputError(f"{what}: rank {bad[0]}: {messages[bad[0]]}{also}")
    # 3. Different planners.
    ids = _by_value([r[1] for r in rows])
    if len(ids) > 1:
        if call == CALL_CAD_ATTENTION:
            groups = "; ".join(f"{_ranks_text(ranks)} one planner's" for ranks in ids.values())
            raise InputError(f"cad_attention: the ranks passed layouts of different planners ({groups}): every "
                             f"rank must pass the layout of the same StepPlanner.plan call")
        infos: list = [None] * world
        dist.all_gather_object(infos, details, group=control_group)
        if len({repr(i[0]) if i else None for i in infos}) > 1:
            raise InputError(f"{what}: the ranks' planners differ in their settings (policy, tolerance, granularity, "
                             f"model, pingpong, backward, backend, check_inputs or prefetch): construct them alike")
        order = ", ".join(f"rank {r}: #{i[1] if i else '?'}" for r, i in enumerate(infos))
        raise InputError(f"{what}: the ranks call different planners over these ranks (the planner's place among "
                         f"those constructed over them, {order}): construct them in the same order on every rank")
    # 4. One planner, different steps.
    serials = [r[2] for r in rows]
    if len(set(serials)) > 1:
        if call == CALL_FINISH:
            plans = ", ".join(f"rank {r}: {s}" for r, s in enumerate(serials))
            raise InputError(f"StepPlanner.finish: the ranks made different numbers of plans ({plans}): every rank "
                             f"must make the same number of plans")
        if call == CALL_CAD_ATTENTION:
            stale = [r for r, s in enumerate(serials) if s != max(serials)]
            raise InputError(f"cad_attention: {_ranks_text(stale)} passed the layout of an earlier step than the "
                             f"others: every rank must pass the layout of the same StepPlanner.plan call")
        steps = ", ".join(f"rank {r}: {s}" for r, s in enumerate(serials))
        raise InputError(f"{what}: the ranks are at different calls of the planner ({steps}): every rank must make "
                         f"the same calls in the same order")
