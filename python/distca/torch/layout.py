"""Planning per step over a process group, and the step layout every attention layer reuses.

    planner = StepPlanner(group, model={"heads": 32, "kv_heads": 8, "head_dim": 128})
    layout = planner.plan(cu_seqlens)          # collective: every rank of the group calls it
    o = cad_attention(q, k, v, layout)         # in every layer, forward and backward

`plan` gathers every rank's documents over the group, plans once in C++ (the same plan on every
rank: the hash is checked), and builds this rank's exchange layout as device tensors: gather and
scatter indices, split sizes, the server's task groups, merge maps, and each row's absolute
position in its document (for RoPE). With ping-pong the plan's tasks are split into two
nano-batches, each with its own layout (the plan is not remade: both halves run exactly the
plan's tasks).

Identity and agreement. A layout is named by (planner_id, serial): planner_id is the same on
every rank (a hash of the planner's settings, its group's ranks and its ordinal among this
process's planners over those ranks), serial counts that planner's plan/plan_async calls, given
in call order in the caller's thread. Every public collective call (plan, plan_async,
cad_attention with check_inputs) checks its arguments locally and then starts with one call
header on the planner's gloo control group: an all_gather of [call, planner_id, serial, error]
(int64). Every call's first collective has that one shape, so ranks in different calls, or with
bad input on one rank, all see every header and raise the same InputError instead of waiting in
mismatched collectives.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

import distca
from distca import _distca

from .buffers import ExchangeBuffers
from .backends import ServerTasks, TaskGroup, describe_auto, get_backend

# Planners constructed in this process per tuple of their group's (global) ranks: a planner's
# ordinal among those over the same ranks, the same on every rank when every rank constructs its
# planners in the same order (as valid use requires), goes into its planner_id.
_PLANNER_COUNTS: dict = {}
# Weak references to this process's planners, oldest first: a rank whose cad_attention gets no
# planner's layout agrees over the newest live planner's control group.
_PLANNERS: list = []

# The calls that start with a call header (see the module docstring), by code.
CALL_PLAN, CALL_PLAN_ASYNC, CALL_CAD_ATTENTION = 1, 2, 3
_CALL_NAMES = {CALL_PLAN: "StepPlanner.plan", CALL_PLAN_ASYNC: "StepPlanner.plan_async",
               CALL_CAD_ATTENTION: "cad_attention"}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape cad_attention checks its inputs against."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class PartLayout:
    """One nano-batch's exchange on this rank (see distca.RankLayout for the arrays' meaning);
    index arrays are int64 device tensors, split sizes Python lists."""
    q_send_index: torch.Tensor     # (entries) local row of each Q entry, grouped by server
    kv_send_index: torch.Tensor    # (kv entries) local row of each K/V entry, grouped by server
    q_send_splits: list
    q_recv_splits: list
    kv_send_splits: list
    kv_recv_splits: list
    q_gather: torch.Tensor         # (server Q rows) varlen row -> row of the received Q
    kv_gather: torch.Tensor        # (server K rows) varlen row -> row of the received K/V
    copy_entries: torch.Tensor
    copy_rows: torch.Tensor
    merge_entries: torch.Tensor
    merge_rows: torch.Tensor       # (merge entries) local row of each partial result
    merged_rows: torch.Tensor      # (split rows) the distinct rows of merge_rows
    merge_slot: torch.Tensor       # (merge entries) index of each entry's row in merged_rows
    tasks: ServerTasks
    num_tasks: int

    @property
    def num_q_recv(self) -> int:
        return sum(self.q_recv_splits)

    @property
    def num_kv_recv(self) -> int:
        return sum(self.kv_recv_splits)


@dataclass
class StepLayout:
    """One step's CAD layout on this rank: made by StepPlanner.plan, passed to cad_attention in
    every layer of the step (forward and backward). (planner_id, serial) names the step, the same
    on every rank; rank_layout alone leaves both 0 (no planner's step)."""
    serial: int                    # the planner's plan/plan_async call that made it, from 1
    rank: int
    world_size: int
    group: Any
    control_group: Any
    device: torch.device
    model: Optional[ModelShape]   # None until StepPlanner sets it (rank_layout alone)
    num_local_rows: int
    positions: torch.Tensor        # (T) int64: each local row's position in its document (RoPE)
    local_cu_seqlens: torch.Tensor  # (pieces + 1) int64: this rank's pieces, end to end
    parts: list                    # one PartLayout, or two with ping-pong
    plan: "distca.Plan"
    backward: str                  # stateful | stateless
    backend: str
    check_inputs: bool
    plan_ms: float                 # gather + C++ planning + hash check, this rank
    layout_ms: float               # the layouts and device tensors, this rank
    buffers: Any = None            # the planner's ExchangeBuffers (static_buffers), or None
    planner_id: int = 0            # StepPlanner.planner_id of the planner that made it
    backend_note: str = ""         # what `auto` runs here and why (backends.describe_auto), else ""
    host_staging: bool = False     # the exchanges go through host memory (CUDA tensors over gloo; testing)

    @property
    def hash(self) -> int:
        return self.plan.hash

    @property
    def is_pingpong(self) -> bool:
        return len(self.parts) == 2

    def server_kernel(self, dtype: torch.dtype, name: Optional[str] = None):
        return get_backend(name or self.backend, self.device, dtype)

    def __repr__(self) -> str:
        return (f"<distca.torch.StepLayout step {self.serial} of planner {self.planner_id:016x}: "
                f"rank {self.rank}/{self.world_size}, "
                f"{self.num_local_rows} rows, {len(self.parts)} nano-batch(es), plan {self.plan.hash:016x}"
                f"{'; ' + self.backend_note if self.backend_note else ''}>")


_MODEL_SHAPE_KEYS = {"heads": "num_q_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim"}


def _model_shape(model: Union[str, Mapping[str, Any]]) -> ModelShape:
    if isinstance(model, str):
        presets = {"llama-8b": (32, 8, 128), "llama-34b": (64, 8, 128)}
        if model not in presets:
            raise ValueError(f"model: a preset ({', '.join(presets)}) or a dict with heads, kv_heads, head_dim; "
                             f"got {model!r}")
        return ModelShape(*presets[model])
    if not isinstance(model, Mapping):
        raise TypeError(f"model must be a preset name or a dict, got {type(model).__name__}")
    missing = [k for k in _MODEL_SHAPE_KEYS if k not in model]
    if missing and "preset" not in model:
        raise ValueError(f"model: missing {', '.join(missing)} (the attention shape cad_attention checks)")
    base = _model_shape(model["preset"]) if "preset" in model else None
    values = {}
    for key, attr in _MODEL_SHAPE_KEYS.items():
        value = model.get(key, getattr(base, attr) if base else None)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"model: {key} must be a positive integer, got {value!r}")
        values[attr] = int(value)
    if values["num_q_heads"] % values["num_kv_heads"]:
        raise ValueError(f"model: heads ({values['num_q_heads']}) must be a multiple of kv_heads "
                         f"({values['num_kv_heads']})")
    return ModelShape(**values)


def _planner_model(model: Union[str, Mapping[str, Any]]) -> Union[str, dict]:
    """The model argument for distca.plan: shape keys filled in so a dict plans without a preset."""
    if isinstance(model, str):
        return model
    d = dict(model)
    if "preset" not in d:
        shape = _model_shape(d)
        hidden = shape.num_q_heads * shape.head_dim
        d.setdefault("layers", 1)
        d.setdefault("hidden", hidden)
        d.setdefault("ffn_hidden", 4 * hidden)
    return d


def _describe(x: Any) -> str:
    """A value for a message: its type, and its repr when that is short."""
    if x is None:
        return "None"
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 (a repr that raises: the type alone)
        text = ""
    return f"{type(x).__name__} {text}" if 0 < len(text) <= 40 else f"a {type(x).__name__}"


def _as_int_list(x: Any, what: str) -> list:
    """A sequence (list, tuple, range), 1-d tensor or 1-d array of integers -> list of ints; a
    mapping, a string, a set or another iterable is refused (TypeError)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got a {x.dtype} tensor")
        if x.dim() != 1:
            raise ValueError(f"{what} must be one-dimensional, got a tensor of shape {tuple(x.shape)}")
        x = x.detach().cpu().tolist()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got a {x.dtype} array")
        if x.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got an array of shape {x.shape}")
        x = x.tolist()
    elif isinstance(x, (str, bytes)) or not isinstance(x, SequenceABC):
        raise TypeError(f"{what} must be a sequence (list, tuple), tensor or array of integers, got {_describe(x)}")
    out = []
    for v in x:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must hold integers, got {_describe(v)}")
        out.append(int(v))
    return out


def _local_pieces(rank: int, cu_seqlens: Any, pieces: Any) -> list:
    """This rank's pieces as (doc_key, begin, end, doc_length) rows, checked."""
    if (cu_seqlens is None) == (pieces is None):
        raise ValueError("pass cu_seqlens (this rank's whole documents) or pieces (documents that span ranks), "
                         "exactly one")
    if cu_seqlens is not None:
        cu = _as_int_list(cu_seqlens, "cu_seqlens")
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {cu[:8]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        bad = next((i for i, n in enumerate(lengths) if n <= 0), None)
        if bad is not None:
            raise ValueError(f"cu_seqlens must increase strictly: document {bad} (cu_seqlens[{bad}] = {cu[bad]} to "
                             f"cu_seqlens[{bad + 1}] = {cu[bad + 1]}) has length {lengths[bad]}")
        return [((rank, i), 0, n, n) for i, n in enumerate(lengths)]
    if isinstance(pieces, torch.Tensor):
        pieces = pieces.detach().cpu().tolist()
    elif isinstance(pieces, np.ndarray):
        pieces = list(pieces)
    elif isinstance(pieces, (str, bytes)) or not isinstance(pieces, SequenceABC):
        raise TypeError(f"pieces must be a sequence of (doc_key, begin, end, doc_length) rows, got {_describe(pieces)}")
    rows = []
    for i, p in enumerate(pieces):
        if isinstance(p, (str, bytes, Mapping)) or not isinstance(p, (SequenceABC, np.ndarray)):
            raise TypeError(f"pieces[{i}] must be a row (doc_key, begin, end, doc_length), got {_describe(p)}")
        p = tuple(p)
        if len(p) != 4:
            raise ValueError(f"pieces[{i}] must be (doc_key, begin, end, doc_length), got {p!r}")
        key, begin, end, length = p
        begin, end, length = _as_int_list([begin, end, length], f"pieces[{i}] begin, end, doc_length")
        if not 0 <= begin < end <= length:
            raise ValueError(f"pieces[{i}]: need 0 <= begin < end <= doc_length, got {begin}, {end}, {length}")
        if isinstance(key, torch.Tensor):
            key = key.item()
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"pieces[{i}]: the document key must be hashable (an int or str), got {type(key).__name__}")
        rows.append((("key", key), begin, end, length))
    if not rows:
        raise ValueError("pieces: this rank holds no piece (every rank needs at least one token)")
    return rows


def _global_batch(gathered: list) -> tuple:
    """Every rank's pieces -> (Batch, per-rank pieces with global doc ids)."""
    doc_ids: dict = {}
    lengths: list = []
    rows = []
    for rank, pieces in enumerate(gathered):
        for key, begin, end, length in pieces:
            if key not in doc_ids:
                doc_ids[key] = len(lengths)
                lengths.append(length)
            doc = doc_ids[key]
            if lengths[doc] != length:
                raise ValueError(f"document {key[1]!r}: rank {rank} says its length is {length}, another rank "
                                 f"{lengths[doc]}")
            rows.append((doc, begin, end, rank))
    batch = distca.batch_from_pieces(lengths, np.asarray(rows, dtype=np.int64).reshape(-1, 4))
    return batch, rows


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


def _device_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


def _part_layout(d: dict, device: torch.device, num_tasks: int) -> PartLayout:
    dev = lambda a: _device_tensor(a, device)  # noqa: E731
    groups = []
    for name, q_offset, k_offset, is_causal in (("causal", 0, 0, True),
                                                ("noncausal", d["causal_q_rows"], d["causal_kv_rows"], False)):
        g = d[name]
        cu_q, cu_k = np.asarray(g["cu_seqlens_q"], np.int64), np.asarray(g["cu_seqlens_k"], np.int64)
        groups.append(TaskGroup(is_causal, int(q_offset), int(k_offset), cu_q, cu_k, int(g["max_seqlen_q"]),
                                int(g["max_seqlen_k"]), torch.from_numpy(cu_q.astype(np.int32)).to(device),
                                torch.from_numpy(cu_k.astype(np.int32)).to(device)))
    merge_rows = np.asarray(d["merge_rows"], np.int64)
    merged_rows, merge_slot = np.unique(merge_rows, return_inverse=True)
    tasks = ServerTasks((groups[0], groups[1]), len(d["q_gather"]), len(d["kv_gather"]), device)
    return PartLayout(
        q_send_index=dev(d["q_send_index"]), kv_send_index=dev(d["kv_send_index"]),
        q_send_splits=[int(x) for x in d["q_send_splits"]], q_recv_splits=[int(x) for x in d["q_recv_splits"]],
        kv_send_splits=[int(x) for x in d["kv_send_splits"]], kv_recv_splits=[int(x) for x in d["kv_recv_splits"]],
        q_gather=dev(d["q_gather"]), kv_gather=dev(d["kv_gather"]),
        copy_entries=dev(d["copy_entries"]), copy_rows=dev(d["copy_rows"]),
        merge_entries=dev(d["merge_entries"]), merge_rows=dev(merge_rows),
        merged_rows=dev(merged_rows), merge_slot=dev(merge_slot), tasks=tasks, num_tasks=num_tasks)


def _checked_rows(rows: Any, batch: Any, rank: int) -> np.ndarray:
    """rank_layout's rows checked against the batch -> this rank's (begin, end) rows, (n, 2) int64."""
    def refused() -> TypeError:
        return TypeError(f"rows must be the batch's pieces, (doc, begin, end, rank) rows of integers "
                         f"(batch.to_dict()['pieces']), got {_describe(rows)}")
    if isinstance(rows, np.ndarray):
        if rows.dtype.kind not in "iu" or rows.ndim != 2 or rows.shape[1] != 4:
            raise refused()
        mine = rows[rows[:, 3] == rank, :3]
    else:
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, SequenceABC):
            raise refused()
        try:
            listed = [(doc, begin, end) for doc, begin, end, r in rows if r == rank]
        except (TypeError, ValueError):
            raise refused() from None
        mine = np.asarray(listed) if listed else np.zeros((0, 3), dtype=np.int64)
        if mine.dtype.kind not in "iu" or mine.ndim != 2:
            raise refused()
    want = batch.to_dict()["pieces"]
    if not np.array_equal(mine, want[want[:, 3] == rank, :3]):
        raise ValueError(f"rows: rank {rank}'s rows are not the batch's pieces of rank {rank}: pass the batch's "
                         f"pieces (batch.to_dict()['pieces'])")
    return mine[:, 1:].astype(np.int64)


def rank_layout(plan: "distca.Plan", batch: Any, rows: Any, rank: int, device: Union[str, torch.device], *,
                pingpong: bool) -> StepLayout:
    """Rank `rank`'s StepLayout of a plan: what StepPlanner.plan builds after planning, without a
    process group (group fields None; StepPlanner fills them, and the step's identity: a layout
    of rank_layout alone names no planner's step, and making one takes nothing from any planner).
    rows: the batch's pieces as (doc, begin, end, rank). Local (no collective). Timed into
    layout_ms. Bad arguments raise TypeError / ValueError naming them."""
    start = time.perf_counter()
    if not isinstance(plan, (distca.Plan, distca.LoadedPlan)):
        raise TypeError(f"plan must be a distca.Plan (distca.plan) or a loaded plan (distca.load_plan), "
                        f"got {_describe(plan)}")
    if not isinstance(batch, distca.Batch):
        raise TypeError(f"batch must be a distca.Batch (plan.batch), got {_describe(batch)}")
    if batch.num_ranks != plan.num_ranks:
        raise ValueError(f"batch has {batch.num_ranks} ranks, the plan {plan.num_ranks}: pass the plan's batch")
    rank = distca._integer(rank, "rank", 32)
    if not 0 <= rank < batch.num_ranks:
        raise ValueError(f"rank {rank} outside the batch's {batch.num_ranks} ranks")
    if not isinstance(pingpong, bool):
        raise TypeError(f"pingpong must be a bool, got {_describe(pingpong)}")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"device must be a torch.device or a device name, got {_describe(device)}") from e
    mine = _checked_rows(rows, batch, rank)
    tasks = plan.tasks
    parts_index = split_tasks(tasks, batch.num_ranks) if pingpong else (np.arange(len(tasks)),)
    matrix = np.ascontiguousarray(tasks).view(np.int64).reshape(-1, 6)
    parts = []
    for index in parts_index:
        d = _distca.partial_layout(batch, matrix[index], rank)
        parts.append(_part_layout(d, device, len(index)))
    positions = np.concatenate([np.zeros(0, np.int64)] + [np.arange(b, e, dtype=np.int64) for b, e in mine])
    cu = np.concatenate([[0], np.cumsum(mine[:, 1] - mine[:, 0])]).astype(np.int64)
    layout = StepLayout(
        serial=0, rank=rank, world_size=batch.num_ranks, group=None, control_group=None,
        device=device, model=None, num_local_rows=int(len(positions)), positions=_device_tensor(positions, device),
        local_cu_seqlens=_device_tensor(cu, device), parts=parts, plan=plan, backward="stateful", backend="auto",
        check_inputs=True, plan_ms=0.0, layout_ms=0.0)
    layout.layout_ms = (time.perf_counter() - start) * 1e3
    return layout


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


def _error_message(e: BaseException) -> str:
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
    """Collective, the first of every public collective call (see the module docstring): an
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
    what = _CALL_NAMES[call]
    header = torch.tensor([call, planner_id, serial, 0 if message is None else 1], dtype=torch.int64)
    world = dist.get_world_size(control_group)
    gathered = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(gathered, header, group=control_group)
    rows = [g.tolist() for g in gathered]
    # 1. Different calls: nothing else in the headers is comparable.
    calls = _by_value([r[0] for r in rows])
    if len(calls) > 1:
        where = [f"{_ranks_text(ranks)} {('is' if len(ranks) == 1 else 'are') + ' ' if i == 0 else ''}in "
                 f"{_CALL_NAMES.get(c, f'call {c}')}" for i, (c, ranks) in enumerate(calls.items())]
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
        if call == CALL_CAD_ATTENTION:
            stale = [r for r, s in enumerate(serials) if s != max(serials)]
            raise InputError(f"cad_attention: {_ranks_text(stale)} passed the layout of an earlier step than the "
                             f"others: every rank must pass the layout of the same StepPlanner.plan call")
        steps = ", ".join(f"rank {r}: {s}" for r, s in enumerate(serials))
        raise InputError(f"{what}: the ranks are at different calls of the planner ({steps}): every rank must make "
                         f"the same calls in the same order")


def _latest_planner() -> Optional["StepPlanner"]:
    """This process's most recently constructed planner that is still alive, or None."""
    while _PLANNERS:
        planner = _PLANNERS[-1]()
        if planner is not None:
            return planner
        _PLANNERS.pop()
    return None


def _memory_limit(device: torch.device) -> tuple:
    """(bytes, what they are) that no buffer on `device` can exceed: the GPU's memory, this
    machine's memory on CPU, or 1 TiB where neither is known."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0:
            return total, "this machine's memory"
    except (AttributeError, OSError, ValueError):
        pass
    return 1 << 40, "1 TiB"


class StepPlanner:
    """Plans CAD for every step of a process group (see the module docstring).

    group: the process group whose ranks exchange attention (default: the world). With NCCL, a
      gloo group over the same ranks carries the planning metadata and the input checks
      (constructing the planner is then collective over the default group, as new_group is).
    model: a preset name (llama-8b, llama-34b) or a dict with heads, kv_heads, head_dim (and any
      of distca.plan's shape keys): the attention shape of this rank's q/k/v, which cad_attention
      checks its inputs against, and by default what the planner prices.
    cost_model: what the planner prices, when it differs from `model` (a preset or distca.plan's
      model dict): e.g. the whole model with a `tp` key while each rank's layer holds heads / tp.
    policy, tolerance, granularity, max_rank_bytes, profile: as distca.plan.
    throughput: the rates the planner prices attention tasks at, as distca.plan; "auto" (default):
      "cpu" on a CPU device (PyTorch's CPU kernels, where a short document costs what its rows
      cost), the GPU default on CUDA.
    pingpong: "auto" (on for CUDA, where the exchanges overlap compute on NCCL's stream; off on
      CPU), True or False: split each step's tasks into two nano-batches.
    backward: "stateful" (servers keep Q/K/V from the forward) or "stateless" (the backward sends
      them again: less memory on servers, more bytes).
    backend: the server kernel cad_attention uses by default ("auto", "reference", "sdpa",
      "varlen", "flash_attn").
    check_inputs: cad_attention checks its arguments (shapes, dtypes, devices, scale, backend)
      and the layout's step, and starts with the call header (one all_gather of 4 int64 per rank
      over the gloo control group), so bad input on one rank, or ranks in different calls, raise
      the same InputError on all; False skips the header (local checks only: then a rank's bad
      input, or a rank in another call, leaves the others waiting in the exchange).
    prefetch: plan_async() plans a later step on a background thread (its collectives run on a
      gloo group of their own); plan() then goes through that thread too (plan() is
      plan_async().result()), so the planning collectives run in call order.
    static_buffers: receive the exchanges into buffers allocated once (at `buffer_capacity` bytes
      per slot, or grown to the largest step seen) and reused by every layer and step, so the
      exchanges allocate nothing in steady state (planner.buffers counts the allocations).
    host_staging: for testing only: CUDA tensors over a gloo group, each exchange copied to host
      memory, moved by gloo and copied back (slow, synchronous copies). Several processes can then
      share one GPU, which NCCL refuses; the kernels still run on the GPU.

    Every rank constructs its planners in the same order and makes the same calls (plan,
    plan_async, cad_attention) in the same order; planner_id, the same on every rank, names the
    planner in its layouts (see the module docstring). Calls come from one thread.
    """

    def __init__(self, group: Any = None, *, model: Union[str, Mapping[str, Any]],
                 cost_model: Union[str, Mapping[str, Any], None] = None, policy: str = "minlink",
                 tolerance: Union[float, str] = "auto", granularity: Optional[int] = None,
                 max_rank_bytes: Union[int, str, None] = None, pingpong: Union[str, bool] = "auto",
                 backward: str = "stateful", backend: str = "auto", device: Union[str, torch.device, None] = None,
                 check_inputs: bool = True, prefetch: bool = False, profile: Optional[str] = None,
                 static_buffers: bool = False, buffer_capacity: int = 0,
                 throughput: Union[str, Mapping[str, Any], None] = "auto", host_staging: bool = False):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("StepPlanner needs torch.distributed initialised (dist.init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"this process (rank {dist.get_rank()}) is not in the planner's group")
        self.world_size = dist.get_world_size(self.group)
        self.model = _model_shape(model)
        self._plan_model = _planner_model(model if cost_model is None else cost_model)
        if policy not in distca.planner_names():
            raise ValueError(f"policy must be one of {', '.join(distca.planner_names())}, got {policy!r}")
        if pingpong not in ("auto", True, False):
            raise ValueError(f"pingpong must be 'auto', True or False, got {pingpong!r}")
        if backward not in ("stateful", "stateless"):
            raise ValueError(f"backward must be 'stateful' or 'stateless', got {backward!r}")
        if not isinstance(check_inputs, bool) or not isinstance(prefetch, bool):
            raise TypeError("check_inputs and prefetch must be bools")
        backend_name = dist.get_backend(self.group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend_name == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        if backend_name == "nccl" and self.device.type != "cuda":
            raise ValueError(f"the group uses NCCL, which moves CUDA tensors; device {self.device} is not one")
        if not isinstance(host_staging, bool):
            raise TypeError(f"host_staging must be a bool, got {type(host_staging).__name__}")
        if host_staging and not (backend_name == "gloo" and self.device.type == "cuda"):
            raise ValueError(f"host_staging is for CUDA tensors over a gloo group; this is {backend_name} with "
                             f"{self.device.type} tensors")
        if backend_name == "gloo" and self.device.type == "cuda" and not host_staging:
            raise ValueError("the group uses gloo; use an NCCL group for CUDA tensors (or, for testing, "
                             "host_staging=True: the exchanges through host memory)")
        self.host_staging = host_staging
        if throughput == "auto":
            throughput = "cpu" if self.device.type == "cpu" else None
        self.options: dict[str, Any] = dict(policy=policy, tolerance=tolerance, granularity=granularity,
                            max_rank_bytes=max_rank_bytes, profile=profile, throughput=throughput)
        # distca.plan's own checks, once here (a bad tolerance fails at construction, on every rank),
        # its messages naming this constructor's arguments rather than the command line's flags.
        try:
            distca.plan([[16]], model=self._plan_model, **self.options)
        except ValueError as e:
            raise ValueError(distca.python_names(str(e))) from None
        if (isinstance(buffer_capacity, bool) or not isinstance(buffer_capacity, (int, np.integer))
                or buffer_capacity < 0):
            raise ValueError(f"buffer_capacity must be a non-negative integer of bytes, got {buffer_capacity!r}")
        limit, limit_what = _memory_limit(self.device)
        if buffer_capacity > limit:
            raise ValueError(f"buffer_capacity {int(buffer_capacity)} bytes is more than {limit_what} ({limit} bytes): "
                             f"give the bytes of one exchange slot, or 0 to grow each slot to the largest step")
        self.pingpong = (self.device.type == "cuda") if pingpong == "auto" else bool(pingpong)
        self.backward = backward
        self.backend = backend
        default_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        get_backend(backend, self.device, default_dtype, head_dim=self.model.head_dim)
        # What `auto` runs (the measured table's choice per kind of task list, or the default order's).
        self.backend_note = (describe_auto(self.device, default_dtype, self.model.head_dim)
                             if backend == "auto" else "")
        self.check_inputs = check_inputs
        ranks = dist.get_process_group_ranks(self.group)
        self.control_group = self.group if backend_name == "gloo" else dist.new_group(ranks, backend="gloo")
        self._plan_group = dist.new_group(ranks, backend="gloo") if prefetch else self.control_group
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "distca-plan") if prefetch else None
        self._config_digest = hashlib.sha256(json.dumps(
            [self.options, self._plan_model, self.model.__dict__, self.pingpong, backward,
             backend if isinstance(backend, str) else type(backend).__name__, check_inputs, prefetch, host_staging],
            sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.buffers = ExchangeBuffers(self.device, int(buffer_capacity)) if static_buffers else None
        self.current: Optional[StepLayout] = None
        # The planner's identity: its settings, its group's ranks and its place among this process's
        # planners over those ranks (the same on every rank when all construct them alike).
        key = tuple(int(r) for r in ranks)
        self._ordinal = _PLANNER_COUNTS[key] = _PLANNER_COUNTS.get(key, 0) + 1
        digest = hashlib.sha256(json.dumps([self._config_digest, list(key), self._ordinal]).encode()).digest()
        self.planner_id = (int.from_bytes(digest[:8], "little") >> 1) or 1
        self._serial = 0              # plan/plan_async calls that passed their header
        _PLANNERS.append(weakref.ref(self))

    def plan(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None) -> StepLayout:
        """Collective over the group: this rank's documents -> the step's layout.

        cu_seqlens: this rank's rows are whole documents end to end, with these boundaries (a
          sequence, 1-d tensor or 1-d array of integers from 0).
        pieces: rows (doc_key, begin, end, doc_length) for documents that span ranks: this rank holds
          tokens [begin, end) of the document every rank names `doc_key`, its pieces in row order.
        Bad input on any rank, or a rank in another call, raises the same InputError on every rank.
        """
        local, serial = self._begin(CALL_PLAN, cu_seqlens, pieces)
        if self._executor is not None:
            # Behind any plan_async before it, on the planning thread and group: the planning
            # collectives run in call order on every rank.
            layout = self._executor.submit(self._plan, local, serial, self._plan_group).result()
        else:
            layout = self._plan(local, serial, self.control_group)
        self.current = layout
        return layout

    def plan_async(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None) -> "PlannedStep":
        """Starts planning a later step on the planner's thread (needs prefetch=True); every rank
        calls it in the same order. Its arguments are checked, and its step numbered, here in the
        caller's thread (the call header), the planning itself runs behind any plan before it.
        PlannedStep.result() waits for it and makes it current."""
        local, serial = self._begin(CALL_PLAN_ASYNC, cu_seqlens, pieces)
        assert self._executor is not None  # _begin refused plan_async without one, on every rank
        return PlannedStep(self, self._executor.submit(self._plan, local, serial, self._plan_group))

    def _begin(self, call: int, cu_seqlens: Any, pieces: Any) -> tuple:
        """The local checks and the call header, in the caller's thread -> (this rank's pieces, the
        step's serial). The serial is taken only when the header passes, on every rank alike."""
        local, message = None, None
        if call == CALL_PLAN_ASYNC and self._executor is None:
            message = "plan_async needs StepPlanner(..., prefetch=True) (and a planner not closed)"
        else:
            try:
                local = _local_pieces(self.rank, cu_seqlens, pieces)
            except Exception as e:  # noqa: BLE001 (any rank's fault is agreed on, then raised everywhere)
                message = _error_message(e)
        serial = self._serial + 1
        call_header(self.control_group, call, self.planner_id, serial, message, (self._config_digest, self._ordinal))
        self._serial = serial
        return local, serial

    def _plan(self, local: list, serial: int, group: Any) -> StepLayout:
        start = time.perf_counter()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=group)
        try:
            batch, rows = _global_batch(gathered)
        except ValueError as e:
            raise InputError(f"StepPlanner.plan: {e}") from e
        plan = distca.plan(batch, model=self._plan_model, **self.options)
        digest = torch.tensor([plan.hash & 0x7FFFFFFFFFFFFFFF, -(plan.hash & 0x7FFFFFFFFFFFFFFF)], dtype=torch.int64)
        dist.all_reduce(digest, op=dist.ReduceOp.MAX, group=group)
        if digest[0].item() != -digest[1].item():
            raise RuntimeError("StepPlanner.plan: the ranks made different plans from the same documents "
                               "(different distca builds?)")
        plan_ms = (time.perf_counter() - start) * 1e3
        layout = rank_layout(plan, batch, rows, self.rank, self.device, pingpong=self.pingpong)
        layout.serial, layout.planner_id = serial, self.planner_id
        layout.group, layout.control_group, layout.model = self.group, self.control_group, self.model
        layout.backward, layout.backend, layout.check_inputs = self.backward, self.backend, self.check_inputs
        layout.plan_ms, layout.buffers = plan_ms, self.buffers
        layout.backend_note, layout.host_staging = self.backend_note, self.host_staging
        return layout

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class PlannedStep:
    """A step being planned on the planner's thread."""

    def __init__(self, planner: StepPlanner, future: concurrent.futures.Future):
        self._planner, self._future = planner, future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> StepLayout:
        layout = self._future.result()
        self._planner.current = layout
        return layout
