"""The trainer's command line (distca.torch.train): its flags, the Config they make, every check
that needs no collective (parse_args: each rank reaches the same verdict alone), the errors that
end a run (UsageError: exit status 2, RunError: 1), and the ranks' agreement on the flags and on
any rank's error (check_same_settings, agree_on_error).
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

import distca

from ..kernels.backends import backend_names, get_backend
from . import checkpoint
from .checkpoint import probe_folder
from .model import PRESET_CONTEXT, PRESET_WORKLOAD, PRESETS, ModelArgs


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


def _state_budget_arg(text: str) -> Union[int, str]:
    """--state-budget: MiB (a number from 0) -> bytes, or "unlimited"."""
    if text == "unlimited":
        return text
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not 0 <= mib <= 2**40:
        raise argparse.ArgumentTypeError(f"must be unlimited or MiB from 0, got {text!r}")
    return int(mib * 2**20)


def env_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def say(*parts: Any) -> None:
    """Rank 0 prints (flushed)."""
    if env_rank() == 0:
        print(*parts, flush=True)


# ---------------------------------------------------------------------------------------------
# Flags


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message, exit 2 (by the caller)
        raise UsageError(f"{message} (see --help)")

    def _print_message(self, message, file=None):  # --help: rank 0 only
        if message and env_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m {PROG}", formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Train a Llama-style byte-level model data-parallel with CAD or colocated core attention "
                            "(run under torchrun; one process per rank).",
                epilog="examples:\n"
                       "  torchrun --nproc-per-node 2 -m distca.torch.train --preset demo --compare --json t.json\n"
                       "  torchrun --nproc-per-node 4 -m distca.torch.train --preset tiny --data docs.jsonl\n"
                       "exit status (every ending but 0 is one line, naming the rank where one rank alone knows):\n"
                       "  0    done\n"
                       "  2    bad input, found before the first step: a flag (also one that only one rank was\n"
                       "       started with), the data (also data that differs between ranks), a checkpoint\n"
                       "  1    the run failed: a collective that timed out (--timeout; the line names the rank\n"
                       "       waited for), a rank that failed or left, an output that could not be written\n"
                       "  130  interrupted (Ctrl-C); the last checkpoint saved is whole")
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
    g.add_argument("--layers", type=int, metavar="L", help="transformer layers (default: the preset's)")
    g.add_argument("--kv-heads", type=int, metavar="H",
                   help="key/value heads, a divisor of the query heads (default: the preset's)")
    g = p.add_argument_group("parallelism (world = pp x tp x dp; rank w = (stage x dp + replica) x tp + tp index)")
    g.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline stages, each --layers / P layers; cad: the paper's lockstep 1F1B, every tick's core "
                        "attention pooled over every stage and replica, idle stages serving; colocated: PyTorch's "
                        "Schedule1F1B (default 1)")
    g.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel ranks per replica: each holds heads / T and kv-heads / T (which T must "
                        "divide) and FFN / T; one CAD group per TP index (default 1)")
    g.add_argument("--micro-batches", type=int, metavar="M",
                   help="with --pp: micro-batches per step, each --context tokens; a document crossing into the next "
                        "micro-batch is cut there, as at a step's end (default 2 x P)")
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
    g.add_argument("--state-budget", type=_state_budget_arg, metavar="MIB|unlimited",
                   help="stateful: what a rank's servers may keep in a step beyond the stateless backward's memory; "
                        "the layers past it go stateless (default 0: no rank above colocated's attention memory)")
    g.add_argument("--grad-return", choices=("fp32", "bf16"),
                   help="the dtype the servers' dK/dV partial sums travel in, summed in fp32 at the owner "
                        "(bf16: half those bytes, the paper's choice; default fp32)")
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
    g.add_argument("--trace", metavar="FILE",
                   help="write the last --trace-steps steps' spans of every rank as Chrome trace-event JSON (Perfetto, "
                        "chrome://tracing; python -m distca.torch.trace_report FILE sums it)")
    g.add_argument("--trace-steps", type=int, default=3, metavar="N",
                   help="the steps --trace keeps: the last N of each backend (default 3)")
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
    grad_return: str = "fp32"   # fp32 | bf16: the dK/dV return's dtype
    state_budget: Optional[int] = 0   # bytes (StepPlanner's state_budget); None: unlimited
    pp: int = 1                 # pipeline stages
    tp: int = 1                 # tensor-parallel ranks per replica
    micro_batches: int = 1      # per replica per step (--pp); 1 without
    saved_step: Optional[int] = None   # the step of the last checkpoint this run saved
    data_fingerprint: Optional[str] = None   # --data: its content's (JsonlData.fingerprint), agreed by every rank

    @property
    def is_3d(self) -> bool:
        return self.pp > 1 or self.tp > 1

    def slices(self, world: int) -> int:
        """The step's slices of --context tokens: one per replica and micro-batch (one per rank
        without --pp or --tp)."""
        return world // (self.pp * self.tp) * self.micro_batches

    def check_world(self, world: int) -> None:
        """UsageError unless the world splits into replicas of pp x tp ranks."""
        if world % (self.pp * self.tp):
            raise UsageError(f"--pp {self.pp} x --tp {self.tp} = {self.pp * self.tp} ranks a replica does not divide the "
                             f"world's {world} ranks (DP = world / (pp x tp))")

    @property
    def data_identity(self) -> dict:
        """What a checkpoint names the data by: the --data file's content, or the synthetic stream."""
        if self.args.data:
            assert self.data_fingerprint is not None, "the data is read (and agreed on) before its identity is used"
            return {"data": self.data_fingerprint}
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
                                    ("--pingpong", a.pingpong), ("--grad-return", a.grad_return),
                                    ("--state-budget", a.state_budget)) if v is not None]
    if backends == ("colocated",) and planner_flags:
        raise UsageError(f"{', '.join(planner_flags)} would be ignored with --attention colocated "
                         f"(colocated attention has no planner options)")
    if a.state_budget is not None and (a.backward == "stateless" or a.pp > 1):
        raise UsageError("--state-budget would be ignored with " + ("--backward stateless" if a.backward == "stateless"
                         else "--pp (the lockstep schedule's backward is stateless)") +
                         ": it bounds what the stateful backward keeps")
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
    if a.trace is not None:
        _check_json_output(a.trace, inputs, "--trace")
        if a.json is not None and Path(os.path.abspath(a.trace)).resolve() == Path(os.path.abspath(a.json)).resolve():
            raise UsageError(f"--trace {a.trace} and --json name the same file; give each its own")
    if not 1 <= a.trace_steps <= 10000:
        raise UsageError(f"--trace-steps must be 1..10000, got {a.trace_steps}")
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
    if a.layers is not None:
        model = replace(model, n_layers=a.layers)
    if a.kv_heads is not None:
        model = replace(model, n_kv_heads=a.kv_heads)
    try:
        model.validate()
    except ValueError as e:
        raise UsageError(f"--layers/--kv-heads: {e}") from None
    micro_batches = _check_parallel(a, model, backends)
    cfg = Config(a, model, context, backends,
                 workload=None if a.data else (a.workload or PRESET_WORKLOAD[a.preset]),
                 seed=None if a.data else (1 if a.seed is None else a.seed),
                 policy=a.policy or "minlink", tolerance="auto" if a.tolerance is None else a.tolerance,
                 granularity=a.granularity, backward=a.backward or "stateful",
                 pingpong={"on": True, "off": False}.get(a.pingpong or "auto", "auto"),
                 grad_return=a.grad_return or "fp32",
                 state_budget=None if a.state_budget == "unlimited" else (a.state_budget or 0), pp=a.pp, tp=a.tp, micro_batches=micro_batches)
    if a.pp > 1:
        cfg.backward = a.backward or "stateless"
    if "cad" in backends:  # the planner's own checks (distca.plan's messages), no collective
        try:
            distca.plan([[16]], model=cost_model(model), policy=cfg.policy, tolerance=cfg.tolerance,
                        granularity=cfg.granularity)
        except (TypeError, ValueError) as e:
            raise UsageError(str(e)) from None
    return cfg


def _check_parallel(a: argparse.Namespace, model: ModelArgs, backends: tuple) -> int:
    """--pp, --tp and --micro-batches against the model and the other flags (the world is
    checked once known: Config.check_world) -> the micro-batches per step."""
    for flag, value in (("--pp", a.pp), ("--tp", a.tp)):
        if not 1 <= value <= 1024:
            raise UsageError(f"{flag} must be 1..1024, got {value}")
    if a.micro_batches is not None and a.pp == 1:
        raise UsageError("--micro-batches applies with --pp > 1 (the pipeline's micro-batches)")
    m = a.micro_batches if a.micro_batches is not None else 2 * a.pp
    if a.pp > 1 and not 1 <= m <= 65536:
        raise UsageError(f"--micro-batches must be 1..65536, got {m}")
    if model.n_layers % a.pp:
        raise UsageError(f"--pp {a.pp}: the model's {model.n_layers} layers do not split into {a.pp} stages of equal "
                         f"layers (an idle stage serves one exchange per layer of the busy ones); see --layers")
    if model.n_kv_heads % a.tp or model.ffn_dim % a.tp:
        raise UsageError(f"--tp {a.tp}: each TP rank holds key/value heads / T and FFN / T: the model's "
                         f"{model.n_kv_heads} key/value heads and FFN {model.ffn_dim} must split (see --kv-heads)")
    if a.pp > 1:
        if a.backward == "stateful":
            raise UsageError("--pp with --backward stateful: the lockstep schedule plans each backward tick apart "
                             "(other stages' micro-batches than its forward), so Q/K/V travel again: stateless")
        if a.tie_embeddings:
            raise UsageError("--tie-embeddings with --pp: the embedding and the LM head would be on different stages")
        if "colocated" in backends and m < a.pp:
            raise UsageError(f"--micro-batches {m} < --pp {a.pp}: colocated's Schedule1F1B needs at least one "
                             f"micro-batch per stage")
    return m if a.pp > 1 else 1


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


def _check_json_output(path: str, inputs: dict, flag: str = "--json") -> None:
    """--json, --trace: the CLI's output rules (src/core/file.cc check_output_path), before any work."""
    if not path:
        raise UsageError(f"{flag} needs a file name")
    target = Path(os.path.abspath(path)).resolve()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if target.exists() and not stat.S_ISREG(os.stat(target).st_mode):
        # The report is a new file renamed into place: it replaces only a regular file, never a
        # device or a FIFO (as `distca` does).
        raise UsageError(f"{flag} {path}: not a regular file; the report replaces only a regular file")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist")
    probe_folder(flag, path, parent, UsageError)
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path}: the file exists and is not writable")
    for in_flag, source in inputs.items():
        if not source:
            continue
        src = Path(os.path.abspath(source)).resolve()
        if src == target:
            raise UsageError(f"{flag} {path} is the {in_flag} input: it would be overwritten")
        if src.is_dir() and src in target.parents:
            raise UsageError(f"{flag} {path} lies inside the {in_flag} folder {source}; write it elsewhere")


def cost_model(m: ModelArgs) -> dict:
    """What the planner prices: this model's attention and layer shape."""
    return {"heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "layers": m.n_layers,
            "hidden": m.dim, "ffn_hidden": m.ffn_dim, "dtype_bytes": 4}


# ---------------------------------------------------------------------------------------------
# The ranks agree: on the flags, and on any rank's error


def _settings(a: argparse.Namespace) -> dict:
    """The flags this rank was started with, defaults included, as plain values."""
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for k, v in sorted(vars(a).items())}


def check_same_settings(a: argparse.Namespace, ctl_group) -> None:
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


def agree_on_error(local_error: Optional[str], ctl_group, error: Optional[type] = None) -> None:
    """Raises `error` (UsageError by default) on every rank when any rank has an error (the lowest
    rank's message)."""
    messages: list = [None] * dist.get_world_size(ctl_group)
    dist.all_gather_object(messages, local_error, group=ctl_group)
    bad = [(r, m) for r, m in enumerate(messages) if m is not None]
    if bad:
        raise (error or UsageError)(bad[0][1] if len(bad) == len(messages) else f"rank {bad[0][0]}: {bad[0][1]}")
