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
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

import distca
from distca import _distca

from .backends import ServerTasks, TaskGroup, get_backend

_SERIALS = itertools.count(1)


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
    every layer of the step (forward and backward)."""
    serial: int                    # the same on every rank for the same step
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

    @property
    def hash(self) -> int:
        return self.plan.hash

    @property
    def is_pingpong(self) -> bool:
        return len(self.parts) == 2

    def server_kernel(self, dtype: torch.dtype, name: Optional[str] = None):
        return get_backend(name or self.backend, self.device, dtype)

    def __repr__(self) -> str:
        return (f"<distca.torch.StepLayout step {self.serial}: rank {self.rank}/{self.world_size}, "
                f"{self.num_local_rows} rows, {len(self.parts)} nano-batch(es), plan {self.plan.hash:016x}>")


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


def _as_int_list(x: Any, what: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got a {x.dtype} tensor")
        x = x.detach().cpu().tolist()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got a {x.dtype} array")
        x = x.tolist()
    out = []
    for v in x:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must hold integers, got {v!r}")
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
        if any(n <= 0 for n in lengths):
            raise ValueError(f"cu_seqlens must increase strictly (document {next(i for i, n in enumerate(lengths) if n <= 0)} "
                             f"has length {min(lengths)})")
        return [((rank, i), 0, n, n) for i, n in enumerate(lengths)]
    rows = []
    for i, p in enumerate(pieces):
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


def rank_layout(plan: "distca.Plan", batch: Any, rows: list, rank: int, device: torch.device, *,
                pingpong: bool) -> StepLayout:
    """Rank `rank`'s StepLayout of a plan: what StepPlanner.plan builds after planning, without a
    process group (group fields None; StepPlanner fills them). rows: the batch's pieces as
    (doc, begin, end, rank). Timed into layout_ms."""
    start = time.perf_counter()
    tasks = plan.tasks
    parts_index = split_tasks(tasks, batch.num_ranks) if pingpong else (np.arange(len(tasks)),)
    matrix = np.ascontiguousarray(tasks).view(np.int64).reshape(-1, 6)
    parts = []
    for index in parts_index:
        d = _distca.partial_layout(batch, matrix[index], rank)
        parts.append(_part_layout(d, device, len(index)))
    mine = [(b, e) for _, b, e, r in rows if r == rank]
    positions = np.concatenate([np.arange(b, e, dtype=np.int64) for b, e in mine])
    cu = np.concatenate([[0], np.cumsum([e - b for b, e in mine])]).astype(np.int64)
    layout = StepLayout(
        serial=next(_SERIALS), rank=rank, world_size=batch.num_ranks, group=None, control_group=None,
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
    check_inputs: cad_attention checks shapes, dtypes, devices and the layout's step on every rank
      and agrees on the result (one small all-reduce over the gloo group per call), so a bad input
      on one rank raises the same error on all; False skips the agreement (local checks only).
    prefetch: plan_async() may plan the next step on a background thread (its collectives run on
      a gloo group of their own).
    static_buffers: receive the exchanges into buffers allocated once (at `buffer_capacity` bytes
      per slot, or grown to the largest step seen) and reused by every layer and step, so the
      exchanges allocate nothing in steady state (planner.buffers counts the allocations).
    """

    def __init__(self, group: Any = None, *, model: Union[str, Mapping[str, Any]],
                 cost_model: Union[str, Mapping[str, Any], None] = None, policy: str = "minlink",
                 tolerance: Union[float, str] = "auto", granularity: Optional[int] = None,
                 max_rank_bytes: Union[int, str, None] = None, pingpong: Union[str, bool] = "auto",
                 backward: str = "stateful", backend: str = "auto", device: Union[str, torch.device, None] = None,
                 check_inputs: bool = True, prefetch: bool = False, profile: Optional[str] = None,
                 static_buffers: bool = False, buffer_capacity: int = 0,
                 throughput: Union[str, Mapping[str, Any], None] = "auto"):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("StepPlanner needs torch.distributed initialised (dist.init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
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
        if backend_name == "gloo" and self.device.type == "cuda":
            raise ValueError("the group uses gloo; use an NCCL group for CUDA tensors")
        if throughput == "auto":
            throughput = "cpu" if self.device.type == "cpu" else None
        self.options: dict[str, Any] = dict(policy=policy, tolerance=tolerance, granularity=granularity,
                            max_rank_bytes=max_rank_bytes, profile=profile, throughput=throughput)
        # distca.plan's own checks, once here (a bad tolerance fails at construction, on every rank).
        distca.plan([[16]], model=self._plan_model, **self.options)
        self.pingpong = (self.device.type == "cuda") if pingpong == "auto" else bool(pingpong)
        self.backward = backward
        self.backend = backend
        get_backend(backend, self.device, torch.float32 if self.device.type == "cpu" else torch.bfloat16,
                    head_dim=self.model.head_dim)
        self.check_inputs = check_inputs
        ranks = dist.get_process_group_ranks(self.group)
        self.control_group = self.group if backend_name == "gloo" else dist.new_group(ranks, backend="gloo")
        self._plan_group = dist.new_group(ranks, backend="gloo") if prefetch else self.control_group
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "distca-plan") if prefetch else None
        self._config_digest = hashlib.sha256(json.dumps(
            [self.options, self._plan_model, self.model.__dict__, self.pingpong, backward, backend, check_inputs],
            sort_keys=True, default=str).encode()).hexdigest()[:16]
        from .attention import ExchangeBuffers
        if isinstance(buffer_capacity, bool) or not isinstance(buffer_capacity, int) or buffer_capacity < 0:
            raise ValueError(f"buffer_capacity must be a non-negative integer of bytes, got {buffer_capacity!r}")
        self.buffers = ExchangeBuffers(self.device, buffer_capacity) if static_buffers else None
        self.current: Optional[StepLayout] = None

    def plan(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None) -> StepLayout:
        """Collective over the group: this rank's documents -> the step's layout.

        cu_seqlens: this rank's rows are whole documents end to end, with these boundaries.
        pieces: rows (doc_key, begin, end, doc_length) for documents that span ranks: this rank holds
          tokens [begin, end) of the document every rank names `doc_key`, its pieces in row order.
        """
        layout = self._plan(cu_seqlens, pieces, self.control_group)
        self.current = layout
        return layout

    def plan_async(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None) -> "PlannedStep":
        """Starts planning a later step on the planner's thread (needs prefetch=True); every rank
        calls it in the same order. PlannedStep.result() waits for it and makes it current."""
        if self._executor is None:
            raise ValueError("plan_async needs StepPlanner(..., prefetch=True)")
        return PlannedStep(self, self._executor.submit(self._plan, cu_seqlens, pieces, self._plan_group))

    def _plan(self, cu_seqlens: Any, pieces: Any, group: Any) -> StepLayout:
        start = time.perf_counter()
        message = None
        try:
            local = _local_pieces(self.rank, cu_seqlens, pieces)
        except (TypeError, ValueError) as e:
            local, message = [], str(e)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (self._config_digest, message, local), group=group)
        bad = [(r, m) for r, (_, m, _) in enumerate(gathered) if m is not None]
        if bad:
            raise InputError(f"StepPlanner.plan: rank {bad[0][0]}: {bad[0][1]}")
        digests = {d for d, _, _ in gathered}
        if len(digests) > 1:
            raise InputError("StepPlanner.plan: the ranks' planners differ in their settings (policy, tolerance, "
                             "granularity, model, pingpong, backward, backend or check_inputs): construct them alike")
        try:
            batch, rows = _global_batch([p for _, _, p in gathered])
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
        layout.group, layout.control_group, layout.model = self.group, self.control_group, self.model
        layout.backward, layout.backend, layout.check_inputs = self.backward, self.backend, self.check_inputs
        layout.plan_ms, layout.buffers = plan_ms, self.buffers
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
