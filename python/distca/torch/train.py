"""The distca.torch trainer: a Llama-style model trained data-parallel with CAD or colocated attention.

    torchrun --nproc-per-node 2 -m distca.torch.train --preset demo --compare [--steps 20] [--json F]
    torchrun --nproc-per-node 4 -m distca.torch.train --preset tiny --data docs.jsonl --attention cad

The PyTorch counterpart of `distca train` (src/model, src/tools/cmd_train.cc), which it follows:
the model (distca/torch/model.py), byte-level data packed into ranks x --context tokens per step,
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
new document, and the file starts again from the top when it runs out); distca/torch/data.py.

Per step and backend rank 0 prints the loss, the step seconds (the longest rank's), tokens/s, the
straggler's attention seconds (inside cad_attention, forward + backward, waiting included; the
straggler is the rank whose server kernels ran longest) and the attention imbalance (max/mean over
ranks of the server-kernel seconds); the run ends with a table and the speedup of CAD over
colocated. Bad flags or data: one line and exit status 2 on every rank.
"""
from __future__ import annotations

import argparse
import datetime
import errno
import json
import math
import os
import stat
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

import distca

from . import checkpoint
from .checkpoint import probe_folder
from .backends import ServerKernel, backend_names, get_backend
from .layout import InputError, StepLayout, StepPlanner
from .attention import cad_attention
from .data import DataError, JsonlData, StepData, SyntheticData, read_jsonl
from .model import PRESET_CONTEXT, PRESET_WORKLOAD, PRESETS, ModelArgs, Transformer, packed_cross_entropy

PROG = "distca.torch.train"
BACKENDS = ("colocated", "cad")
WORKLOADS = ("skewed", "spanning", "packed")
MAX_CONTEXT = 1 << 20
MAX_SEED = (1 << 63) - 1
MAX_BUCKET_MB = 65536.0
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 604800.0
CHECKPOINT_META = checkpoint.META
CHECKPOINT_FORMAT = checkpoint.FORMAT


class UsageError(Exception):
    """A bad flag or input: one line, exit status 2 on every rank."""


class RunError(Exception):
    """A failure of the run itself (an output that could not be written): one line, exit status 1."""


def _tolerance_arg(text: str) -> Union[float, str]:
    """--tolerance: auto or a number (its range is distca.plan's to check)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a number in [0, 1], got {text!r}") from None


def _env_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def say(*parts: Any) -> None:
    """Rank 0 prints (flushed)."""
    if _env_rank() == 0:
        print(*parts, flush=True)


# ---------------------------------------------------------------------------------------------
# Flags


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message, exit 2 (by the caller)
        raise UsageError(f"{message} (see --help)")

    def _print_message(self, message, file=None):  # --help: rank 0 only
        if message and _env_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m {PROG}", formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Train a Llama-style byte-level model data-parallel with CAD or colocated core attention "
                            "(run under torchrun; one process per rank).",
                epilog="examples:\n"
                       "  torchrun --nproc-per-node 2 -m distca.torch.train --preset demo --compare --json t.json\n"
                       "  torchrun --nproc-per-node 4 -m distca.torch.train --preset tiny --data docs.jsonl\n"
                       "exit status: 0 done, 2 bad flags or data (one line, every rank), 1 anything else")
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                   help="demo: 2 layers, d 256, 4/1 heads of 64, FFN 512, 6144 tokens per rank, skewed data; "
                        "tiny: 2 layers, d 64, 2/1 heads of 32, FFN 128, 256 tokens per rank (default demo)")
    g.add_argument("--context", type=int, metavar="T", help="tokens per rank per step (default: the preset's)")
    g.add_argument("--workload", choices=WORKLOADS,
                   help="synthetic data: skewed (every other rank one whole document of --context tokens, the others "
                        "short ones of 2..context/8), spanning (the skew with documents across ranks: ranks in pairs, "
                        "every other pair one document of 2 x context tokens across both ranks, the other pairs "
                        "short ones of 2..context/8) or packed (documents of 2..2*context tokens spanning ranks); "
                        "default skewed")
    g.add_argument("--seed", type=int, metavar="S", help="synthetic data seed (default 1)")
    g.add_argument("--data", metavar="FILE.jsonl",
                   help="JSON lines with a \"text\" field each, instead of synthetic data")
    g.add_argument("--tie-embeddings", action="store_true", help="the LM head reuses the embedding matrix")
    g = p.add_argument_group("attention")
    g.add_argument("--attention", choices=BACKENDS, help="the core attention backend (default cad)")
    g.add_argument("--compare", action="store_true",
                   help="train colocated and cad from the same weights on the same batches, interleaved step by step")
    g.add_argument("--policy", choices=[n for n in distca.planner_names() if n != "none"],
                   help="the CAD planner (default minlink)")
    g.add_argument("--tolerance", type=_tolerance_arg, metavar="EPS|auto",
                   help="the planner's load tolerance eps in [0, 1], or auto (default): the eps whose plan predicts the "
                        "fastest step")
    g.add_argument("--granularity", type=int, metavar="G", help="shard granularity in tokens (default: planner's)")
    g.add_argument("--backward", choices=("stateful", "stateless"),
                   help="stateful: servers keep Q/K/V from the forward (default); stateless: sent again")
    g.add_argument("--pingpong", choices=("auto", "on", "off"),
                   help="split each step's tasks into two overlapping nano-batches (auto: on CUDA only)")
    g.add_argument("--kernel", choices=backend_names(), default="auto",
                   help="the server kernel, for both backends (default auto: distca on CPU where it is built for the head dim, else sdpa)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--steps", type=int, default=20, metavar="N", help="steps to train (default 20)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    g.add_argument("--warmup", type=int, default=5, metavar="W",
                   help="linear warm-up steps from lr/W to lr, then constant (default 5)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices only (default 0.1)")
    g.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping, 0: off (default 1.0)")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo) or cuda (NCCL, one GPU per process); the same code (default cpu)")
    g.add_argument("--json", metavar="FILE", help="write the run's records and summary here")
    g.add_argument("--checkpoint", metavar="DIR",
                   help="save model, optimizer and step at the end: a folder, replaced only when absent, empty or "
                        "a checkpoint of this trainer (JSON header + raw tensor bytes; loading runs no code)")
    g.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps")
    g.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (the same loss curve)")
    g.add_argument("--skip", type=int, metavar="K",
                   help="steps left out of the time means at the start (warm-up; default 1, 0 with --steps 1)")
    g.add_argument("--log-every", type=int, default=1, metavar="N",
                   help="print every N-th step's lines (and the last); default 1")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's gradient bucket size (default 25)")
    g.add_argument("--timeout", type=float, default=600, metavar="SECONDS",
                   help="collectives time out after this long (default 600)")
    g.add_argument("--threads", type=int, metavar="N", help="torch threads per rank (default OMP_NUM_THREADS or 1)")
    return p


@dataclass
class Config:
    args: argparse.Namespace
    model: ModelArgs
    context: int
    backends: tuple
    workload: Optional[str]     # None with --data
    seed: Optional[int]
    policy: str
    tolerance: Union[float, str]
    granularity: Optional[int]
    backward: str
    pingpong: Any               # "auto", True or False
    saved_step: Optional[int] = None   # the step of the last checkpoint this run saved

    @property
    def data_identity(self) -> dict:
        if self.args.data:
            return {"data": os.path.abspath(self.args.data)}
        return {"workload": self.workload, "seed": self.seed}


def parse_args(argv: Optional[list]) -> Optional[Config]:
    """Flags -> Config, checked without any collective (every rank reaches the same verdict).
    UsageError on a bad flag; None after --help."""
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:  # --help
        if e.code not in (0, None):
            raise UsageError(f"bad flags (exit {e.code})")
        return None
    if a.compare and a.attention:
        raise UsageError("--attention is ignored with --compare (which trains both backends): give one of them")
    backends = BACKENDS if a.compare else (a.attention or "cad",)
    planner_flags = [f for f, v in (("--policy", a.policy), ("--tolerance", a.tolerance),
                                    ("--granularity", a.granularity), ("--backward", a.backward),
                                    ("--pingpong", a.pingpong)) if v is not None]
    if backends == ("colocated",) and planner_flags:
        raise UsageError(f"{', '.join(planner_flags)} would be ignored with --attention colocated "
                         f"(colocated attention has no planner options)")
    if a.data and (a.workload or a.seed is not None):
        raise UsageError("--workload and --seed would be ignored with --data (they choose the synthetic data)")
    if not 1 <= a.steps <= 100_000_000:
        raise UsageError(f"--steps must be 1..100000000, got {a.steps}")
    context = PRESET_CONTEXT[a.preset] if a.context is None else a.context
    if not 16 <= context <= MAX_CONTEXT:
        raise UsageError(f"--context must be 16..{MAX_CONTEXT} tokens per rank, got {context}")
    if not (0 < a.lr <= 1):
        raise UsageError(f"--lr must be in (0, 1], got {a.lr}")
    if a.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {a.warmup}")
    if not (0 <= a.weight_decay <= 1):
        raise UsageError(f"--weight-decay must be in [0, 1], got {a.weight_decay}")
    if not (0 <= a.clip < math.inf):
        raise UsageError(f"--clip must be >= 0 (0: off), got {a.clip}")
    if a.skip is None:
        a.skip = 1 if a.steps > 1 else 0
    if a.skip < 0 or a.skip >= a.steps:
        raise UsageError(f"--skip {a.skip} leaves no step of {a.steps} to time: give 0..{a.steps - 1}")
    if a.log_every < 1:
        raise UsageError(f"--log-every must be >= 1, got {a.log_every}")
    if a.save_every < 0 or (a.save_every and not a.checkpoint):
        raise UsageError("--save-every needs --checkpoint and a count >= 1")
    if a.seed is not None and not 0 <= a.seed <= MAX_SEED:
        raise UsageError(f"--seed must be 0..{MAX_SEED}, got {a.seed}")
    if not 0 < a.bucket_mb <= MAX_BUCKET_MB:
        raise UsageError(f"--bucket-mb must be in (0, {MAX_BUCKET_MB}] MB, got {a.bucket_mb}")
    if not MIN_TIMEOUT <= a.timeout <= MAX_TIMEOUT:
        raise UsageError(f"--timeout must be {MIN_TIMEOUT}..{MAX_TIMEOUT} seconds (a week), got {a.timeout}")
    if a.threads is not None and not 1 <= a.threads <= 1024:
        raise UsageError(f"--threads must be 1..1024, got {a.threads}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to PyTorch here; use --device cpu")
    try:  # the server kernel runs on this device with fp32 (no collective)
        get_backend(a.kernel, torch.device(a.device), torch.float32, head_dim=PRESETS[a.preset].head_dim)
    except ValueError as e:
        raise UsageError(f"--kernel {a.kernel}: {e}") from None
    if a.data:
        _check_data_file(a.data)
    if a.resume:
        _check_resume_folder(a.resume)
    inputs = {"--data": a.data, "--resume": a.resume}
    if a.json is not None:
        _check_json_output(a.json, inputs)
    if a.checkpoint is not None:
        try:
            checkpoint.check_output_folder("--checkpoint", a.checkpoint, inputs)
        except checkpoint.CheckpointError as e:
            raise UsageError(str(e)) from None
        if a.json is not None:
            report, folder = Path(os.path.abspath(a.json)).resolve(), Path(os.path.abspath(a.checkpoint)).resolve()
            if report == folder or folder in report.parents:
                raise UsageError(f"--json {a.json} names the --checkpoint folder or lies inside it, which a save "
                                 f"replaces; write it elsewhere")
    model = replace(PRESETS[a.preset], tie_embeddings=a.tie_embeddings)
    cfg = Config(a, model, context, backends,
                 workload=None if a.data else (a.workload or PRESET_WORKLOAD[a.preset]),
                 seed=None if a.data else (1 if a.seed is None else a.seed),
                 policy=a.policy or "minlink", tolerance="auto" if a.tolerance is None else a.tolerance,
                 granularity=a.granularity, backward=a.backward or "stateful",
                 pingpong={"on": True, "off": False}.get(a.pingpong or "auto", "auto"))
    if "cad" in backends:  # the planner's own checks (distca.plan's messages), no collective
        try:
            distca.plan([[16]], model=_cost_model(model), policy=cfg.policy, tolerance=cfg.tolerance,
                        granularity=cfg.granularity)
        except (TypeError, ValueError) as e:
            raise UsageError(str(e)) from None
    return cfg


def _check_data_file(path: str) -> None:
    """--data: a regular file (a FIFO or device is refused: every rank reads it, once each)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UsageError(f"--data {path}: {'no such data file' if e.errno == errno.ENOENT else e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--data {path}: is a folder, expected a JSON lines file")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"--data {path}: not a regular file (every rank reads it, so it must be one)")
    if not os.access(path, os.R_OK):
        raise UsageError(f"--data {path}: not readable")


def _check_resume_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"--resume {path}: {'not a folder' if os.path.exists(path) else 'no such folder'} "
                         f"(a checkpoint of this trainer is a folder)")
    if not os.path.isfile(os.path.join(path, CHECKPOINT_META)):
        raise UsageError(f"--resume {path}: not a checkpoint of this trainer (no {CHECKPOINT_META} in it)")


def _check_json_output(path: str, inputs: dict) -> None:
    """--json: the CLI's output rules (src/core/file.cc check_output_path), before any work."""
    if not path:
        raise UsageError("--json needs a file name")
    target = Path(os.path.abspath(path)).resolve()
    if target.is_dir():
        raise UsageError(f"--json {path} is a folder; give a file name")
    if target.exists() and not stat.S_ISREG(os.stat(target).st_mode):
        # The report is a new file renamed into place: it replaces only a regular file, never a
        # device or a FIFO (as `distca` does).
        raise UsageError(f"--json {path}: not a regular file; the report replaces only a regular file")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"--json {path}: the folder {parent} does not exist")
    probe_folder("--json", path, parent, UsageError)
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"--json {path}: the file exists and is not writable")
    for in_flag, source in inputs.items():
        if not source:
            continue
        src = Path(os.path.abspath(source)).resolve()
        if src == target:
            raise UsageError(f"--json {path} is the {in_flag} input: it would be overwritten")
        if src.is_dir() and src in target.parents:
            raise UsageError(f"--json {path} lies inside the {in_flag} folder {source}; write it elsewhere")


def _cost_model(m: ModelArgs) -> dict:
    """What the planner prices: this model's attention and layer shape."""
    return {"heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "layers": m.n_layers,
            "hidden": m.dim, "ffn_hidden": m.ffn_dim, "dtype_bytes": 4}


# ---------------------------------------------------------------------------------------------
# Timing


class TimedKernel(ServerKernel):
    """A server kernel with a stopwatch (forward + backward seconds). On CUDA it synchronises
    around each call, so the seconds are the kernel's own (and the overlap of ping-pong is lost)."""

    def __init__(self, inner: ServerKernel, device: torch.device):
        self.inner, self.name, self.device = inner, inner.name, device
        self.seconds = 0.0

    def unavailable(self, device, dtype):
        return self.inner.unavailable(device, dtype)

    def _timed(self, fn, args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds += time.perf_counter() - start

    def forward(self, *args):
        return self._timed(self.inner.forward, args)

    def backward(self, *args):
        return self._timed(self.inner.backward, args)


class AttentionWatch:
    """Seconds inside cad_attention: the forward call, and the backward from the moment the
    output's gradient is ready (a hook on o) to the moment the inputs' gradients are (a hook on q)."""

    def __init__(self):
        self.forward = self.backward = 0.0
        self._started: Optional[float] = None

    def reset(self) -> None:
        self.forward = self.backward = 0.0
        self._started = None

    def _begin(self, grad):
        self._started = time.perf_counter()

    def _end(self, grad):
        if self._started is not None:
            self.backward += time.perf_counter() - self._started
            self._started = None


# ---------------------------------------------------------------------------------------------
# One backend: model, DDP, optimizer, planner


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up from lr / warmup to lr over `warmup` steps (step counts from 0), then constant."""
    return lr * (step + 1) / warmup if step < warmup else lr


class Backend:
    def __init__(self, name: str, cfg: Config, device: torch.device, attention_group, ddp_group):
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.name, self.cfg, self.device = name, cfg, device
        m = cfg.model
        shape = {"heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.head_dim}
        if name == "cad":
            self.planner = StepPlanner(attention_group, model=shape, cost_model=_cost_model(m), policy=cfg.policy,
                                       tolerance=cfg.tolerance, granularity=cfg.granularity,
                                       pingpong=cfg.pingpong, backward=cfg.backward, backend=cfg.args.kernel,
                                       device=device)
        else:
            self.planner = StepPlanner(attention_group, model=shape, cost_model=_cost_model(m), policy="none",
                                       pingpong=False, backend=cfg.args.kernel, device=device)
        self.model = Transformer(m).to(device)
        self.ddp = DDP(self.model, process_group=ddp_group, device_ids=[device.index] if device.type == "cuda" else None,
                       bucket_cap_mb=cfg.args.bucket_mb)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.args.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=cfg.args.lr, betas=(0.9, 0.95), eps=1e-8)
        self.kernel = TimedKernel(get_backend(cfg.args.kernel, device, torch.float32, head_dim=m.head_dim), device)
        self.watch = AttentionWatch()
        self.layout: Optional[StepLayout] = None

    def attention(self, q, k, v):
        start = time.perf_counter()
        o = cad_attention(q, k, v, self.layout, backend=self.kernel)
        self.watch.forward += time.perf_counter() - start
        if o.requires_grad:
            o.register_hook(self.watch._begin)
            q.register_hook(self.watch._end)
        return o

    def train_step(self, step: int, data: StepData, rank: int, world: int, ctl_group) -> dict:
        """One optimizer step on this rank's slice -> this rank's measurements."""
        cfg = self.cfg
        tokens, targets, pieces, cu = data.rank_slice(rank, cfg.context)
        tokens_t = torch.from_numpy(tokens).to(self.device)
        targets_t = torch.from_numpy(targets).to(self.device)
        self.kernel.seconds = 0.0
        self.watch.reset()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        dist.barrier(group=ctl_group)
        t0 = time.perf_counter()
        layout = self.layout = self.planner.plan(cu) if cu is not None else self.planner.plan(pieces=pieces)
        t_plan = time.perf_counter()
        logits = self.ddp(tokens_t, layout.positions, self.attention)
        loss_sum = packed_cross_entropy(logits, targets_t)
        # The mean over every rank's targets; DDP averages gradients over ranks, hence x world.
        loss = loss_sum * (world / data.num_targets)
        sync()
        t_fwd = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sync()
        t_bwd = time.perf_counter()
        params = list(self.model.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.args.clip if cfg.args.clip > 0 else math.inf)
        lr = lr_at(step, cfg.args.lr, cfg.args.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        sync()
        t_end = time.perf_counter()
        plan = layout.plan
        self.layout = None
        return {"step_seconds": t_end - t0, "plan_seconds": t_plan - t0, "forward_seconds": t_fwd - t_plan,
                "backward_seconds": t_bwd - t_fwd, "optimizer_seconds": t_end - t_bwd,
                "attention_kernel_seconds": self.kernel.seconds,
                "attention_seconds": self.watch.forward + self.watch.backward,
                "attention_forward_seconds": self.watch.forward, "attention_backward_seconds": self.watch.backward,
                "loss_sum": float(loss_sum.detach()), "grad_norm": float(grad_norm), "lr": lr,
                "rows_served_remotely": rows_served_remotely(plan), "plan_imbalance": float(plan.load["imbalance"]),
                "plan_tolerance": float(plan.tolerance)}


def rows_served_remotely(plan) -> int:
    """Query rows whose attention a server other than their owner computes (per task: a row whose
    keys were split counts once per task); 0 under colocated attention."""
    pieces = np.asarray(plan.batch.to_dict()["pieces"], dtype=np.int64).reshape(-1, 4)
    by_doc: dict = {}
    for doc, begin, end, rank in pieces.tolist():
        by_doc.setdefault(doc, []).append((begin, end, rank))
    moved = 0
    for doc, q0, q1, _, _, server in plan.tasks.tolist():
        moved += sum(max(0, min(q1, e) - max(q0, b)) for b, e, r in by_doc[doc] if r != server)
    return moved


PER_RANK = ("step_seconds", "plan_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds",
            "attention_kernel_seconds", "attention_seconds", "attention_forward_seconds", "attention_backward_seconds",
            "loss_sum")


def gather_record(local: dict, step: int, backend: str, data: StepData, cfg: Config, world: int, ctl_group) -> dict:
    """Every rank's measurements -> the step's record (the same on every rank)."""
    mine = torch.tensor([local[k] for k in PER_RANK], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=ctl_group)
    per_rank = {k: [float(t[i]) for t in everyone] for i, k in enumerate(PER_RANK)}
    kernel = per_rank["attention_kernel_seconds"]
    straggler = max(range(world), key=lambda r: kernel[r])
    step_s = max(per_rank["step_seconds"])
    mean_kernel = sum(kernel) / world
    return {
        "step": step + 1, "backend": backend,
        "loss": sum(per_rank["loss_sum"]) / data.num_targets,
        "lr": local["lr"], "grad_norm": local["grad_norm"],
        "rows_served_remotely": local["rows_served_remotely"], "plan_imbalance_estimated": local["plan_imbalance"],
        "plan_tolerance": local.get("plan_tolerance"),
        "step_seconds": step_s, "tokens_per_second": world * cfg.context / step_s,
        "straggler_rank": straggler,
        "attention_seconds": per_rank["attention_seconds"][straggler],
        "attention_kernel_max_seconds": max(kernel), "attention_kernel_min_seconds": min(kernel),
        "attention_imbalance": max(kernel) / mean_kernel if mean_kernel > 0 else 1.0,
        "plan_ms_max": 1e3 * max(per_rank["plan_seconds"]),
        "documents": len({key for pieces in data.pieces for key, *_ in pieces}),
        "documents_spanning_ranks": data.spanning_documents(),
        "per_rank": {k: v for k, v in per_rank.items() if k != "loss_sum"},
    }


# ---------------------------------------------------------------------------------------------
# Checkpoints (distca/torch/checkpoint.py: JSON and raw bytes, nothing unpickled)


def _checkpoint_meta(cfg: Config, world: int, steps_done: int) -> dict:
    return {"format": CHECKPOINT_FORMAT, "version": checkpoint.VERSION, "steps_done": steps_done,
            "backends": list(cfg.backends), "ranks": world, "context": cfg.context, "model": cfg.model.to_dict(),
            **cfg.data_identity}


def _state_tensors(backends: list) -> dict:
    """Every backend's model parameters and AdamW state, by name."""
    out: dict = {}
    for b in backends:
        for name, t in b.model.state_dict().items():
            out[f"{b.name}/model/{name}"] = t
        for index, state in b.optimizer.state_dict()["state"].items():
            for key, t in state.items():
                if not isinstance(t, torch.Tensor):
                    t = torch.tensor(t)
                out[f"{b.name}/optim/{index}/{key}"] = t
    return out


def _expected_tensors(backends: list) -> dict:
    """{name: (dtype, shape)} of what a checkpoint of these backends holds after a step: each
    parameter, and AdamW's step, exp_avg and exp_avg_sq of each (by index, as state_dict numbers them)."""
    out: dict = {}
    for b in backends:
        for name, t in b.model.state_dict().items():
            out[f"{b.name}/model/{name}"] = (t.dtype, list(t.shape))
        params = [q for group in b.optimizer.param_groups for q in group["params"]]
        for index, q in enumerate(params):
            out[f"{b.name}/optim/{index}/step"] = (torch.float32, [])
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{b.name}/optim/{index}/{key}"] = (q.dtype, list(q.shape))
    return out


def save_checkpoint(path: str, backends: list, steps_done: int, cfg: Config, world: int, rank: int,
                    ctl_group) -> None:
    """Rank 0 writes the (replicated) state as a new folder renamed into place, so a crash leaves
    the last good checkpoint; a failure there ends every rank with its message."""
    error = None
    if rank == 0:
        try:
            checkpoint.save(path, _checkpoint_meta(cfg, world, steps_done), _state_tensors(backends))
        except (OSError, checkpoint.CheckpointError) as e:
            error = f"--checkpoint {path}: the save after step {steps_done} failed ({e})"
    _agree(error, ctl_group, RunError)
    cfg.saved_step = steps_done


def check_resume(path: str, cfg: Config, world: int) -> int:
    """The checkpoint's header against this run -> steps done; UsageError naming the field."""
    meta_path = os.path.join(path, CHECKPOINT_META)
    try:
        meta = checkpoint.read_header(path)
    except checkpoint.CheckpointError as e:
        raise UsageError(str(e)) from None
    want = _checkpoint_meta(cfg, world, 0)
    for key in ("backends", "ranks", "context", "model", *cfg.data_identity):
        if meta.get(key) != want[key]:
            raise UsageError(f"{meta_path}: field \"{key}\" is {json.dumps(meta.get(key))}, this run has "
                             f"{json.dumps(want[key])}: resume with the same flags, ranks and data")
    extra = set(meta) - set(want) - {"tensors"}
    if extra:
        raise UsageError(f"{meta_path}: unknown field \"{sorted(extra)[0]}\" (or data flags that differ from this run's)")
    done = meta.get("steps_done")
    if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= 100_000_000:
        raise UsageError(f"{meta_path}: field \"steps_done\" must be an integer 0..100000000, got {done!r}")
    if done >= cfg.args.steps:
        raise UsageError(f"--resume {path} is at step {done}: give --steps above {done} to continue")
    return done


def load_checkpoint(path: str, backends: list) -> None:
    """The checkpoint's tensors into every backend's model and optimizer; UsageError when a tensor
    is missing, extra, or of another shape or dtype than this run's."""
    try:
        tensors = checkpoint.load(path, checkpoint.read_header(path))
    except checkpoint.CheckpointError as e:
        raise UsageError(str(e)) from None
    want = _expected_tensors(backends)
    where = os.path.join(path, CHECKPOINT_META)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        name = (missing or extra)[0]
        raise UsageError(f"{where}: tensor {name} is {'missing' if missing else 'not one of this run'} "
                         f"({len(missing)} missing, {len(extra)} extra)")
    for name, (dtype, shape) in want.items():
        got = tensors[name]
        if list(got.shape) != shape or got.dtype != dtype:
            raise UsageError(f"{where}: tensor {name} is {got.dtype} {list(got.shape)}, this run has {dtype} {shape}")
    for b in backends:
        prefix = f"{b.name}/model/"
        b.model.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
        optim = b.optimizer.state_dict()
        prefix = f"{b.name}/optim/"
        state: dict = {}
        for k, v in tensors.items():
            if k.startswith(prefix):
                index, key = k[len(prefix):].split("/", 1)
                state.setdefault(int(index), {})[key] = v
        optim["state"] = state
        b.optimizer.load_state_dict(optim)


# ---------------------------------------------------------------------------------------------
# Output


def si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def step_line(r: dict, steps: int, elapsed: float, remaining: Optional[float]) -> str:
    eta = f"  [{elapsed:.0f}s, ~{remaining:.0f}s left]" if remaining is not None else f"  [{elapsed:.0f}s]"
    return (f"step {r['step']:>4}/{steps} {r['backend']:<9} loss {r['loss']:.4f}  {si(r['tokens_per_second']):>6} tok/s  "
            f"{r['step_seconds']:.3f}s  attn {r['attention_seconds']:.3f}s (rank {r['straggler_rank']}; kernels "
            f"{r['attention_kernel_min_seconds']:.3f}-{r['attention_kernel_max_seconds']:.3f}s, imbalance "
            f"{r['attention_imbalance']:.2f})  plan {r['plan_ms_max']:.1f} ms{eta}")


def summarise(records: list, cfg: Config, first_step: int, wall: float) -> dict:
    skip = cfg.args.skip
    out: dict = {"backends": {}}
    for name in cfg.backends:
        rs = [r for r in records if r["backend"] == name]
        timed = [r for r in rs if r["step"] > first_step + skip] or rs
        k = max(1, min(10, len(rs) // 2))
        mean = lambda key: statistics.fmean(r[key] for r in timed)  # noqa: E731
        out["backends"][name] = {
            "step_seconds": mean("step_seconds"), "tokens_per_second": cfg.context * len(timed[0]["per_rank"]["step_seconds"]) / mean("step_seconds"),
            "attention_seconds": mean("attention_seconds"), "attention_kernel_max_seconds": mean("attention_kernel_max_seconds"),
            "attention_imbalance": mean("attention_imbalance"), "plan_ms": mean("plan_ms_max"),
            "first_timed_step": timed[0]["step"], "timed_steps": len(timed), "loss_steps": k,
            "loss_first": statistics.fmean(r["loss"] for r in rs[:k]), "loss_last": statistics.fmean(r["loss"] for r in rs[-k:]),
        }
    b = out["backends"]
    out["loss_first"] = b[cfg.backends[-1]]["loss_first"]
    out["loss_last"] = b[cfg.backends[-1]]["loss_last"]
    if len(cfg.backends) == 2:
        col = {r["step"]: r for r in records if r["backend"] == "colocated"}
        cad = {r["step"]: r for r in records if r["backend"] == "cad"}
        out["colocated_step_seconds"] = b["colocated"]["step_seconds"]
        out["cad_step_seconds"] = b["cad"]["step_seconds"]
        out["speedup"] = b["colocated"]["step_seconds"] / b["cad"]["step_seconds"]
        ratios = [col[s]["step_seconds"] / cad[s]["step_seconds"] for s in sorted(cad) if s > first_step + skip]
        out["speedup_per_step"] = ratios
        out["speedup_median"] = statistics.median(ratios) if ratios else None
        out["loss_max_rel_diff"] = max(abs(cad[s]["loss"] - col[s]["loss"]) / abs(col[s]["loss"]) for s in cad)
    else:
        out["speedup"] = out["speedup_median"] = out["loss_max_rel_diff"] = None
    out["wall_seconds"] = wall
    return out


def print_summary(s: dict, cfg: Config) -> None:
    any_b = next(iter(s["backends"].values()))
    k = any_b["loss_steps"]
    head = "loss first -> last step" if k == 1 else f"loss, mean of first {k} -> last {k}"
    say(f"\n{'backend':<10} {'step (s)':>9} {'tokens/s':>9} {'attn (s)':>9} {'kernels (s)':>11} {'imbalance':>9} "
        f"{'plan (ms)':>9}  {head}")
    for name in BACKENDS:
        if name in s["backends"]:
            b = s["backends"][name]
            say(f"{name:<10} {b['step_seconds']:>9.3f} {si(b['tokens_per_second']):>9} {b['attention_seconds']:>9.3f} "
                f"{b['attention_kernel_max_seconds']:>11.3f} {b['attention_imbalance']:>9.2f} {b['plan_ms']:>9.1f}  "
                f"{b['loss_first']:.4f} -> {b['loss_last']:.4f}")
    say(f"times: means over steps {any_b['first_timed_step']}..{any_b['first_timed_step'] + any_b['timed_steps'] - 1} "
        f"(--skip leaves out warm-up); step: the longest rank's; attn: the straggler's time inside cad_attention "
        f"(forward + backward, waiting included); kernels: the busiest rank's server-kernel seconds; imbalance: their "
        f"max/mean over ranks")
    if s["speedup"] is not None:
        say(f"speedup of CAD over colocated (same run, same data): {s['speedup']:.2f}x (mean step times; median of "
            f"per-step ratios {s['speedup_median']:.2f}x); largest relative loss difference: {s['loss_max_rel_diff']:.2e}")
    say(f"wall time {s['wall_seconds']:.1f} s")


def write_json(path: str, doc: dict) -> None:
    """A new file renamed into place (distca's own writer: a device, FIFO or folder is refused)."""
    from distca import _distca
    _distca.write_file_atomic(path, json.dumps(doc, indent=1))


# ---------------------------------------------------------------------------------------------
# The run


def _settings(a: argparse.Namespace) -> dict:
    """The flags this rank was started with, defaults included, as plain values."""
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for k, v in sorted(vars(a).items())}


def _same_settings(a: argparse.Namespace, ctl_group) -> None:
    """UsageError on every rank, naming the first flag that differs, when the ranks were started
    with different settings (before any work: nothing is read or written)."""
    every: list = [None] * dist.get_world_size(ctl_group)
    dist.all_gather_object(every, _settings(a), group=ctl_group)
    first = every[0]
    for r, other in enumerate(every[1:], start=1):
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                flag = "--" + key.replace("_", "-")
                def shown(v: Any) -> str:
                    return "unset" if v is None else str(v)
                raise UsageError(f"the ranks were started with different settings: {flag} is {shown(first.get(key))} on "
                                 f"rank 0 and {shown(other.get(key))} on rank {r}; start every rank with the same "
                                 f"command line")


def _agree(local_error: Optional[str], ctl_group, error: Optional[type] = None) -> None:
    """Raises `error` (UsageError by default) on every rank when any rank has an error (the lowest
    rank's message)."""
    messages: list = [None] * dist.get_world_size(ctl_group)
    dist.all_gather_object(messages, local_error, group=ctl_group)
    bad = [(r, m) for r, m in enumerate(messages) if m is not None]
    if bad:
        raise (error or UsageError)(bad[0][1] if len(bad) == len(messages) else f"rank {bad[0][0]}: {bad[0][1]}")


def run(cfg: Config) -> int:
    a = cfg.args
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Groups: attention (the world: cad_attention and planning), DDP's own, and a gloo one for the
    # trainer's barriers, statistics, agreement and checkpoints.
    backend = dist.get_backend()
    ddp_group = dist.new_group(backend=backend)
    ctl_group = dist.new_group(backend="gloo")
    _same_settings(a, ctl_group)

    # Data and resume checks: every rank reads the same inputs; any rank's error stops all.
    error, steps_done = None, 0
    data: Union[JsonlData, SyntheticData, None] = None
    try:
        if a.data:
            data = JsonlData(a.data, read_jsonl(a.data, progress=say), world, cfg.context)
        else:
            assert cfg.workload is not None and cfg.seed is not None
            data = SyntheticData(cfg.workload, cfg.seed, world, cfg.context)
        if a.resume:
            steps_done = check_resume(a.resume, cfg, world)
    except (UsageError, DataError) as e:
        error = str(e)
    _agree(error, ctl_group)
    assert data is not None

    backends = [Backend(name, cfg, device, dist.group.WORLD, ddp_group) for name in cfg.backends]
    if a.resume:
        error = None
        try:
            load_checkpoint(a.resume, backends)
        except UsageError as e:
            error = str(e)
        _agree(error, ctl_group)

    m = cfg.model
    say(f"{PROG}: {' vs '.join(cfg.backends)}{' (compared, interleaved step by step)' if len(backends) > 1 else ''} "
        f"on {world} rank(s), {device.type} ({backend})")
    say(f"  model      {m.n_layers} layers, d {m.dim}, heads {m.n_heads}/{m.n_kv_heads} x {m.head_dim}, ffn "
        f"{m.ffn_dim}, vocab {m.vocab_size}{', tied embeddings' if m.tie_embeddings else ''}: "
        f"{si(m.num_parameters())} parameters")
    say(f"  data       {data.describe()}; {cfg.context} tokens per rank per step, {a.steps} steps"
        f"{f' (resumed after step {steps_done})' if steps_done else ''}")
    if "cad" in cfg.backends:
        cad_planner = backends[cfg.backends.index("cad")].planner
        say(f"  cad        planner {cfg.policy}, tolerance {cfg.tolerance}, granularity {cfg.granularity or 'default'}, "
            f"{cfg.backward} backward, ping-pong {'on' if cad_planner.pingpong else 'off'}, kernel {backends[0].kernel.name}")
    if "colocated" in cfg.backends:
        say(f"  colocated  each rank attends its own documents (planner none), kernel {backends[0].kernel.name}")
    say(f"  optimizer  AdamW lr {a.lr} (warm-up {a.warmup} steps, then constant), betas 0.9/0.95, weight decay "
        f"{a.weight_decay}, clip {a.clip}; DDP buckets {a.bucket_mb} MB; {torch.get_num_threads()} thread(s) per rank")

    records: list = []
    start = time.perf_counter()
    run_steps = a.steps - steps_done
    for i, step in enumerate(range(steps_done, a.steps)):
        batch = data.step(step)
        if batch.epoch_started:
            say(f"epoch {batch.epoch_started + 1} of {a.data} begins in step {step + 1} (the file starts again)")
        order = backends if step % 2 == 0 else backends[::-1]
        step_records = {}
        for b in order:
            local = b.train_step(step, batch, rank, world, ctl_group)
            step_records[b.name] = gather_record(local, step, b.name, batch, cfg, world, ctl_group)
        elapsed = time.perf_counter() - start
        remaining = elapsed / (i + 1) * (run_steps - i - 1)
        for name in cfg.backends:
            records.append(step_records[name])
            if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
                say(step_line(step_records[name], a.steps, elapsed, remaining if step + 1 < a.steps else None))
        if a.save_every and (step + 1) % a.save_every == 0 and step + 1 < a.steps:
            save_checkpoint(a.checkpoint, backends, step + 1, cfg, world, rank, ctl_group)
    wall = time.perf_counter() - start
    if a.checkpoint:
        save_checkpoint(a.checkpoint, backends, a.steps, cfg, world, rank, ctl_group)
        say(f"checkpoint: {a.checkpoint} (step {a.steps})")
    summary = summarise(records, cfg, steps_done, wall)
    print_summary(summary, cfg)
    json_error = None
    if a.json and rank == 0:
        try:
            _write_report(a, cfg, m, world, device, steps_done, backends, records, summary)
            say(f"json: {a.json}")
        except (OSError, ValueError) as e:
            json_error = f"--json {a.json}: the report could not be written ({e})"
    for b in backends:
        b.planner.close()
    if a.json:
        _agree(json_error, ctl_group, RunError)
    return 0


def _write_report(a, cfg: Config, m: ModelArgs, world: int, device, steps_done: int, backends: list, records: list,
                  summary: dict) -> None:
    write_json(a.json, {"format": "distca-torch-train", "version": 1,
                        "config": {"preset": a.preset, "backends": list(cfg.backends), "ranks": world,
                                   "device": device.type, "context": cfg.context, "steps": a.steps,
                                   "resumed_after": steps_done, "model": m.to_dict(), **cfg.data_identity,
                                   "policy": cfg.policy if "cad" in cfg.backends else None,
                                   "tolerance": cfg.tolerance, "granularity": cfg.granularity,
                                   "backward": cfg.backward, "kernel": backends[0].kernel.name,
                                   "lr": a.lr, "warmup": a.warmup, "weight_decay": a.weight_decay,
                                   "clip": a.clip, "skip": a.skip, "threads": torch.get_num_threads()},
                        "steps": records, "summary": summary})


def main(argv: Optional[list] = None) -> int:
    """The command line; returns the exit status. Under torchrun it initialises the process group
    from the environment; inside a process that already has one (distca.torch.run_ranks) it uses it."""
    try:
        cfg = parse_args(argv)
    except UsageError as e:
        say(f"{PROG}: error: {e}")
        return 2
    if cfg is None:
        return 0
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
    try:
        return run(cfg)
    except (UsageError, InputError, DataError) as e:
        say(f"{PROG}: error: {e}")
        return 2
    except RunError as e:
        say(f"{PROG}: error: {e}")
        return 1
    except KeyboardInterrupt:
        # The last checkpoint written is whole: a save renames a complete folder into place.
        last = (f"; {cfg.args.checkpoint} holds the checkpoint of step {cfg.saved_step}, saved whole"
                if cfg.saved_step is not None else "; no checkpoint was saved" if cfg.args.checkpoint else "")
        say(f"{PROG}: interrupted{last}")
        created = False        # no teardown: a collective cut short by the interrupt may never end
        return 130
    finally:
        if created:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (a peer that already failed)
                pass


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    status = main()
    if status == 130:          # interrupted: leave at once, as the checkpoint on disk is whole
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
