"""The distca.torch trainer: a Llama-style model trained data-parallel with CAD or colocated attention.

    torchrun --nproc-per-node 2 -m distca.torch.train --preset demo --compare [--steps 20] [--json F]
    torchrun --nproc-per-node 4 -m distca.torch.train --preset tiny --data docs.jsonl --attention cad

The PyTorch counterpart of `distca train` (src/model, src/tools/cmd_train.cc), which it follows:
the model (distca/torch/train/model.py), byte-level data packed into ranks x --context tokens per step,
AdamW with a linear warm-up, global-norm clipping, and two attention backends that share every
line of code but the plan: `colocated` (StepPlanner policy "none": each rank attends its own
documents) and `cad` (--policy: the step's core attention rebalanced over all ranks). --compare
trains both from the same initial weights on the same batches, interleaved step by step, so the
speedup and the loss difference are measured in one run on one (noisy) machine.

Why DistributedDataParallel and not FSDP2: the model is small and replicated on every rank, so
sharding its parameters would only add all-gathers; and DDP's bucketed gradient all-reduce is
the same straggler barrier the C++ trainer has (every rank waits there for the slowest one),
which is what CAD removes. The layers' core attention runs through cad_attention on the world
group; DDP reduces gradients on a group of its own and the trainer's barriers and statistics use
a third (gloo) group, so DDP's all-reduces, which fire from autograd hooks while cad_attention's
backward runs its all-to-alls, never share a communicator with them (tested with small buckets).

Data (identical on every rank: each rank builds the whole step from the seed or the file and
takes its own slice): --workload skewed, the C++ demo's (every other rank holds one whole
document of --context tokens, the others short documents of 2..context/8 tokens filling exactly
--context; new lengths each step), --workload spanning (the same skew with documents across ranks:
ranks in pairs, every other pair holds one document of 2 x context tokens across both, the
others short documents), --workload packed (documents of 2..2 x context tokens packed in order,
spanning ranks), all with text from a fixed random Markov chain over 32 symbols so the
loss can fall (from ln 256 = 5.5 toward about 1.1 nats); or --data FILE.jsonl (a "text" field per
line, UTF-8 bytes as tokens, documents packed in order into R x T tokens per step; a document that
overflows a rank continues on the next, one cut at the end of a step continues in the next as a
new document, and the file starts again from the top when it runs out); distca/torch/train/data.py.

Per step and backend rank 0 prints the loss, the step seconds (the longest rank's), tokens/s, the
straggler's attention seconds (inside cad_attention, forward + backward, waiting included; the
straggler is the rank whose server kernels ran longest) and the attention imbalance (max/mean over
ranks of the server-kernel seconds); the run ends with a table and the speedup of CAD over
colocated. Every ending is one line and an exit status (--help and docs/torch.md list them): bad
flags, data or checkpoint 2, a failed or timed-out collective 1 (naming the rank waited for:
watch), Ctrl-C 130; a rank that alone finds its flags bad names itself.

This module holds the training itself (Backend, run, main); the flags and their checks are in
config, the records and reports in report, the checkpoints in resume (the format in checkpoint),
the heartbeat that names a stalled rank in watch, the data in data and the model in model.
"""
from __future__ import annotations

import datetime
import math
import os
import signal
import threading
import time
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..cad.agreement import InputError
from ..cad.attention import cad_attention
from ..cad.layout import StepLayout
from ..cad.planner import StepPlanner
from ..kernels.backends import get_backend
from .. import trace
from ..parallel.ranks import RankGroups
from ..parallel.tensor import clip_grad_norm, plan_tp, shard_model
from .config import (PROG, Config, RunError, UsageError, agree_on_error, check_same_settings, cost_model, env_rank,
                     parse_args, say)
from .data import DataError, JsonlData, StepData, SyntheticData, read_jsonl
from .memory import SavedBytes, buffer_bytes, reset_device_peak, states_bytes, step_memory
from .model import Transformer, packed_cross_entropy
from .pipeline import PipelineBackend
from .report import (gather_record, print_summary, rows_served_remotely, si, step_line, summarise, write_report,
                     write_trace)
from .resume import check_resume, load_own_checkpoint, save_checkpoint, step_on_disk
from .timing import AttentionWatch, TimedKernel, lr_at
from .watch import CollectiveFailure, Watch, collective_failure


# ---------------------------------------------------------------------------------------------
# One backend: model, DDP, optimizer, planner


class Backend:
    """Data parallelism (DDP over the DP group), with tensor parallelism by head group when
    --tp > 1 (groups: the rank map's; attention over the rank's CAD group, one per TP index)."""

    def __init__(self, name: str, cfg: Config, device: torch.device, attention_group, ddp_group,
                 groups: Optional[RankGroups] = None):
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.name, self.cfg, self.device, self.groups = name, cfg, device, groups
        m = cfg.model
        tp = cfg.tp
        shape = {"heads": m.n_heads // tp, "kv_heads": m.n_kv_heads // tp, "head_dim": m.head_dim}
        if name == "cad":
            self.planner = StepPlanner(attention_group, model=shape, cost_model=cost_model(m), policy=cfg.policy,
                                       tolerance=cfg.tolerance, granularity=cfg.granularity,
                                       pingpong=cfg.pingpong, backward=cfg.backward, state_budget=cfg.state_budget,
                                       grad_return=cfg.grad_return,
                                       backend=cfg.args.kernel, device=device)
        else:
            self.planner = StepPlanner(attention_group, model=shape, cost_model=cost_model(m), policy="none",
                                       pingpong=False, backend=cfg.args.kernel, device=device)
        self.model = Transformer(m)
        if groups is not None:
            shard_model(self.model, groups.tp)
        self.model = self.model.to(device)
        self.ddp = DDP(self.model, process_group=ddp_group, device_ids=[device.index] if device.type == "cuda" else None,
                       bucket_cap_mb=cfg.args.bucket_mb)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.args.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=cfg.args.lr, betas=(0.9, 0.95), eps=1e-8)
        self.kernel = TimedKernel(get_backend(cfg.args.kernel, device, torch.float32, head_dim=m.head_dim), device)
        self.watch = AttentionWatch()
        self.saved = SavedBytes(exclude=self.model.parameters())
        self.layout: Optional[StepLayout] = None

    def attention(self, q, k, v):
        start = time.perf_counter()
        o = cad_attention(q, k, v, self.layout, backend=self.kernel)
        self.watch.forward += time.perf_counter() - start
        if o.requires_grad:
            o.register_hook(self.watch._begin)
            q.register_hook(self.watch._end)
        return o

    def _optimizer_step(self, step: int) -> tuple:
        """Clipping (the whole model's norm, the same on every TP rank) and AdamW -> (norm, lr)."""
        cfg, groups = self.cfg, self.groups
        max_norm = cfg.args.clip if cfg.args.clip > 0 else math.inf
        if groups is not None and groups.map.tp > 1:
            grad_norm = clip_grad_norm(self.model, max_norm, groups.tp)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), max_norm)
        lr = lr_at(step, cfg.args.lr, cfg.args.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return grad_norm, lr

    def train_step(self, step: int, data: StepData, rank: int, world: int, ctl_group, watch: Watch) -> dict:
        """One optimizer step on this rank's slice -> this rank's measurements."""
        cfg = self.cfg

        def at(phase: str) -> None:
            watch.at(f"step {step + 1}'s {phase} ({self.name})")
        at("barrier")
        groups = self.groups
        replica = groups.me.replica if groups is not None else rank
        replicas = groups.map.dp if groups is not None else world
        tokens, targets, pieces, cu = data.rank_slice(replica, cfg.context)
        tokens_t = torch.from_numpy(tokens).to(self.device)
        targets_t = torch.from_numpy(targets).to(self.device)
        self.kernel.seconds = 0.0
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
        at("planning")
        with trace.span("planning", keep=False):
            if groups is not None and groups.map.tp > 1:
                layout = self.layout = plan_tp(self.planner, groups.tp, cu) if cu is not None else \
                    plan_tp(self.planner, groups.tp, pieces=pieces)
            else:
                layout = self.layout = self.planner.plan(cu) if cu is not None else self.planner.plan(pieces=pieces)
        t_plan = time.perf_counter()
        at("forward")
        with trace.span("forward", keep=False), self.saved.hooks():
            logits = self.ddp(tokens_t, layout.positions, self.attention)
            loss_sum = packed_cross_entropy(logits, targets_t)
            # The mean over every replica's targets; DDP averages gradients over replicas, hence x replicas.
            loss = loss_sum * (replicas / data.num_targets)
            sync()
        t_fwd = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        at("backward")
        with trace.span("backward (and the gradient all-reduce)", keep=False):
            loss.backward()
            sync()
        t_bwd = time.perf_counter()
        at("optimizer step")
        with trace.span("optimizer", keep=False):
            grad_norm, lr = self._optimizer_step(step)
            sync()
        t_end = time.perf_counter()
        # The phases kept as the record times them (the same clock readings): they add up to the step.
        for name, a, b in (("planning", t0, t_plan), ("forward", t_plan, t_fwd),
                           ("backward (and the gradient all-reduce)", t_fwd, t_bwd), ("optimizer", t_bwd, t_end)):
            trace.interval(name, int(a * 1e9), int(b * 1e9), backend=self.name)
        trace.interval("step", int(t0 * 1e9), int(t_end * 1e9), backend=self.name)
        plan = layout.plan
        self.layout = None
        return {"step_seconds": t_end - t0, "plan_seconds": t_plan - t0, "forward_seconds": t_fwd - t_plan,
                "backward_seconds": t_bwd - t_fwd, "optimizer_seconds": t_end - t_bwd,
                "attention_kernel_seconds": self.kernel.seconds,
                "attention_seconds": self.watch.forward + self.watch.backward,
                "attention_forward_seconds": self.watch.forward, "attention_backward_seconds": self.watch.backward,
                # The loss once per replica (its TP ranks compute the same one).
                "loss_sum": float(loss_sum.detach()) if groups is None or groups.me.tp == 0 else 0.0,
                "grad_norm": float(grad_norm), "lr": lr,
                "rows_served_remotely": rows_served_remotely(plan), "plan_imbalance": float(plan.load["imbalance"]),
                "plan_tolerance": float(plan.tolerance),
                "stateful_layers": layout.kept_calls, "stateless_layers": layout.stateless_calls,
                **step_memory(states_bytes(self.model, self.optimizer), self.saved.peak, buffer_bytes(self.planner),
                              self.device)}


# ---------------------------------------------------------------------------------------------
# The run


def run(cfg: Config) -> int:
    a = cfg.args
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Groups: attention (the world: cad_attention and planning), DDP's own, and a gloo one for the
    # trainer's barriers, statistics, agreement and checkpoints; each times out after --timeout
    # (new_group's default is PyTorch's 30 minutes, not the world's).
    backend = dist.get_backend()
    timeout = datetime.timedelta(seconds=a.timeout)
    ddp_group = dist.new_group(backend=backend, timeout=timeout)
    ctl_group = dist.new_group(backend="gloo", timeout=timeout)
    check_same_settings(a, ctl_group)
    groups = None
    if cfg.is_3d:
        cfg.check_world(world)   # every rank reaches the same verdict
        groups = RankGroups.make(tp=cfg.tp, pp=cfg.pp, backend=backend, timeout=timeout)
    watch = Watch(rank, world)
    try:
        return _train(cfg, rank, world, device, backend, ddp_group, ctl_group, watch, groups)
    except RuntimeError as e:
        kind = collective_failure(e)
        if kind is None:
            raise
        raise watch.failure(kind, watch.where, a.timeout) from e
    finally:
        watch.close()


def _read_data(cfg: Config, world: int, ctl_group, watch: Watch) -> tuple:
    """The data, identical on every rank, and the steps a resumed run has done; any rank's error
    stops all (UsageError, DataError: exit 2)."""
    a = cfg.args
    watch.at("reading the data")
    error, steps_done = None, 0
    data: Union[JsonlData, SyntheticData, None] = None
    try:
        if a.data:
            data = JsonlData(a.data, read_jsonl(a.data, progress=say), cfg.slices(world), cfg.context)
        else:
            assert cfg.workload is not None and cfg.seed is not None
            data = SyntheticData(cfg.workload, cfg.seed, cfg.slices(world), cfg.context)
    except DataError as e:
        error = str(e)
    agree_on_error(error, ctl_group)
    assert data is not None
    if isinstance(data, JsonlData):
        # Every rank read the same bytes (a file that differs between the ranks' machines, or one
        # rewritten while they read it, would train each rank on other data): its content's
        # fingerprint, agreed here, is what a checkpoint names the data by.
        every: list = [None] * dist.get_world_size(ctl_group)
        dist.all_gather_object(every, data.fingerprint, group=ctl_group)
        other = next((r for r, f in enumerate(every) if f != every[0]), None)
        if other is not None:
            raise UsageError(f"--data {a.data}: the ranks read different data (rank 0: {every[0]}; rank {other}: "
                             f"{every[other]}): the file differs between their machines or changed while they read "
                             f"it; give every rank the same file")
        cfg.data_fingerprint = data.fingerprint
    if a.resume:
        error = None
        try:
            steps_done = check_resume(a.resume, cfg, world)
        except UsageError as e:
            error = str(e)
        agree_on_error(error, ctl_group)
    return data, steps_done


def _train(cfg: Config, rank: int, world: int, device: torch.device, backend: str, ddp_group, ctl_group,
           watch: Watch, groups: Optional[RankGroups]) -> int:
    data, steps_done = _read_data(cfg, world, ctl_group, watch)
    watch.at("the set-up (models, planners, the resumed checkpoint)")
    backends: list = []
    self_group = None
    if cfg.pp > 1 and "colocated" in cfg.backends:
        # Colocated stages attend alone: a planner of policy none over a group of this rank only
        # (new_group is collective: every rank makes every rank's).
        for r in range(world):
            g = dist.new_group([r], backend=backend)
            self_group = g if r == rank else self_group
    try:
        for name in cfg.backends:
            if groups is not None and cfg.pp > 1:
                backends.append(PipelineBackend(name, cfg, device, groups, self_group))
            elif groups is not None:
                backends.append(Backend(name, cfg, device, groups.cad, groups.dp, groups))
            else:
                backends.append(Backend(name, cfg, device, dist.group.WORLD, ddp_group))
        return _train_steps(cfg, rank, world, device, backend, ctl_group, watch, data, steps_done, backends, groups)
    finally:
        # The planners let go of their groups, so destroy_process_group frees them (StepPlanner.close).
        for b in backends:
            b.planner.close()


def _train_steps(cfg: Config, rank: int, world: int, device: torch.device, backend: str, ctl_group, watch: Watch,
                 data: Union[JsonlData, SyntheticData], steps_done: int, backends: list,
                 groups: Optional[RankGroups] = None) -> int:
    a = cfg.args
    if a.resume:
        error = None
        try:
            load_own_checkpoint(a.resume, backends, cfg, world, rank)
        except UsageError as e:
            error = str(e)
        agree_on_error(error, ctl_group)

    m = cfg.model
    say(f"{PROG}: {' vs '.join(cfg.backends)}{' (compared, interleaved step by step)' if len(backends) > 1 else ''} "
        f"on {world} rank(s), {device.type} ({backend})")
    say(f"  model      {m.n_layers} layers, d {m.dim}, heads {m.n_heads}/{m.n_kv_heads} x {m.head_dim}, ffn "
        f"{m.ffn_dim}, vocab {m.vocab_size}{', tied embeddings' if m.tie_embeddings else ''}: "
        f"{si(m.num_parameters())} parameters")
    if groups is not None:
        rm = groups.map
        say(f"  ranks      pp {rm.pp} x tp {rm.tp} x dp {rm.dp} (rank w = (stage x dp + replica) x tp + tp index)"
            + (f"; {cfg.micro_batches} micro-batches of {cfg.context} tokens per replica per step, "
               f"{'lockstep 1F1B' if 'cad' in cfg.backends else ''}"
               f"{' vs ' if len(cfg.backends) > 1 else ''}{'Schedule1F1B' if 'colocated' in cfg.backends else ''}"
               if cfg.pp > 1 else ""))
        for r in range(min(world, 16)):
            say(f"    {rm.describe(r)}")
        if world > 16:
            say(f"    ... {world - 16} more ranks (the JSON report's config.rank_map lists every one)")
    say(f"  data       {data.describe()}; {cfg.context} tokens per {'micro-batch' if cfg.pp > 1 else 'rank'} per step, "
        f"{a.steps} steps"
        f"{f' (resumed after step {steps_done})' if steps_done else ''}")
    if "cad" in cfg.backends:
        cad_planner = backends[cfg.backends.index("cad")].planner
        say(f"  cad        planner {cfg.policy}, tolerance {cfg.tolerance}, granularity {cfg.granularity or 'default'}, "
            f"{cfg.backward} backward, dK/dV return {cfg.grad_return}, ping-pong {'on' if cad_planner.pingpong else 'off'}, "
            f"kernel {backends[0].kernel.name}")
    if "colocated" in cfg.backends:
        say(f"  colocated  each rank attends its own documents (planner none), kernel {backends[0].kernel.name}")
    say(f"  optimizer  AdamW lr {a.lr} (warm-up {a.warmup} steps, then constant), betas 0.9/0.95, weight decay "
        f"{a.weight_decay}, clip {a.clip}; DDP buckets {a.bucket_mb} MB; {torch.get_num_threads()} thread(s) per rank")

    records: list = []
    tracer = trace.Tracer(rank, a.trace_steps * len(backends)) if a.trace else None
    trace.activate(tracer)
    try:
        return _run_steps(cfg, rank, world, device, ctl_group, watch, data, steps_done, backends, records, tracer)
    finally:
        trace.activate(None)


def _run_steps(cfg: Config, rank: int, world: int, device: torch.device, ctl_group, watch: Watch,
               data: Union[JsonlData, SyntheticData], steps_done: int, backends: list, records: list,
               tracer: Optional[trace.Tracer]) -> int:
    a, m = cfg.args, cfg.model
    start = time.perf_counter()
    run_steps = a.steps - steps_done
    for i, step in enumerate(range(steps_done, a.steps)):
        batch = data.step(step)
        if batch.epoch_started:
            say(f"epoch {batch.epoch_started + 1} of {a.data} begins in step {step + 1} (the file starts again)")
        order = backends if step % 2 == 0 else backends[::-1]
        step_records = {}
        for b in order:
            local = b.train_step(step, batch, rank, world, ctl_group, watch)
            watch.at(f"step {step + 1}'s statistics ({b.name})")
            step_records[b.name] = gather_record(local, step, b.name, batch, cfg, world, ctl_group)
        elapsed = time.perf_counter() - start
        remaining = elapsed / (i + 1) * (run_steps - i - 1)
        for name in cfg.backends:
            records.append(step_records[name])
            if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
                say(step_line(step_records[name], a.steps, elapsed, remaining if step + 1 < a.steps else None))
        if a.save_every and (step + 1) % a.save_every == 0 and step + 1 < a.steps:
            watch.at(f"the checkpoint after step {step + 1}")
            save_checkpoint(a.checkpoint, backends, step + 1, cfg, world, rank, ctl_group)
    wall = time.perf_counter() - start
    if a.checkpoint:
        watch.at(f"the checkpoint after step {a.steps}")
        save_checkpoint(a.checkpoint, backends, a.steps, cfg, world, rank, ctl_group)
        say(f"checkpoint: {a.checkpoint} (step {a.steps})")
    summary = summarise(records, cfg, steps_done, wall)
    print_summary(summary, cfg)
    json_error = None
    if a.json and rank == 0:
        try:
            write_report(a, cfg, m, world, device, steps_done, backends, records, summary)
            say(f"json: {a.json}")
        except (OSError, ValueError) as e:
            json_error = f"--json {a.json}: the report could not be written ({e})"
    if a.json:
        watch.at("the report")
        agree_on_error(json_error, ctl_group, RunError)
    if tracer is not None:
        watch.at("the trace")
        write_trace(a.trace, tracer, rank, world, ctl_group, {"backends": list(cfg.backends), "ranks": world,
                                                               "steps_kept": a.trace_steps, "steps": a.steps})
    return 0


# How long a rank other than 0 that alone found its flags bad waits before it prints (as `distca`'s
# ranks do, src/tools/world.cc): long enough for torchrun to end it if rank 0 failed the same way
# and said so; if rank 0 did not, rank 0 waits in init_process_group and only this rank knows.
ALONE_SECONDS = 3.0


def _usage_verdict(error: Optional[str], is_help: bool) -> tuple:
    """(exit status or None to go on, the line to print or None) once the ranks' flags are
    judged: in a process that already has a gloo process group (distca.torch.run_ranks) the
    ranks compare verdicts over it, so one rank's bad flags end all at once, rank 0 naming it;
    else (torchrun, before the group exists) a rank decides alone."""
    if dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, error if error is not None else ("--help" if is_help else None))
        rank = dist.get_rank()
        bad = [(r, v) for r, v in enumerate(every) if v is not None and v != "--help"]
        if bad:
            r, message = bad[0]
            shown = message if len(bad) == len(every) else f"rank {r}: {message}"
            return 2, (f"{PROG}: error: {shown}" if rank == 0 else None)
        helped = [r for r, v in enumerate(every) if v == "--help"]
        if helped and len(helped) < len(every):
            return 2, (f"{PROG}: error: the ranks were started with different settings: --help on rank {helped[0]} "
                       f"only; start every rank with the same command line" if rank == 0 else None)
        return (0, None) if is_help else (None, None)
    if error is None:
        return (0, None) if is_help else (None, None)
    rank = env_rank()
    if rank == 0 or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return 2, f"{PROG}: error: {error}"
    time.sleep(ALONE_SECONDS)
    return 2, f"{PROG}: error: rank {rank}: {error}"


class _Interrupts:
    """Ctrl-C during a run: a KeyboardInterrupt, as by default, that is also remembered. torchrun
    passes Ctrl-C on to every rank; a rank waiting in a collective for a peer that was interrupted
    first gets the collective's error (the peer left) before its own KeyboardInterrupt, which
    is raised at the next Python call, or lost where that call is a hook inside autograd's
    backward, whose engine keeps only the first error. Either way `seen()` tells, and the rank
    ends as interrupted (130, silent but on rank 0), not with the collective's error."""

    def __init__(self):
        self._seen, self._old = False, None

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _handle(self, signum, frame):
        self._seen = True
        raise KeyboardInterrupt

    def seen(self) -> bool:
        """Whether this rank was interrupted, running a SIGINT still pending (a Python call does)."""
        try:
            _touch()
        except KeyboardInterrupt:
            return True
        return self._seen


def _touch() -> None:
    """A Python call: where the interpreter runs a pending signal's handler."""


def main(argv: Optional[list] = None) -> int:
    """The command line; returns the exit status. Under torchrun it initialises the process group
    from the environment; inside a process that already has one (distca.torch.run_ranks) it uses it.
    Every ending prints one line (bad flags or data: 2; a failed collective: 1; Ctrl-C: 130)."""
    error: Optional[str] = None
    cfg: Optional[Config] = None
    try:
        cfg = parse_args(argv)
    except UsageError as e:
        error = str(e)
    status, line = _usage_verdict(error, cfg is None and error is None)
    if line is not None:
        print(line, flush=True)
    if status is not None:
        return status
    assert cfg is not None
    threads = cfg.args.threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(threads)
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python -m`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group("nccl" if cfg.args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.args.timeout))
        created = True
    elif cfg.args.device == "cuda" and dist.get_backend() != "nccl":
        say(f"{PROG}: error: --device cuda needs an NCCL process group, this one is {dist.get_backend()}")
        return 2
    interrupts = _Interrupts()
    try:
        with interrupts:
            return run(cfg)
    except (UsageError, InputError, DataError) as e:
        say(f"{PROG}: error: {e}")
        return 2
    except RunError as e:
        say(f"{PROG}: error: {e}")
        return 1
    except CollectiveFailure as e:
        if interrupts.seen():
            return _interrupted(cfg)
        if e.line is not None:
            print(f"{PROG}: error: {e.line}", flush=True)
        created = False        # no teardown: the group's collectives may never end
        return 1
    except KeyboardInterrupt:
        created = False        # no teardown: a collective cut short by the interrupt may never end
        return _interrupted(cfg)
    except RuntimeError:
        if interrupts.seen():   # a peer interrupted first: this rank's error is its leaving
            created = False
            return _interrupted(cfg)
        raise
    finally:
        if created:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (a peer that already failed)
                pass


def _interrupted(cfg: Config) -> int:
    """Ctrl-C: rank 0's one line, exit 130. The last checkpoint written is whole: a save renames
    a complete folder into place. Its step is read back from it (the interrupt may have landed
    after a rename, before the run noted the step)."""
    step = step_on_disk(cfg.args.checkpoint) if cfg.args.checkpoint else None
    step = cfg.saved_step if step is None else step
    last = (f"; {cfg.args.checkpoint} holds the checkpoint of step {step}, saved whole"
            if step is not None else "; no checkpoint was saved" if cfg.args.checkpoint else "")
    say(f"{PROG}: interrupted{last}")
    return 130


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

