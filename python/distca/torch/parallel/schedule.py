"""ScheduleCADLockstep: the paper's lockstep 1F1B for torch.distributed.pipelining, with CAD.

PyTorch's own schedules run each rank's action list on its own clock and skip its idle slots, so a
stage in a bubble never reaches a collective. This schedule walks distca's lockstep tick table
(distca.pipeline_schedule("cad", P, M): P - 1 warm-up forward ticks, M steady [forward,
backward] pairs, P - 1 cool-down backward ticks) on every rank of the CAD group, every tick:

    each tick        every rank agrees on the tick (one all_gather of 4 int64: a rank that skipped
                     a tick or walks another table raises the same InputError on every rank),
                     plans (StepPlanner.plan over the CAD group: the DP x PP ranks of
                     one TP index) with its micro-batch's documents, or [0] when it idles, so the
                     core attention of every busy (stage, micro-batch) of the tick is balanced
                     over all ranks, idle stages included
    forward tick     busy: receive the activations (P2P on the stage's group), forward_one_chunk
                     with the tick's layout current (the stage module reads schedule.current),
                     send them on; idle: cad_serve once per attention layer
    backward tick    busy: receive the gradient, the forward's layout gets this tick's layout as
                     its backward (stateless: Q/K/V travel again to this tick's servers),
                     backward_one_chunk, send the gradient back; idle: cad_serve(backward=True)
                     once per attention layer

P2P activations use the stage's group and CAD's exchanges the planner's, never the same one. With
the planner's prefetch, tick t + 1 is planned on the planner's thread while tick t computes. Every
stage has the same number of attention layers (agreed on at construction, refused with the reason
on every rank otherwise), since an idle stage serves as many exchanges as a busy one makes.

The stage's micro-batch keyword `documents` (default "cu_seqlens") holds its packed documents'
boundaries, the same on every stage of a pipeline; the module reads its rows' positions and core
attention from schedule.current (a StepLayout): see distca.torch.train.model.TransformerStage.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

import distca

from ..cad.agreement import InputError
from ..cad.attention import cad_attention
from ..cad.layout import StepLayout
from ..cad.planner import StepPlanner
from ..cad.serve import cad_serve
from ..trace import interval, now, span
from .tensor import check_tp_plan


@dataclass
class TickRecord:
    """One tick of the last step on this rank."""
    tick: int
    direction: str                 # "F" or "B": what every busy stage runs
    micro_batch: Optional[int]     # this stage's, or None when it idles (serves only)
    local_rows: int                # this rank's own rows
    served_rows: int               # query rows this rank's server computed (its own included)
    planned_rows: int              # query rows the tick's plan gives this rank's server
    served_for_others: int         # of served_rows, those of other ranks
    plan_imbalance: float          # the tick's plan: the planner's estimate of its busiest server over the mean
    plan_ms: float                 # wall: planning (gather, C++, hash check) and the layout, after the tick's agreement
    compute_ms: float              # the tick's work on this rank after planning: P2P, forward/backward, serving

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, tick: int, direction: str, micro_batch: Optional[int], layout: StepLayout, plan_ms: float,
           compute_ms: float) -> "TickRecord":
        """The record of a tick this rank ran with `layout` (the tick's plan)."""
        served = _served_rows(layout)
        return cls(tick, direction, micro_batch, layout.num_local_rows, served, _planned_rows(layout),
                   served - sum(p.q_recv_splits[layout.rank] for p in layout.parts),
                   float(layout.plan.load["imbalance"]), plan_ms, compute_ms)


def _served_rows(layout: StepLayout) -> int:
    return sum(p.num_q_recv for p in layout.parts)


def _planned_rows(layout: StepLayout) -> int:
    """The distinct query rows of the tasks the plan gives this rank's server."""
    tasks = layout.plan.tasks
    rows: set = set()
    for t in tasks[tasks["server"] == layout.rank]:
        rows.update((int(t["doc"]), q) for q in range(int(t["q0"]), int(t["q1"])))
    return len(rows)


def _wait(works: list, what: str = "") -> None:
    with span(f"p2p {what}".rstrip(), track="exchange") if what else contextlib.nullcontext():
        for w in works:
            w.wait()


def _post(ops: list) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


def _tick_text(tick: tuple) -> str:
    return " ".join(f"{op}{m}" if op else "." for op, m in tick)


def agree_on_tick(control_group: Any, t: int, tick: tuple, stage: int) -> None:
    """Collective, first of every tick: every rank of the CAD group is at the same tick of the
    same table. One all_gather of 4 int64 per rank ([tick, the tick's row hash, stage, slot]);
    on a mismatch (a rank that skipped a tick, walks another table, or runs another micro-batch)
    the same InputError on every rank, naming each rank's tick."""
    text = _tick_text(tick)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    op, m = tick[stage]
    mine = torch.tensor([t, digest, stage, ({"F": 1, "B": 2}.get(op, 0) << 32) | (m + 1 if op else 0)],
                        dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(control_group))]
    dist.all_gather(gathered, mine, group=control_group)
    if len({(int(g[0]), int(g[1])) for g in gathered}) == 1:
        return
    texts: list = [None] * len(gathered)
    dist.all_gather_object(texts, (t, stage, text), group=control_group)
    by: dict = {}
    for r, (tt, s, row) in enumerate(texts):
        by.setdefault((tt, row), []).append(f"{r} (stage {s})")
    raise InputError("ScheduleCADLockstep: the ranks are at different ticks (a rank skipped a tick, or walks another "
                     "table): " + "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} at tick {tt} [{row}]"
                                            for (tt, row), rs in by.items()))


def _unwrap(e: RuntimeError) -> BaseException:
    """PipelineStage wraps a forward's exception in a RuntimeError of its own: an InputError (the
    same on every rank) is raised as itself."""
    cause = e.__cause__
    while cause is not None and not isinstance(cause, InputError):
        cause = cause.__cause__
    return cause if cause is not None else e


class ScheduleCADLockstep(PipelineScheduleSingle):
    """A PipelineScheduleSingle (one stage per rank) walking distca's lockstep tick table with CAD
    (see the module docstring).

    stage: the rank's PipelineStage (static input_args/output_args: shape inference would run the
      module, and so its collectives, out of step). Every micro-batch holds the same tokens, so
      the activations keep one shape.
    planner: a StepPlanner over the CAD group (every stage of every replica of this TP index),
      backward="stateless" (a backward tick's plan differs from its forward's).
    layers_per_stage: the attention layers of this rank's stage, the same on every stage.
    documents: the micro-batch keyword holding its documents' cu_seqlens, or a function of the
      micro-batch's keywords that returns them (e.g. from TorchTitan's positions).
    dtype: the dtype of q/k/v, which an idle stage serves in.
    loss_fn, scale_grads: as PipelineScheduleSingle's.
    tp_group: with tensor parallelism, the rank's TP group: every tick's plan hash is checked
      across it (parallel.tensor.check_tp_plan).
    backend: the server kernel (a name or ServerKernel) of attention() and of the idle stages'
      serving; default the planner's.
    """

    def __init__(self, stage: Any, n_microbatches: int, planner: StepPlanner, *, layers_per_stage: int,
                 documents: Any = "cu_seqlens", dtype: torch.dtype = torch.float32,
                 loss_fn: Optional[Callable] = None, scale_grads: bool = True, tp_group: Any = None,
                 backend: Any = None):
        if not isinstance(planner, StepPlanner):
            raise TypeError(f"planner must be a StepPlanner, got {type(planner).__name__}")
        if planner.closed:
            raise ValueError("planner is closed")
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        self._planner = planner
        self._tp_group = tp_group
        self.backend = backend
        self._documents = documents
        self._dtype = dtype
        self.table = distca.pipeline_schedule("cad", self._num_stages, n_microbatches)
        self.current: Optional[StepLayout] = None
        self.records: list = []
        problem = None
        if planner.backward != "stateless":
            problem = ("the planner must be stateless (StepPlanner(backward='stateless')): a backward tick pools "
                       "other stages' micro-batches than its forward tick, so its plan differs")
        elif isinstance(layers_per_stage, bool) or not isinstance(layers_per_stage, int) or layers_per_stage < 1:
            problem = f"layers_per_stage must be a positive integer, got {layers_per_stage!r}"
        mine = (int(stage.stage_index), int(self._num_stages), layers_per_stage, int(n_microbatches))
        gathered: list = [None] * planner.world_size
        dist.all_gather_object(gathered, (mine, problem), group=planner.control_group)
        bad = next(((r, p) for r, (_, p) in enumerate(gathered) if p is not None), None)
        if bad is not None:
            raise InputError(f"ScheduleCADLockstep: rank {bad[0]}: {bad[1]}")
        layers = {g[0][2] for g in gathered}
        if len(layers) > 1:
            by_stage = sorted({(g[0][0], g[0][2]) for g in gathered})
            raise InputError("ScheduleCADLockstep: every stage needs the same number of attention layers (an idle "
                             "stage serves one exchange per layer of the busy ones), got "
                             + ", ".join(f"stage {s}: {n}" for s, n in by_stage))
        for what, i in (("stages", 1), ("micro-batches", 3)):
            values = {g[0][i] for g in gathered}
            if len(values) > 1:
                raise InputError(f"ScheduleCADLockstep: the ranks' schedules differ in their {what}: "
                                 f"{sorted(values)} (every rank walks one tick table)")
        self._layers = layers_per_stage

    def attention(self, cu_seqlens: Any = None) -> tuple:
        """A stage module's attention source during this schedule's forward tick: (the rows'
        positions, core attention by CAD over the tick's layout). cu_seqlens is the micro-batch's
        (already planned; unused here)."""
        layout = self.current
        if layout is None:
            raise RuntimeError("ScheduleCADLockstep.attention: called outside a forward tick of the schedule")
        return layout.positions, lambda q, k, v: cad_attention(q, k, v, layout, backend=self.backend)

    def _documents_of(self, kwarg_mbs: list, m: Optional[int]) -> Any:
        if m is None:
            return [0]
        kwargs = kwarg_mbs[m]
        if callable(self._documents):
            return self._documents(kwargs)
        if self._documents not in kwargs:
            raise ValueError(f"micro-batch {m} has no keyword {self._documents!r} (its documents' cu_seqlens)")
        return kwargs[self._documents]

    def _step_microbatches(self, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
                           target_mbs: Optional[list] = None, losses: Optional[list] = None,
                           return_outputs: bool = True, loss_kwargs: Optional[dict] = None) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        assert arg_mbs is not None and kwarg_mbs is not None  # _check_inputs fills them in
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, s = self._stage, self._stage.stage_index
        ticks = self.table.ticks
        prefetch = self._planner.prefetch
        forward_layouts: dict = {}
        sends: list = []
        self.records = []
        pending = self._planner.plan_async(self._documents_of(kwarg_mbs, ticks[0][s][1])) if prefetch else None
        for t, tick in enumerate(ticks):
            op, m = tick[s]
            ta = now()
            agree_on_tick(self._planner.control_group, t, tick, s)   # where a rank waits for the slowest
            t0 = time.perf_counter()
            interval(f"tick {t} agreement", ta, now(), tick=t)
            if pending is not None:
                layout = pending.result()
                pending = (self._planner.plan_async(self._documents_of(kwarg_mbs, ticks[t + 1][s][1]))
                           if t + 1 < len(ticks) else None)
            else:
                layout = self._planner.plan(self._documents_of(kwarg_mbs, m))
            if self._tp_group is not None:
                check_tp_plan(self._planner, layout, self._tp_group)
            t1 = time.perf_counter()
            direction = self.table.direction(t)
            try:
                if direction == "F" and op:
                    _wait(_post(stage.get_fwd_recv_ops(m)), f"receive activations {m}")
                    self.current = layout
                    output = stage.forward_one_chunk(m, arg_mbs[m], kwarg_mbs[m], save_forward_output=return_outputs)
                    self._maybe_compute_loss(stage, output, target_mbs, m, loss_kwargs)
                    del output
                    forward_layouts[m] = layout
                    sends += _post(stage.get_fwd_send_ops(m))
                elif direction == "F":
                    for _ in range(self._layers):
                        cad_serve(layout, self._dtype, backend=self.backend)
                elif op:
                    _wait(_post(stage.get_bwd_recv_ops(m)), f"receive gradients {m}")
                    forward_layouts.pop(m).set_backward_layout(layout)
                    self.current = layout
                    stage.backward_one_chunk(m, loss=self._maybe_get_loss(stage, m),
                                             last_backward=m == self._n_microbatches - 1)
                    sends += _post(stage.get_bwd_send_ops(m))
                else:
                    for _ in range(self._layers):
                        cad_serve(layout, self._dtype, backward=True, backend=self.backend)
            except RuntimeError as e:
                cause = _unwrap(e)
                if cause is e:
                    raise
                raise cause from None
            finally:
                self.current = None
            t2 = time.perf_counter()
            what = f"{direction}{m}" if op else ("serve forward" if direction == "F" else "serve backward")
            interval(f"tick {t} planning", int(t0 * 1e9), int(t1 * 1e9), tick=t)
            interval(f"tick {t} {what}", int(t1 * 1e9), int(t2 * 1e9), tick=t, micro_batch=m if op else None)
            self.records.append(TickRecord.of(t, direction, m, layout, (t1 - t0) * 1e3, (t2 - t1) * 1e3))
        _wait(sends, "sends completed")
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)
