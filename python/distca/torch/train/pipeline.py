"""The trainer with pipeline stages (--pp > 1; tensor parallelism beside it with --tp): each rank
runs its stage (TransformerStage: layers [s L/P, (s+1) L/P), split over its TP group by head
group) under torch.distributed.pipelining, the step's micro-batches --context tokens each:

    cad        ScheduleCADLockstep: the paper's lockstep 1F1B, every tick planned over the rank's
               CAD group (every stage and replica of its TP index), idle stages serving
    colocated  PyTorch's Schedule1F1B, each stage attending its own micro-batch with the same
               server kernel (a planner of policy none over a group of this rank alone)

Micro-batches hold whole documents; one that crosses into the next micro-batch (the spanning
and packed workloads, --data) is cut there, each part a document of its own, as at a step's end.
Gradients are summed over the micro-batches (the loss of each is its cross-entropy over the
step's targets), all-reduced over the DP group, clipped by the whole model's norm (the split
weights summed over the TP group, the stages' over the PP group) and stepped by AdamW, as the
data-parallel backend does. Each rank measures its step: planning, its own micro-batches'
forward and backward (its compute), serving in idle ticks, the gradients' sync and the optimizer,
and the rest, its wait (P2P receives, the tick's exchanges with slower ranks: the bubble).
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..cad.attention import cad_attention
from ..cad.planner import StepPlanner
from ..kernels.backends import get_backend
from .. import trace
from ..parallel.ranks import RankGroups
from ..parallel.schedule import ScheduleCADLockstep
from ..parallel.tensor import clip_grad_norm, shard_model
from .config import Config, cost_model
from .data import StepData
from .memory import SavedBytes, buffer_bytes, reset_device_peak, states_bytes, step_memory
from .model import TransformerStage, packed_cross_entropy
from .timing import AttentionWatch, TimedKernel, lr_at


def micro_batch_documents(pieces: list, cu: Any) -> list:
    """A micro-batch's cu_seqlens: its documents, where a document crosses into another
    micro-batch cut there, the part in this one a document of its own (positions from 0), as
    a document cut at a step's end continues in the next step. A micro-batch's attention cannot
    reach another's keys: they run in different ticks."""
    if cu is not None:
        return [int(x) for x in cu]
    out = [0]
    for _, begin, end, _ in pieces:
        out.append(out[-1] + int(end - begin))
    return out


class PipelineBackend:
    def __init__(self, name: str, cfg: Config, device: torch.device, groups: RankGroups, self_group: Any):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        self.name, self.cfg, self.device, self.groups = name, cfg, device, groups
        m, tp, pp = cfg.model, cfg.tp, cfg.pp
        me = groups.me
        self.first, self.last = me.stage == 0, me.stage == pp - 1
        shape = {"heads": m.n_heads // tp, "kv_heads": m.n_kv_heads // tp, "head_dim": m.head_dim}
        self.module = shard_model(TransformerStage(m, me.stage, pp), groups.tp).to(device)
        self.kernel = TimedKernel(get_backend(cfg.args.kernel, device, torch.float32, head_dim=m.head_dim), device)
        self.watch = AttentionWatch()
        t = cfg.context
        # The static shapes PipelineStage moves (requires_grad: what carries gradients back).
        example_in = (torch.zeros(t, dtype=torch.long, device=device) if self.first
                      else torch.zeros(t, m.dim, device=device, requires_grad=True))
        example_out = torch.zeros(t, m.vocab_size if self.last else m.dim, device=device, requires_grad=True)
        self.stage = PipelineStage(self.module, me.stage, pp, device, input_args=(example_in,),
                                   output_args=(example_out,), group=groups.pp)
        self._targets = 1
        if name == "cad":
            self.planner = StepPlanner(groups.cad, model=shape, cost_model=cost_model(m), policy=cfg.policy,
                                       tolerance=cfg.tolerance, granularity=cfg.granularity, pingpong=cfg.pingpong,
                                       backward="stateless", grad_return=cfg.grad_return, backend=cfg.args.kernel,
                                       # Tick t + 1 planned beside tick t on CUDA; on CPU the planning
                                       # thread takes the rank's one core (and the GIL) from the tick:
                                       # 175 ms of planning a step against 50 ms without (demo, --pp 2).
                                       device=device, prefetch=device.type == "cuda")
            self.schedule: Any = ScheduleCADLockstep(self.stage, cfg.micro_batches, self.planner,
                                                     layers_per_stage=m.n_layers // pp, loss_fn=self._loss,
                                                     scale_grads=False, tp_group=groups.tp, backend=self.kernel)
            self.module.source = self._cad_source
        else:
            self.planner = StepPlanner(self_group, model=shape, cost_model=cost_model(m), policy="none",
                                       pingpong=False, backend=cfg.args.kernel, device=device)
            self.schedule = Schedule1F1B(self.stage, cfg.micro_batches, loss_fn=self._loss, scale_grads=False)
            self.module.source = self._local_source
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.args.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=cfg.args.lr, betas=(0.9, 0.95), eps=1e-8)
        self.saved = SavedBytes(exclude=self.module.parameters())
        self.chunk_seconds = {"forward_one_chunk": 0.0, "backward_one_chunk": 0.0}
        self.local_plan_seconds = 0.0   # colocated: planning inside each forward, taken out of compute
        self._time_chunks()

    @property
    def model(self) -> torch.nn.Module:
        """This rank's stage module (what a checkpoint saves and loads)."""
        return self.module

    # The stage's micro-batches, timed: forward_one_chunk and backward_one_chunk of this rank.
    def _time_chunks(self) -> None:
        for method in ("forward_one_chunk", "backward_one_chunk"):
            inner = getattr(self.stage, method)

            def timed(*args, _inner=inner, _name=method, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self.chunk_seconds[_name] += time.perf_counter() - start
            setattr(self.stage, method, timed)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return packed_cross_entropy(logits, targets) / self._targets

    def _watched(self, layout):
        def attend(q, k, v):
            start = time.perf_counter()
            o = cad_attention(q, k, v, layout, backend=self.kernel)
            self.watch.forward += time.perf_counter() - start
            if o.requires_grad:
                o.register_hook(self.watch._begin)
                q.register_hook(self.watch._end)
            return o
        return attend

    def _cad_source(self, cu_seqlens: Any) -> tuple:
        layout = self.schedule.current
        if layout is None:
            raise RuntimeError("the stage ran outside a forward tick of its schedule")
        return layout.positions, self._watched(layout)

    def _local_source(self, cu_seqlens: Any) -> tuple:
        start = time.perf_counter()
        layout = self.planner.plan(cu_seqlens)   # a group of this rank alone: its own documents
        self.local_plan_seconds += time.perf_counter() - start
        return layout.positions, self._watched(layout)

    def train_step(self, step: int, data: StepData, rank: int, world: int, ctl_group, watch: Any) -> dict:
        cfg, groups = self.cfg, self.groups
        watch.at(f"step {step + 1}'s barrier ({self.name})")
        first_slice = groups.me.replica * cfg.micro_batches
        mbs = [data.rank_slice(first_slice + i, cfg.context) for i in range(cfg.micro_batches)]
        self._targets = data.num_targets
        self.kernel.seconds = self.local_plan_seconds = 0.0
        self.chunk_seconds = dict.fromkeys(self.chunk_seconds, 0.0)
        self.watch.reset()
        self.saved.reset_peak()
        reset_device_peak(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        dist.barrier(group=ctl_group)
        t0 = time.perf_counter()
        tracer = trace.active()
        if tracer is not None:
            tracer.begin_step(f"{step + 1} {self.name}", int(t0 * 1e9))
        watch.at(f"step {step + 1}'s pipeline ({self.name})")
        losses: list = []
        with self.saved.hooks():
            self.schedule.step(
                arg_mbs=[(torch.from_numpy(tokens).to(self.device),) if self.first else () for tokens, _, _, _ in mbs],
                kwarg_mbs=[{"cu_seqlens": micro_batch_documents(pieces, cu)} for _, _, pieces, cu in mbs],
                target_mbs=[torch.from_numpy(targets).to(self.device) for _, targets, _, _ in mbs], losses=losses)
        sync()
        t_pipe = time.perf_counter()
        watch.at(f"step {step + 1}'s gradient sync and optimizer step ({self.name})")
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if groups.map.dp > 1:
                dist.all_reduce(p.grad, group=groups.dp)
        max_norm = cfg.args.clip if cfg.args.clip > 0 else math.inf
        grad_norm = clip_grad_norm(self.module, max_norm, groups.tp, groups.pp)
        lr = lr_at(step, cfg.args.lr, cfg.args.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        t_end = time.perf_counter()
        ns = lambda t: int(t * 1e9)  # noqa: E731
        trace.interval("pipeline", ns(t0), ns(t_pipe), backend=self.name)
        trace.interval("gradient sync and optimizer", ns(t_pipe), ns(t_end), backend=self.name)
        trace.interval("step", ns(t0), ns(t_end), backend=self.name)
        records = getattr(self.schedule, "records", [])
        plan_s = sum(r.plan_ms for r in records) / 1e3 + self.local_plan_seconds
        serve_s = sum(r.compute_ms for r in records if r.micro_batch is None) / 1e3
        # Colocated plans inside each forward: that time is planning, not the forward's.
        forward_s = self.chunk_seconds["forward_one_chunk"] - self.local_plan_seconds
        backward_s = self.chunk_seconds["backward_one_chunk"]
        compute_s = forward_s + backward_s
        pipe_s = t_pipe - t0
        wait_s = max(0.0, pipe_s - plan_s - compute_s - serve_s)
        # The loss once per replica: its last stage's TP index 0 (the micro-batches' sums).
        loss_sum = sum(float(x.detach()) for x in losses) * self._targets if self.last and groups.me.tp == 0 else 0.0
        served = [r for r in records if r.micro_batch is None]
        memory = step_memory(states_bytes(self.module, self.optimizer), self.saved.peak, buffer_bytes(self.planner),
                             self.device)
        return {**memory, "step_seconds": t_end - t0, "plan_seconds": plan_s, "forward_seconds": forward_s,
                "backward_seconds": backward_s, "optimizer_seconds": t_end - t_pipe,
                "attention_kernel_seconds": self.kernel.seconds,
                "attention_seconds": self.watch.forward + self.watch.backward + serve_s,
                "attention_forward_seconds": self.watch.forward, "attention_backward_seconds": self.watch.backward,
                "loss_sum": loss_sum, "grad_norm": grad_norm, "lr": lr,
                "compute_seconds": compute_s, "serve_seconds": serve_s, "wait_seconds": wait_s,
                "served_idle_rows": sum(r.served_rows for r in served),
                # Over the step's ticks: rows this rank served for others, the plans' mean imbalance.
                "rows_served_remotely": sum(r.served_for_others for r in records),
                "plan_imbalance": sum(r.plan_imbalance for r in records) / len(records) if records else 1.0,
                "plan_tolerance": None,
                "ticks": [r.to_dict() for r in records]}

    def close(self) -> None:
        self.planner.close()
