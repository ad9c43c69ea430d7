"""Megatron Core's pipeline with CAD pooled across its stages: a forward-backward function of
Megatron's signature walking distca's lockstep tick table (the paper's lockstep 1F1B).

    from megatron.core import parallel_state as ps
    from distca.torch.adapters.megatron_core import CADContext, cad_layer_spec
    from distca.torch.adapters.megatron_lockstep import LockstepForwardBackward, lockstep_group

    ps.initialize_model_parallel(tp, pp)
    cad = CADContext(config, group=lockstep_group(), backward="stateless")   # DP x PP ranks of a TP index
    model = GPTModel(config, cad_layer_spec(cad), ..., pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    forward_backward = LockstepForwardBackward(cad)        # in place of get_forward_backward_func()
    losses = forward_backward(forward_step_func=forward_step, data_iterator=it, model=[model],
                              num_microbatches=M, seq_length=T, micro_batch_size=1)

Megatron's own 1F1B (forward_backward_pipelining_without_interleaving) runs each stage on its own
clock: a stage in a warm-up or cool-down bubble computes nothing, and CAD, whose exchanges are
collective over every stage, could not run under it. Here every rank of the CAD group walks
distca.pipeline_schedule("cad", P, M) tick by tick: P - 1 forward ticks, M [forward, backward]
pairs, P - 1 backward ticks (forward_only: the forward ticks alone). In every tick each rank
first agrees on the tick (parallel.schedule.agree_on_tick: a rank that skipped a tick raises the
same InputError on every rank), then

    forward, busy    receives its input from stage s - 1, runs Megatron's forward_step (the user's
                     forward_step_func); the first CAD layer plans the micro-batch's documents
                     (its packed_seq_params.cu_seqlens_q) over the CAD group, the later layers
                     reuse that layout; sends its output to stage s + 1
    forward, idle    plans no rows ([0]) in the same collective and serves (cad_serve) once per
                     CAD layer: the tick's plan pools the core attention of every busy stage of
                     every replica over all ranks, the idle stages included
    backward, busy   receives the output's gradient, plans the micro-batch's documents again (the
                     stateless backward: its tick pools other micro-batches than the forward's),
                     runs Megatron's backward_step and sends the input's gradient back
    backward, idle   plans [0] and serves the backward once per CAD layer

so forward_step_func is Megatron's (data_iterator, model) -> (output, loss_func), and the loss
data it returns on the last stage come back as Megatron's do (the list of loss_func's reduced
dicts). Megatron's grad sync hooks (no_sync_func, grad_sync_func) and finalize_model_grads_func
are called where its 1F1B calls them. The activations go point to point over the pipeline group
(torch.distributed, so gloo on CPU works; Megatron's P2PCommunicator synchronises CUDA), CAD's
exchanges over the CAD group: never the same group. `records` holds the last call's ticks
(parallel.TickRecord: rows this rank served, and what the tick's plan gave it).

Requirements, each refused with its reason on every rank of the CAD group: a stateless planner;
the same number of CAD layers on every stage (an idle stage serves one exchange per busy layer);
one model chunk (no virtual pipeline); no activation recomputation (a recomputed core attention
would exchange in a tick whose plan is another's); every stage's data_iterator yields the
micro-batch with its packed_seq_params (Megatron's THD path needs cu_seqlens on every stage too).
With tensor parallelism each tick's plan hash is checked over the TP group.

Megatron is imported on first call; importing this module needs no Megatron.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Optional, Union

import torch
import torch.distributed as dist

import distca

from ..cad.agreement import InputError
from ..cad.serve import cad_serve
from ..parallel.schedule import TickRecord, agree_on_tick
from ..parallel.tensor import check_tp_plan
from .megatron_core import CADContext, require_megatron

__all__ = ["LockstepForwardBackward", "lockstep_group"]


def lockstep_group(backend: Optional[str] = None) -> Any:
    """Collective over the world (every rank calls it, in the same order): the group of the
    data- and pipeline-parallel ranks of this rank's tensor-parallel index, CAD's group under
    LockstepForwardBackward. Megatron's rank order (tp fastest, then dp, then pp, CP = 1) puts
    them at the world ranks equal to this rank modulo TP."""
    ps = require_megatron().parallel_state
    if not ps.model_parallel_is_initialized():
        raise ValueError("lockstep_group: initialise Megatron's model parallelism first (parallel_state."
                         "initialize_model_parallel)")
    if ps.get_context_parallel_world_size() != 1:
        raise ValueError("lockstep_group: CAD replaces context parallelism (context_parallel_size must be 1)")
    tp, world = ps.get_tensor_model_parallel_world_size(), dist.get_world_size()
    mine = None
    for index in range(tp):
        group = dist.new_group(list(range(index, world, tp)), backend=backend)
        if dist.get_rank() % tp == index:
            mine = group
    return mine


class _Tick:
    """One forward tick's plan on a busy rank: planned by the first CAD layer, reused by the rest."""

    def __init__(self, tp_group: Any) -> None:
        self.tp_group = tp_group
        self.key: Any = None
        self.documents: Any = None
        self.current: Any = None
        self.plan_ms = 0.0

    def layout(self, cad: CADContext, key: tuple, documents: Callable[[], tuple]) -> Any:
        if self.current is not None:
            same = len(key) == len(self.key) and all(a is b or (not isinstance(a, torch.Tensor) and a == b)
                                                    for a, b in zip(key, self.key))
            if not same:
                raise ValueError("LockstepForwardBackward: a forward tick's CAD layers saw two micro-batches (each "
                                 "layer of one forward must see the same packed_seq_params)")
            return self.current
        host, message = documents()
        start = time.perf_counter()
        self.current = cad.planner.plan(host if message is None else [0], input_error=message)
        if self.tp_group is not None:      # where the idle ranks check theirs: right after the plan
            check_tp_plan(cad.planner, self.current, self.tp_group)
        self.plan_ms = (time.perf_counter() - start) * 1e3
        cad.num_plans += 1
        self.key, self.documents = key, host
        return self.current


def _cad_layers(model: torch.nn.Module, cad: CADContext) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ == "CADCoreAttention" and getattr(m, "cad", None) is cad)


class LockstepForwardBackward:
    """Megatron's forward_backward_func (same keywords, same return) as distca's lockstep 1F1B
    with CAD (see the module docstring).

    cad: the model's CADContext, over the DP x PP ranks of this TP index (lockstep_group()),
      backward="stateless".
    pp_group, tp_group: default parallel_state's.
    """

    def __init__(self, cad: CADContext, *, pp_group: Any = None, tp_group: Any = None):
        if not isinstance(cad, CADContext):
            raise TypeError(f"cad must be a CADContext, got {type(cad).__name__}")
        ps = require_megatron().parallel_state
        if pp_group is None or tp_group is None:
            if not ps.model_parallel_is_initialized():
                raise ValueError("LockstepForwardBackward: initialise Megatron's model parallelism first, or pass "
                                 "pp_group= and tp_group=")
            pp_group = ps.get_pipeline_model_parallel_group() if pp_group is None else pp_group
            tp_group = ps.get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.cad = cad
        self.pp_group = pp_group
        self.tp_group = tp_group if dist.get_world_size(tp_group) > 1 else None
        self.records: List[TickRecord] = []

    # Checks, agreed on over the CAD group ----------------------------------------------------

    def _check(self, model: torch.nn.Module, config: Any, num_microbatches: int, forward_only: bool) -> int:
        problem = None
        layers = _cad_layers(model, self.cad)
        if self.cad.planner.backward != "stateless":
            problem = ("the planner must be stateless (CADContext(..., backward='stateless')): a backward tick pools "
                       "other micro-batches than its forward tick, so its plan differs")
        elif layers < 1:
            problem = "the model has no CADCoreAttention on this CADContext (build it with use_cad(spec, cad))"
        elif getattr(config, "recompute_granularity", None) is not None:
            problem = (f"recompute_granularity {config.recompute_granularity!r}: a recomputed core attention would "
                       "exchange in a backward tick planned for other micro-batches (set it to None)")
        elif getattr(config, "overlap_p2p_comm", False):
            problem = "overlap_p2p_comm (the non-interleaved schedule sends each tick's activations itself)"
        elif isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            problem = f"num_microbatches must be a positive integer, got {num_microbatches!r}"
        mine = (dist.get_rank(self.pp_group), dist.get_world_size(self.pp_group), layers, num_microbatches,
                bool(forward_only))
        gathered: list = [None] * self.cad.planner.world_size
        dist.all_gather_object(gathered, (mine, problem), group=self.cad.planner.control_group)
        bad = next(((r, p) for r, (_, p) in enumerate(gathered) if p is not None), None)
        if bad is not None:
            raise InputError(f"LockstepForwardBackward: rank {bad[0]}: {bad[1]}")
        if len({g[0][2] for g in gathered}) > 1:
            by_stage = sorted({(g[0][0], g[0][2]) for g in gathered})
            raise InputError("LockstepForwardBackward: every stage needs the same number of CAD layers (an idle stage "
                             "serves one exchange per layer of the busy ones), got "
                             + ", ".join(f"stage {s}: {n}" for s, n in by_stage))
        for what, i in (("pipeline sizes", 1), ("num_microbatches", 3), ("forward_only", 4)):
            values = {g[0][i] for g in gathered}
            if len(values) > 1:
                raise InputError(f"LockstepForwardBackward: the ranks differ in {what}: {sorted(values)} (every rank "
                                 "walks one tick table)")
        return layers

    # Point to point over the pipeline group ----------------------------------------------------

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.pp_group, stage)

    def _recv(self, stage: int, shape: tuple, dtype: torch.dtype, device: Any) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, self._peer(stage), self.pp_group)]):
            w.wait()
        return buf

    def _send(self, x: torch.Tensor, stage: int) -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), self._peer(stage), self.pp_group)])

    # Megatron's forward_backward_func ----------------------------------------------------------

    def __call__(self, *, forward_step_func: Callable, data_iterator: Union[Iterator, List[Iterator]],
                 model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                 adjust_tensor_shapes_fn: Optional[Callable] = None, p2p_communicator: Any = None,
                 pg_collection: Any = None, force_all_reduce: Optional[bool] = False) -> list:
        from megatron.core.pipeline_parallel import schedules as ms
        from megatron.core.utils import get_model_config, get_model_type
        if isinstance(model, list):
            if len(model) != 1:
                raise ValueError(f"LockstepForwardBackward: one model chunk per rank (no virtual pipeline), got "
                                 f"{len(model)}")
            model = model[0]
        if isinstance(data_iterator, list):
            if len(data_iterator) != 1:
                raise ValueError("LockstepForwardBackward: one data iterator per rank (no virtual pipeline)")
            data_iterator = data_iterator[0]
        config = get_model_config(model)
        layers = self._check(model, config, num_microbatches, forward_only)
        model_type = get_model_type(model)
        stage, stages = dist.get_rank(self.pp_group), dist.get_world_size(self.pp_group)
        first, last = stage == 0, stage == stages - 1
        planner = self.cad.planner
        dtype = config.pipeline_dtype or config.params_dtype
        serve_dtype = config.params_dtype
        device = next(model.parameters()).device
        length = decoder_seq_length if decoder_seq_length is not None else seq_length
        if config.sequence_parallel:
            length //= dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        recv_shapes = send_shapes = [(length, micro_batch_size, config.hidden_size)]
        if adjust_tensor_shapes_fn is not None:
            recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)

        no_sync = (config.no_sync_func or contextlib.nullcontext)()
        no_sync.__enter__()
        synced = False
        table = distca.pipeline_schedule("cad", stages, num_microbatches)
        ticks = [(tick, table.direction(t)) for t, tick in enumerate(table.ticks)
                 if not forward_only or table.direction(t) == "F"]
        forward_data_store: list = []
        total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        saved: dict = {}
        sends: list = []
        self.records = []
        try:
            for t, (tick, direction) in enumerate(ticks):
                op, m = tick[stage]
                agree_on_tick(planner.control_group, t, tick, stage)
                start = time.perf_counter()
                plan_ms = 0.0
                if op and direction == "F":
                    input_tensor = None
                    if not first:
                        input_tensor = self._recv(stage - 1, recv_shapes[0], dtype, device).requires_grad_()
                    tick_plan = self.cad.tick = _Tick(self.tp_group)
                    try:
                        output_tensor, num_tokens = ms.forward_step(
                            forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                            forward_data_store, config, cp_group_size=1, collect_non_loss_data=collect_non_loss_data,
                            is_first_microbatch=ms.check_first_val_step(first_val_step, forward_only, m == 0),
                            current_microbatch=m, is_last_stage=last)
                    finally:
                        self.cad.tick = None
                    layout = tick_plan.current
                    if layout is None:      # the forward reached no CAD layer: the others wait in the plan
                        planner.plan([0], input_error="the forward ran none of the model's CAD layers")
                        raise AssertionError("unreachable: plan raised on every rank")
                    plan_ms = tick_plan.plan_ms
                    total_num_tokens += num_tokens.to(device)
                    if not last:
                        out = output_tensor.detach()
                        sends += self._send(out.clone() if config.deallocate_pipeline_outputs else out, stage + 1)
                    if not forward_only:
                        saved[m] = (input_tensor, output_tensor, layout, tick_plan.documents)
                        ms.deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
                elif op:
                    grad = None if last else self._recv(stage + 1, send_shapes[0], dtype, device)
                    input_tensor, output_tensor, forward_layout, documents = saved.pop(m)
                    p0 = time.perf_counter()
                    layout = planner.plan(documents)
                    self.cad.num_plans += 1
                    if self.tp_group is not None:
                        check_tp_plan(planner, layout, self.tp_group)
                    plan_ms = (time.perf_counter() - p0) * 1e3
                    forward_layout.set_backward_layout(layout)
                    if m == num_microbatches - 1 and (config.grad_sync_func is None or first):
                        no_sync.__exit__(None, None, None)
                        synced = True
                    input_grad = ms.backward_step(input_tensor, output_tensor, grad, model_type, config)
                    if not first:
                        sends += self._send(input_grad, stage - 1)
                else:
                    p0 = time.perf_counter()
                    layout = planner.plan([0])
                    self.cad.num_plans += 1
                    if self.tp_group is not None:
                        check_tp_plan(planner, layout, self.tp_group)
                    plan_ms = (time.perf_counter() - p0) * 1e3
                    for _ in range(layers):
                        cad_serve(layout, serve_dtype, backward=direction == "B")
                compute_ms = (time.perf_counter() - start) * 1e3 - plan_ms
                self.records.append(TickRecord.of(t, direction, m if op else None, layout, plan_ms, compute_ms))
            for w in sends:
                w.wait()
        finally:
            if not synced:
                no_sync.__exit__(None, None, None)
        if not forward_only:
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(
                    [model], total_num_tokens if config.calculate_per_token_loss else None,
                    pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        return forward_data_store
