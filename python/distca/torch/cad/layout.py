"""A step's exchange layout on one rank, as device tensors: StepLayout (what cad_attention takes in
every layer of the step), its nano-batches' PartLayouts and the ModelShape it checks inputs
against, and rank_layout, which builds it from a plan without any process group (StepPlanner.plan
calls it after planning; distca.torch.cad.planner).
"""
from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

import distca
from distca import _distca
from distca.arguments import integer_arg

from ..kernels.backends import get_backend
from ..kernels.server import ServerTasks, TaskGroup
from .agreement import describe
from .nanobatch import NanoSplit, split_plan


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
    merge_slot: torch.Tensor       # (merge entries) each entry's row in the step's merged_rows
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
    merged_rows: torch.Tensor      # (split rows) the distinct rows of every part's merge_rows
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
    grad_return: str = "fp32"      # the dtype dK/dV partial sums travel in on the backward return (fp32 | bf16)
    split: Optional[NanoSplit] = None  # ping-pong's split of the plan (cuts, duplicated K/V rows), or None
    backward_layout: Optional["StepLayout"] = None  # the layout the backward runs on, when planned apart
    # The stateful servers' memory (keeps_state): per rank of the plan, the Q rows and K/V rows its
    # tasks compute on (every nano-batch), and the rows it owns; the budget in bytes a rank's
    # servers may keep beyond what the stateless backward keeps (None: no limit), and how many of
    # this step's cad_attention calls kept their servers' state so far.
    server_rows: Optional[tuple] = None
    state_budget: Optional[int] = None
    kept_calls: int = 0
    stateless_calls: int = 0

    def extra_state_bytes(self, dtype: torch.dtype) -> int:
        """What the fullest rank's servers keep in one cad_attention call under the stateful
        backward beyond what the stateless one keeps there (the owner's own Q, K and V): their Q
        rows and K/V rows less its own rows, at `dtype`; 0 when no rank's servers keep more."""
        if self.server_rows is None or self.model is None:
            return 0
        q_rows, kv_rows, own_rows = self.server_rows
        m, e = self.model, torch.empty((), dtype=dtype).element_size()
        q_width, kv_width = m.num_q_heads * m.head_dim, 2 * m.num_kv_heads * m.head_dim
        extra = q_rows * q_width + kv_rows * kv_width - own_rows * (q_width + kv_width)
        return max(int(extra.max()) * e, 0) if len(extra) else 0

    def keeps_state(self, dtype: torch.dtype) -> bool:
        """Whether this cad_attention call's servers keep the Q/K/V they computed on for its
        backward (stateful) or the backward sends them again (stateless). A stateful layout keeps
        them in as many calls of the step as the state budget holds on the fullest rank, counted
        from the plan alike on every rank (so every rank takes the same turn in every call); the
        rest of the step's calls go stateless."""
        if self.backward != "stateful":
            return False
        budget = self.state_budget
        if budget is not None and (self.kept_calls + 1) * self.extra_state_bytes(dtype) > budget:
            self.stateless_calls += 1
            return False
        self.kept_calls += 1
        return True

    def set_backward_layout(self, other: "StepLayout") -> None:
        """The backward of every cad_attention call made with this layout runs on `other`: the same
        rows of this rank, planned in another step (a pipeline's backward tick, pooled with other
        stages' micro-batches; distca.torch.pipeline). Both stateless (the backward sends Q/K/V
        again; a stateful server's saved rows belong to this layout's plan) and of one group, rank,
        device and model, with the same rows: else ValueError."""
        if not isinstance(other, StepLayout):
            raise TypeError(f"set_backward_layout takes a StepLayout (StepPlanner.plan), got {describe(other)}")
        problems = []
        if self.backward != "stateless" or other.backward != "stateless":
            problems.append(f"both layouts must be stateless (StepPlanner(backward='stateless')), "
                            f"got {self.backward} and {other.backward}")
        for what, mine, theirs in (("world size", self.world_size, other.world_size), ("rank", self.rank, other.rank),
                                   ("device", self.device, other.device), ("model", self.model, other.model)):
            if mine != theirs:
                problems.append(f"{what} {mine} against {theirs}")
        if self.group is not other.group:
            problems.append("different process groups")
        if not (torch.equal(self.local_cu_seqlens.cpu(), other.local_cu_seqlens.cpu())
                and torch.equal(self.positions.cpu(), other.positions.cpu())):
            problems.append(f"different rows (documents {self.local_cu_seqlens.tolist()[:6]} against "
                            f"{other.local_cu_seqlens.tolist()[:6]})")
        if problems:
            raise ValueError("set_backward_layout: the backward layout must plan this layout's rows: "
                             + "; ".join(problems))
        self.backward_layout = other

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


def _device_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


def _part_layout(d: dict, device: torch.device, num_tasks: int, merge_slot: np.ndarray) -> PartLayout:
    dev = lambda a: _device_tensor(a, device)  # noqa: E731
    groups = []
    for name, q_offset, k_offset, is_causal in (("causal", 0, 0, True),
                                                ("noncausal", d["causal_q_rows"], d["causal_kv_rows"], False)):
        g = d[name]
        cu_q, cu_k = np.asarray(g["cu_seqlens_q"], np.int64), np.asarray(g["cu_seqlens_k"], np.int64)
        groups.append(TaskGroup(is_causal, int(q_offset), int(k_offset), cu_q, cu_k, int(g["max_seqlen_q"]),
                                int(g["max_seqlen_k"]), torch.from_numpy(cu_q.astype(np.int32)).to(device),
                                torch.from_numpy(cu_k.astype(np.int32)).to(device)))
    tasks = ServerTasks((groups[0], groups[1]), len(d["q_gather"]), len(d["kv_gather"]), device)
    return PartLayout(
        q_send_index=dev(d["q_send_index"]), kv_send_index=dev(d["kv_send_index"]),
        q_send_splits=[int(x) for x in d["q_send_splits"]], q_recv_splits=[int(x) for x in d["q_recv_splits"]],
        kv_send_splits=[int(x) for x in d["kv_send_splits"]], kv_recv_splits=[int(x) for x in d["kv_recv_splits"]],
        q_gather=dev(d["q_gather"]), kv_gather=dev(d["kv_gather"]),
        copy_entries=dev(d["copy_entries"]), copy_rows=dev(d["copy_rows"]),
        merge_entries=dev(d["merge_entries"]), merge_rows=dev(d["merge_rows"]),
        merge_slot=dev(merge_slot), tasks=tasks, num_tasks=num_tasks)


def _checked_rows(rows: Any, batch: Any, rank: int) -> np.ndarray:
    """rank_layout's rows checked against the batch -> this rank's (begin, end) rows, (n, 2) int64."""
    def refused() -> TypeError:
        return TypeError(f"rows must be the batch's pieces, (doc, begin, end, rank) rows of integers "
                         f"(batch.to_dict()['pieces']), got {describe(rows)}")
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


def _server_rows(parts: Sequence, batch: Any) -> tuple:
    """Per rank: the Q rows and K/V rows of the tasks it serves, over the nano-batches' task lists
    (a task of rows [q0, q1) over keys [k0, k1) gathers q1 - q0 and k1 - k0 of them), and the rows
    it owns (int64 arrays)."""
    n = batch.num_ranks
    q_rows, kv_rows = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for tasks in parts:
        t = np.ascontiguousarray(tasks).view(np.int64).reshape(-1, 6)
        np.add.at(q_rows, t[:, 5], t[:, 2] - t[:, 1])
        np.add.at(kv_rows, t[:, 5], t[:, 4] - t[:, 3])
    pieces = np.asarray(batch.to_dict()["pieces"], np.int64).reshape(-1, 4)
    own = np.zeros(n, np.int64)
    np.add.at(own, pieces[:, 3], pieces[:, 2] - pieces[:, 1])
    return q_rows, kv_rows, own


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
                        f"got {describe(plan)}")
    if not isinstance(batch, distca.Batch):
        raise TypeError(f"batch must be a distca.Batch (plan.batch), got {describe(batch)}")
    if batch.num_ranks != plan.num_ranks:
        raise ValueError(f"batch has {batch.num_ranks} ranks, the plan {plan.num_ranks}: pass the plan's batch")
    rank = integer_arg(rank, "rank", 32)
    if not 0 <= rank < batch.num_ranks:
        raise ValueError(f"rank {rank} outside the batch's {batch.num_ranks} ranks")
    if not isinstance(pingpong, bool):
        raise TypeError(f"pingpong must be a bool, got {describe(pingpong)}")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"device must be a torch.device or a device name, got {describe(device)}") from e
    mine = _checked_rows(rows, batch, rank)
    split = split_plan(plan.tasks, batch, tolerance=plan.tolerance) if pingpong else None
    routes = []
    for part_tasks in (split.parts if split is not None else (plan.tasks,)):
        matrix = np.ascontiguousarray(part_tasks).view(np.int64).reshape(-1, 6)
        routes.append((_distca.partial_layout(batch, matrix, rank), len(part_tasks)))
    # A row's key splits may be in both nano-batches: its partial results are merged over both,
    # so every part's merge entries index one list of the step's merged rows.
    merge_rows = [np.asarray(d["merge_rows"], np.int64) for d, _ in routes]
    merged_rows, merge_slot = np.unique(np.concatenate(merge_rows), return_inverse=True)
    bounds = np.cumsum([0] + [len(m) for m in merge_rows])
    parts = [_part_layout(d, device, n, merge_slot[bounds[i]:bounds[i + 1]]) for i, (d, n) in enumerate(routes)]
    server_rows = _server_rows(split.parts if split is not None else (plan.tasks,), batch)
    positions = np.concatenate([np.zeros(0, np.int64)] + [np.arange(b, e, dtype=np.int64) for b, e in mine])
    cu = np.concatenate([[0], np.cumsum(mine[:, 1] - mine[:, 0])]).astype(np.int64)
    layout = StepLayout(
        serial=0, rank=rank, world_size=batch.num_ranks, group=None, control_group=None,
        device=device, model=None, num_local_rows=int(len(positions)), positions=_device_tensor(positions, device),
        local_cu_seqlens=_device_tensor(cu, device), parts=parts, merged_rows=_device_tensor(merged_rows, device),
        plan=plan, backward="stateful", backend="auto", check_inputs=True, plan_ms=0.0, layout_ms=0.0, split=split,
        server_rows=server_rows)
    layout.layout_ms = (time.perf_counter() - start) * 1e3
    return layout


PHASES = ("fwd_dispatch", "fwd_return", "bwd_dispatch", "bwd_return")


def exchange_bytes(layout: StepLayout, dtype: torch.dtype, *, model: Optional[ModelShape] = None,
                   backward: Optional[str] = None, grad_return: Optional[str] = None) -> dict:
    """The bytes this rank sends to other ranks in one cad_attention call (one layer, forward and
    backward) with q/k/v of `dtype`, per phase (PHASES) and in all ("total"), summed over the
    nano-batches; rows a rank sends itself are not counted (they never leave it). model,
    backward and grad_return default to the layout's. What cad_attention's all_to_all_single
    calls move: Q and K/V rows (fwd_dispatch), O + LSE per Q entry (fwd_return), dO + O + LSE
    per Q entry and, stateless, Q and K/V again (bwd_dispatch), dQ per Q entry and dK/dV per K/V
    entry in the grad_return dtype (bwd_return)."""
    shape = model or layout.model
    if shape is None:
        raise ValueError("exchange_bytes: the layout has no model shape (rank_layout alone): pass model=ModelShape(...)")
    backward = backward or layout.backward
    grad = {"fp32": 4, "bf16": 2}[grad_return or layout.grad_return]
    e = torch.empty((), dtype=dtype).element_size()
    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    out = dict.fromkeys(PHASES, 0)
    for p in layout.parts:
        q_out = sum(p.q_send_splits) - p.q_send_splits[layout.rank]     # Q entries this rank sends as an owner
        kv_out = sum(p.kv_send_splits) - p.kv_send_splits[layout.rank]
        q_back = sum(p.q_recv_splits) - p.q_recv_splits[layout.rank]     # Q entries it returns as a server
        kv_back = sum(p.kv_recv_splits) - p.kv_recv_splits[layout.rank]
        out["fwd_dispatch"] += q_out * hq * d * e + kv_out * 2 * hkv * d * e
        out["fwd_return"] += q_back * (hq * d * e + hq * 4)
        out["bwd_dispatch"] += q_out * (2 * hq * d * e + hq * 4)
        if backward == "stateless":
            out["bwd_dispatch"] += q_out * hq * d * e + kv_out * 2 * hkv * d * e
        out["bwd_return"] += q_back * hq * d * e + kv_back * 2 * hkv * d * grad
    out["total"] = sum(out[k] for k in PHASES)
    return out
