"""The trainer's measurements and output (distca.torch.train): each step's record gathered from
every rank, the per-step line, the summary table and the JSON report.
"""
from __future__ import annotations

import json
import statistics
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import trace
from . import memory
from .data import StepData
from .memory import MEMORY_PARTS
from .model import ModelArgs
from .config import BACKENDS, Config, RunError, agree_on_error, say


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
            "loss_sum") + tuple(f"memory_{k}_bytes" for k in MEMORY_PARTS) + ("memory_bytes", "rss_peak_bytes")


# With --pp: each rank's own micro-batches' forward and backward, its serving in idle ticks, its
# wait (the step less planning, compute, serving, gradient sync and optimizer), the rows it served
# in idle ticks and for other ranks.
PIPELINE_PER_RANK = ("compute_seconds", "serve_seconds", "wait_seconds", "served_idle_rows", "rows_served_remotely")


def _pipeline_record(per_rank: dict, cfg: Config, world: int) -> dict:
    """The pipeline's part of a step record: the straggler (the rank busiest with its own and
    served work, whom the others wait for), the bubble (the mean over ranks of the share of the
    step spent waiting) and each stage's compute, attention and wait (the max over its ranks)."""
    from ..parallel.ranks import RankMap
    rank_map = RankMap.of(world, tp=cfg.tp, pp=cfg.pp)
    busy = [c + s for c, s in zip(per_rank["compute_seconds"], per_rank["serve_seconds"])]
    straggler = max(range(world), key=lambda r: busy[r])
    stages = []
    for s in range(cfg.pp):
        ranks = [w for w in range(world) if rank_map.coords(w).stage == s]
        stages.append({"stage": s, "ranks": ranks,
                       **{k: max(per_rank[k][w] for w in ranks)
                          for k in ("compute_seconds", "attention_seconds", "serve_seconds", "wait_seconds")},
                       "served_idle_rows": sum(int(per_rank["served_idle_rows"][w]) for w in ranks)})
    return {"straggler_rank": straggler, "straggler_busy_seconds": busy[straggler],
            "bubble": sum(w / t for w, t in zip(per_rank["wait_seconds"], per_rank["step_seconds"])) / world,
            "wait_max_seconds": max(per_rank["wait_seconds"]), "stages": stages}


def gather_record(local: dict, step: int, backend: str, data: StepData, cfg: Config, world: int, ctl_group) -> dict:
    """Every rank's measurements -> the step's record (the same on every rank)."""
    keys = PER_RANK + (PIPELINE_PER_RANK if cfg.pp > 1 else ())
    local = {**local, "rss_peak_bytes": memory.peak_rss_bytes()}
    mine = torch.tensor([local[k] for k in keys], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=ctl_group)
    per_rank = {k: [float(t[i]) for t in everyone] for i, k in enumerate(keys)}
    kernel = per_rank["attention_kernel_seconds"]
    pipeline = _pipeline_record(per_rank, cfg, world) if cfg.pp > 1 else None
    straggler = pipeline["straggler_rank"] if pipeline else max(range(world), key=lambda r: kernel[r])
    step_s = max(per_rank["step_seconds"])
    mean_kernel = sum(kernel) / world
    record = {
        "step": step + 1, "backend": backend,
        "loss": sum(per_rank["loss_sum"]) / data.num_targets,
        "lr": local["lr"], "grad_norm": local["grad_norm"],
        "rows_served_remotely": (int(sum(per_rank["rows_served_remotely"])) if pipeline
                                 else local["rows_served_remotely"]),
        "plan_imbalance_estimated": local["plan_imbalance"],
        "plan_tolerance": local.get("plan_tolerance"),
        # cad_attention calls whose servers kept their Q/K/V for the backward, and those that did not
        # (the state budget: the same on every rank); None where the backward is planned apart (--pp).
        "stateful_layers": local.get("stateful_layers"), "stateless_layers": local.get("stateless_layers"),
        "step_seconds": step_s, "tokens_per_second": cfg.slices(world) * cfg.context / step_s,
        "straggler_rank": straggler,
        "attention_seconds": per_rank["attention_seconds"][straggler],
        "attention_kernel_max_seconds": max(kernel), "attention_kernel_min_seconds": min(kernel),
        "attention_imbalance": max(kernel) / mean_kernel if mean_kernel > 0 else 1.0,
        "plan_ms_max": 1e3 * max(per_rank["plan_seconds"]),
        "documents": len({key for pieces in data.pieces for key, *_ in pieces}),
        "documents_spanning_ranks": data.spanning_documents(),
        "memory": memory.record(per_rank),
        "per_rank": {k: v for k, v in per_rank.items() if k != "loss_sum"},
    }
    if pipeline:
        record["pipeline"] = pipeline
        record["ticks"] = local["ticks"]   # this rank's (rank 0's in the report)
    return record


def si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def step_line(r: dict, steps: int, elapsed: float, remaining: Optional[float]) -> str:
    eta = f"  [{elapsed:.0f}s, ~{remaining:.0f}s left]" if remaining is not None else f"  [{elapsed:.0f}s]"
    if "pipeline" in r:
        p = r["pipeline"]
        stages = ", ".join(f"stage {s['stage']} attn {s['attention_seconds']:.3f}s wait {s['wait_seconds']:.3f}s"
                           for s in p["stages"])
        return (f"step {r['step']:>4}/{steps} {r['backend']:<9} loss {r['loss']:.4f}  {si(r['tokens_per_second']):>6} "
                f"tok/s  {r['step_seconds']:.3f}s  straggler rank {p['straggler_rank']} "
                f"({p['straggler_busy_seconds']:.3f}s busy)  bubble {100 * p['bubble']:.0f}%  {stages}  plan "
                f"{r['plan_ms_max']:.1f} ms  {_memory(r)}{eta}")
    return (f"step {r['step']:>4}/{steps} {r['backend']:<9} loss {r['loss']:.4f}  {si(r['tokens_per_second']):>6} tok/s  "
            f"{r['step_seconds']:.3f}s  attn {r['attention_seconds']:.3f}s (rank {r['straggler_rank']}; kernels "
            f"{r['attention_kernel_min_seconds']:.3f}-{r['attention_kernel_max_seconds']:.3f}s, imbalance "
            f"{r['attention_imbalance']:.2f})  plan {r['plan_ms_max']:.1f} ms  {_memory(r)}{eta}")


def mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def _memory(r: dict) -> str:
    m = r["memory"]
    return f"mem {mib(m['max_bytes'])} (rank {m['fullest_rank']}, max/mean {m['max_over_mean']:.3f})"


def summarise(records: list, cfg: Config, first_step: int, wall: float) -> dict:
    skip = cfg.args.skip
    out: dict = {"backends": {}}
    for name in cfg.backends:
        rs = [r for r in records if r["backend"] == name]
        timed = [r for r in rs if r["step"] > first_step + skip] or rs
        k = max(1, min(10, len(rs) // 2))
        mean = lambda key: statistics.fmean(r[key] for r in timed)  # noqa: E731
        out["backends"][name] = {
            "step_seconds": mean("step_seconds"),
            "tokens_per_second": cfg.context * cfg.slices(len(timed[0]["per_rank"]["step_seconds"])) / mean("step_seconds"),
            "attention_seconds": mean("attention_seconds"), "attention_kernel_max_seconds": mean("attention_kernel_max_seconds"),
            "attention_imbalance": mean("attention_imbalance"), "plan_ms": mean("plan_ms_max"),
            "first_timed_step": timed[0]["step"], "timed_steps": len(timed), "loss_steps": k,
            "loss_first": statistics.fmean(r["loss"] for r in rs[:k]), "loss_last": statistics.fmean(r["loss"] for r in rs[-k:]),
        }
        out["backends"][name].update(memory.summary(rs))
        if cfg.pp > 1:
            out["backends"][name]["bubble"] = statistics.fmean(r["pipeline"]["bubble"] for r in timed)
            out["backends"][name]["wait_max_seconds"] = statistics.fmean(r["pipeline"]["wait_max_seconds"] for r in timed)
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
        out["memory_cad_over_colocated"] = b["cad"]["memory_max_bytes"] / b["colocated"]["memory_max_bytes"]
    else:
        out["speedup"] = out["speedup_median"] = out["loss_max_rel_diff"] = out["memory_cad_over_colocated"] = None
    out["rss_peak_bytes"] = [int(x) for x in records[-1]["per_rank"]["rss_peak_bytes"]] if records else []
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
    if cfg.pp > 1:
        say("pipeline: " + "; ".join(f"{name} bubble {100 * b['bubble']:.0f}% (the ranks' mean share of the step "
                                     f"spent waiting), longest wait {b['wait_max_seconds']:.3f} s"
                                     for name, b in s["backends"].items()))
    say(f"times: means over steps {any_b['first_timed_step']}..{any_b['first_timed_step'] + any_b['timed_steps'] - 1} "
        f"(--skip leaves out warm-up); step: the longest rank's; attn: the straggler's time inside cad_attention "
        f"(forward + backward, waiting included); kernels: the busiest rank's server-kernel seconds; imbalance: their "
        f"max/mean over ranks")
    say("memory: " + "; ".join(f"{name} fullest rank {mib(b['memory_max_bytes'])}, max/mean over ranks "
                                 f"{b['memory_max_over_mean']:.3f}" for name, b in s["backends"].items())
        + (f"; CAD {s['memory_cad_over_colocated']:.3f}x colocated" if s["memory_cad_over_colocated"] else "")
        + f" (parameters, gradients and optimizer state + the peak the autograd graph saves + static exchange "
          f"buffers; the process's peak RSS: {', '.join(mib(x) for x in s['rss_peak_bytes'])})")
    if s["speedup"] is not None:
        say(f"speedup of CAD over colocated (same run, same data): {s['speedup']:.2f}x (mean step times; median of "
            f"per-step ratios {s['speedup_median']:.2f}x); largest relative loss difference: {s['loss_max_rel_diff']:.2e}")
    say(f"wall time {s['wall_seconds']:.1f} s")


def write_json(path: str, doc: dict) -> None:
    """A new file renamed into place (distca's own writer: a device, FIFO or folder is refused)."""
    from distca import _distca
    _distca.write_file_atomic(path, json.dumps(doc, indent=1))


def write_report(a, cfg: Config, m: ModelArgs, world: int, device, steps_done: int, backends: list, records: list,
                  summary: dict) -> None:
    from ..parallel.ranks import RankMap
    write_json(a.json, {"format": "distca-torch-train", "version": 1,
                        "config": {"preset": a.preset, "backends": list(cfg.backends), "ranks": world,
                                   "rank_map": RankMap.of(world, tp=cfg.tp, pp=cfg.pp).to_dict(),
                                   "micro_batches": cfg.micro_batches,
                                   "device": device.type, "context": cfg.context, "steps": a.steps,
                                   "resumed_after": steps_done, "model": m.to_dict(), **cfg.data_identity,
                                   "policy": cfg.policy if "cad" in cfg.backends else None,
                                   "tolerance": cfg.tolerance, "granularity": cfg.granularity,
                                   "backward": cfg.backward, "kernel": backends[0].kernel.name,
                                   "lr": a.lr, "warmup": a.warmup, "weight_decay": a.weight_decay,
                                   "clip": a.clip, "skip": a.skip, "threads": torch.get_num_threads()},
                        "steps": records, "summary": summary})


def write_trace(path: str, tracer, rank: int, world: int, ctl_group, meta: dict) -> None:
    """Every rank's spans gathered to rank 0, which writes them as one Chrome trace-event file
    (distca.torch.trace); a file that cannot be written ends every rank with one line (exit 1)."""
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (tracer.origin_ns, tracer.events()), group=ctl_group)
    error = None
    if rank == 0:
        try:
            write_json(path, trace.chrome_trace(gathered, meta))
            say(f"trace: {path} ({sum(len(e) for _, e in gathered)} spans of {world} rank(s); "
                f"python -m distca.torch.trace_report {path} sums it)")
        except (OSError, ValueError) as e:
            error = f"--trace {path}: the trace could not be written ({e})"
    agree_on_error(error, ctl_group, RunError)
