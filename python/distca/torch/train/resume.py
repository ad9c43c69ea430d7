"""The trainer's checkpoints (distca.torch.train): what a save holds (every backend's model and
AdamW state, by name), rank 0's save, and the checks on --resume against this run's flags, ranks
and tensors; the format itself is distca.torch.train.checkpoint's (JSON and raw bytes, nothing
unpickled).

With --pp or --tp the ranks of one replica hold different tensors (a stage's layers, a TP rank's
heads and FFN columns): each is saved under its place, "<backend>/stage<s>.tp<t>/model/<name>",
gathered to rank 0 from the ranks of replica 0 (the other replicas hold the same), and the header
names the rank map ("rank_map": tp, pp, dp). A resume needs the same map (refused in one line
otherwise) and each rank loads its own place's tensors, so the resumed curve is the straight one.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

import torch.distributed as dist

from ..parallel.ranks import RankMap
from . import checkpoint
from .config import CHECKPOINT_FORMAT, CHECKPOINT_META, Config, RunError, UsageError, agree_on_error


def _rank_map(cfg: Config, world: int) -> Optional[RankMap]:
    """The run's rank map when it has pipeline stages or TP ranks, else None (data parallel only)."""
    return RankMap.of(world, tp=cfg.tp, pp=cfg.pp) if cfg.pp > 1 or cfg.tp > 1 else None


def _place(cfg: Config, world: int, rank: int) -> str:
    """The part of a tensor's name that says which rank of a replica holds it ("" without --pp/--tp)."""
    m = _rank_map(cfg, world)
    if m is None:
        return ""
    c = m.coords(rank)
    return f"stage{c.stage}.tp{c.tp}/"


def _checkpoint_meta(cfg: Config, world: int, steps_done: int) -> dict:
    meta = {"format": CHECKPOINT_FORMAT, "version": checkpoint.VERSION, "steps_done": steps_done,
            "backends": list(cfg.backends), "ranks": world, "context": cfg.context, "model": cfg.model.to_dict(),
            **cfg.data_identity}
    m = _rank_map(cfg, world)
    if m is not None:
        meta["rank_map"] = {"tp": m.tp, "pp": m.pp, "dp": m.dp}
    return meta


def _state_tensors(backends: list, place: str = "") -> dict:
    """Every backend's model parameters and AdamW state, by name."""
    out: dict = {}
    for b in backends:
        for name, t in b.model.state_dict().items():
            out[f"{b.name}/{place}model/{name}"] = t
        for index, state in b.optimizer.state_dict()["state"].items():
            for key, t in state.items():
                if not isinstance(t, torch.Tensor):
                    t = torch.tensor(t)
                out[f"{b.name}/{place}optim/{index}/{key}"] = t
    return out


def _expected_tensors(backends: list, place: str = "") -> dict:
    """{name: (dtype, shape)} of what a checkpoint of these backends holds after a step: each
    parameter, and AdamW's step, exp_avg and exp_avg_sq of each (by index, as state_dict numbers them)."""
    out: dict = {}
    for b in backends:
        for name, t in b.model.state_dict().items():
            out[f"{b.name}/{place}model/{name}"] = (t.dtype, list(t.shape))
        params = [q for group in b.optimizer.param_groups for q in group["params"]]
        for index, q in enumerate(params):
            out[f"{b.name}/{place}optim/{index}/step"] = (torch.float32, [])
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{b.name}/{place}optim/{index}/{key}"] = (q.dtype, list(q.shape))
    return out


def save_checkpoint(path: str, backends: list, steps_done: int, cfg: Config, world: int, rank: int,
                    ctl_group) -> None:
    """Rank 0 writes the (replicated) state as a new folder renamed into place, so a crash leaves
    the last good checkpoint; a failure there ends every rank with its message."""
    error = None
    tensors = _state_tensors(backends, _place(cfg, world, rank))
    m = _rank_map(cfg, world)
    if m is not None:
        # Replica 0's ranks hold every place once; rank 0 writes them all.
        mine = tensors if m.coords(rank).replica == 0 else None
        gathered: Optional[list] = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=ctl_group)
        if rank == 0:
            assert gathered is not None
            tensors = {k: v for part in gathered if part is not None for k, v in part.items()}
    if rank == 0:
        try:
            checkpoint.save(path, _checkpoint_meta(cfg, world, steps_done), tensors)
        except (OSError, checkpoint.CheckpointError) as e:
            error = f"--checkpoint {path}: the save after step {steps_done} failed ({e})"
    agree_on_error(error, ctl_group, RunError)
    cfg.saved_step = steps_done


def step_on_disk(path: str) -> Optional[int]:
    """The step of the whole checkpoint at `path`, or None where there is none to read. After a
    Ctrl-C this is the truth to report: an interrupt can land after a save's rename and before the
    run notes the step (the signal is held only across the renames)."""
    try:
        step = checkpoint.read_header(path).get("steps_done")
    except checkpoint.CheckpointError:
        return None
    return step if isinstance(step, int) else None


def check_resume(path: str, cfg: Config, world: int) -> int:
    """The checkpoint's header against this run -> steps done; UsageError naming the field."""
    meta_path = os.path.join(path, CHECKPOINT_META)
    try:
        meta = checkpoint.read_header(path)
    except checkpoint.CheckpointError as e:
        raise UsageError(str(e)) from None
    want = _checkpoint_meta(cfg, world, 0)
    keys = ["backends", "ranks", "context", "model", *cfg.data_identity]
    if "rank_map" in want or "rank_map" in meta:
        keys.insert(2, "rank_map")
    for key in keys:
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


def load_checkpoint(path: str, backends: list, place: str = "", places: tuple = ("",)) -> None:
    """The checkpoint's tensors of this rank's place into every backend's model and optimizer;
    UsageError when a tensor is missing, extra, or of another shape or dtype than this run's.
    places: every place of the run's rank map (a tensor of none of them is extra)."""
    try:
        tensors = checkpoint.load(path, checkpoint.read_header(path))
    except checkpoint.CheckpointError as e:
        raise UsageError(str(e)) from None
    want = _expected_tensors(backends, place)
    where = os.path.join(path, CHECKPOINT_META)
    others = {k for k in tensors if k not in want and any(k.startswith(f"{b.name}/{p}") for b in backends
                                                           for p in places if p != place)}
    tensors = {k: v for k, v in tensors.items() if k not in others}
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
        prefix = f"{b.name}/{place}model/"
        b.model.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
        optim = b.optimizer.state_dict()
        prefix = f"{b.name}/{place}optim/"
        state: dict = {}
        for k, v in tensors.items():
            if k.startswith(prefix):
                index, key = k[len(prefix):].split("/", 1)
                state.setdefault(int(index), {})[key] = v
        optim["state"] = state
        b.optimizer.load_state_dict(optim)


def load_own_checkpoint(path: str, backends: list, cfg: Config, world: int, rank: int) -> None:
    """load_checkpoint of this rank's place in the run's rank map."""
    m = _rank_map(cfg, world)
    places = ("",) if m is None else tuple(sorted({_place(cfg, world, w) for w in range(world)}))
    load_checkpoint(path, backends, _place(cfg, world, rank), places)
