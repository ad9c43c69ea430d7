"""Ping-pong against one CAD exchange, on the ranks' real link: `python python/bench/bench_link_torch.py`.

Every step, on the same batch, the same inputs and the same server kernel, it times CAD attention
of --layers layers (forward, then backward, through one step layout: what a model's attention
does in a training step, without the linear layers) with two StepPlanners of one policy:
  sequential  pingpong=False: one nano-batch; every exchange waits for the compute before it
  pingpong    pingpong=True: the plan's tasks in two nano-batches (distca.torch.cad.nanobatch), every
              all-to-all posted asynchronously so one nano-batch's exchange runs during the other's
              compute; gloo runs collectives on its own threads, so it can overlap on CPU
interleaved (their order alternates step by step), each from a barrier, a step's seconds the
slowest rank's. Planning is outside the timed region. Before timing, both variants' outputs and
gradients are checked against each other (relative 1e-5; exit 1 if not).

Per variant it reports the step seconds (median over --steps after --warmup), the server-kernel
seconds (the busiest rank's: the attention compute an exchange can hide behind), and the bytes
sent to other ranks per step (distca.torch.exchange_bytes): the busier rank's (max_rank_bytes)
and each phase's busier sender's, summed over the phases (link_bytes: what one link direction
carries in turn while a sequential step waits); for ping-pong, the split's figures (cuts, K/V rows sent twice, level, each
nano-batch's busiest server against the whole plan's, and each nano-batch's bytes: the other's
compute can hide only its own). Rank 0 prints one JSON object on stdout,
progress on stderr. One process per rank, started by torchrun or by hand (torch.distributed's
env:// variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GLOO_SOCKET_IFNAME picks the
interface); scripts/bench-link-torch.sh runs it on two network-namespace hosts over a shaped link.

Workloads (per rank --tokens tokens; the same batch on every rank, new lengths each step for the
sampled ones): two-long (default; rank 0 one document of 3/4 of its tokens and one of 1/4, every
other rank four of 1/4: the planner moves part of rank 0's long document's attention to the
others, and ping-pong's split balances every server at no extra bytes), skewed (the C++ demo's:
rank 0 one whole document, the others short ones of 2..tokens/8: the split cannot balance rank
1's share of the long document within its byte budget, nanobatch.py), prolong and wlbllm
(documents drawn from the shared length samples, $DISTCA_SHARED_DATA or ../shared/data, packed
in order over the ranks).

A benchmark, not a test: exit 0 whatever the timings, 1 when the check fails, 2 on bad flags.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from distca import knobs
from distca.torch import StepPlanner, cad_attention, exchange_bytes
from distca.torch.cad.layout import PHASES
from distca.torch.kernels.backends import backend_names, get_backend
from distca.torch.train.trainer import TimedKernel

VARIANTS = ("sequential", "pingpong")
WORKLOADS = ("two-long", "skewed", "prolong", "wlbllm")
CHECK_TOLERANCE = 1e-5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_link_torch.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--layers", type=int, default=4, help="attention layers per step (default 4)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank (default 8192)")
    p.add_argument("--workload", choices=WORKLOADS, default="two-long", help="the batches (default two-long)")
    p.add_argument("--seed", type=int, default=1, help="the sampled workloads' seed (default 1)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=1, help="K/V heads (default 1)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="q/k/v dtype (default float32)")
    p.add_argument("--policy", default="minlink", help="the planner (default minlink)")
    p.add_argument("--kernel", choices=backend_names(), default="auto", help="the server kernel (default auto)")
    p.add_argument("--grad-return", choices=("fp32", "bf16"), default="fp32", help="dK/dV return dtype (default fp32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--timeout", type=float, default=300, help="collectives time out after this (default 300 s)")
    return p


def _checked(argv: Optional[list]) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    for name, lo, hi in (("steps", 1, 1000), ("warmup", 0, 100), ("layers", 1, 64), ("tokens", 64, 1 << 20),
                         ("heads", 1, 256), ("kv_heads", 1, 256), ("head_dim", 8, 512), ("threads", 1, 256)):
        value = getattr(a, name)
        if not lo <= value <= hi:
            p.error(f"--{name.replace('_', '-')} must be {lo}..{hi}, got {value}")
    if a.heads % a.kv_heads:
        p.error(f"--heads ({a.heads}) must be a multiple of --kv-heads ({a.kv_heads})")
    if a.tokens % 16:
        p.error(f"--tokens must be a multiple of 16, got {a.tokens}")
    return a


def say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[bench_link_torch {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _sample(workload: str) -> list:
    """The shared document-length sample: $DISTCA_SHARED_DATA, else ../shared/data from the
    working folder (the repository's root)."""
    folder = Path(knobs.get("DISTCA_SHARED_DATA") or Path.cwd().parent / "shared" / "data")
    path = folder / f"dist_{workload}.json"
    if not path.is_file():
        raise SystemExit(f"bench_link_torch: no {path} (set DISTCA_SHARED_DATA to the folder of dist_{workload}.json)")
    return json.loads(path.read_text())


def step_pieces(a: argparse.Namespace, step: int, world: int, sample: Optional[list]) -> list:
    """Every rank's pieces [(doc_key, begin, end, doc_length)] of one step (the same on every rank)."""
    t = a.tokens
    rng = np.random.default_rng([a.seed, step])
    if a.workload == "two-long":
        return [[(0, 0, 3 * t // 4, 3 * t // 4), (1, 0, t // 4, t // 4)]] + \
               [[(4 * r + i, 0, t // 4, t // 4) for i in range(4)] for r in range(1, world)]
    if a.workload == "skewed":
        ranks, key = [[(0, 0, t, t)]], 1
        for _ in range(1, world):
            mine, left = [], t
            while left:
                n = min(left, int(rng.integers(2, max(3, t // 8))))
                mine.append((key, 0, n, n))
                key, left = key + 1, left - n
            ranks.append(mine)
        return ranks
    assert sample is not None
    lengths, total = [], 0
    while total < world * t:
        n = min(int(rng.choice(sample)), world * t - total)
        lengths.append(n)
        total += n
    ranks = [[] for _ in range(world)]
    at = 0
    for key, n in enumerate(lengths):
        begin = 0
        while begin < n:
            rank, offset = divmod(at, t)
            take = min(n - begin, t - offset)
            ranks[rank].append((key, begin, begin + take, n))
            begin, at = begin + take, at + take
    return ranks


def _run(layout, inputs: list, kernel) -> tuple:
    """Every layer's forward, then the backward of all: -> (outputs, gradients)."""
    leaves = [[x.detach().clone().requires_grad_() for x in layer[:3]] for layer in inputs]
    outs = [cad_attention(q, k, v, layout, backend=kernel) for q, k, v in leaves]
    torch.autograd.backward(outs, [layer[3] for layer in inputs])
    return [o.detach() for o in outs], [[x.grad for x in layer] for layer in leaves]


def _relative(a: list, b: list) -> float:
    num = max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))
    den = max(float(y.double().abs().max()) for y in b)
    return num / max(den, 1e-30)


def main(argv: Optional[list] = None) -> int:
    try:
        a = _checked(argv)
    except SystemExit as e:
        return int(e.code or 0)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    dtype = getattr(torch, a.dtype)
    model = {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}
    cost_model = {**model, "layers": a.layers, "hidden": a.heads * a.head_dim, "ffn_hidden": 4 * a.heads * a.head_dim,
                  "dtype_bytes": torch.empty((), dtype=dtype).element_size()}
    planners = {v: StepPlanner(model=model, cost_model=cost_model, policy=a.policy, pingpong=v == "pingpong",
                               grad_return=a.grad_return, backend=a.kernel) for v in VARIANTS}
    kernel = TimedKernel(get_backend(a.kernel, torch.device("cpu"), dtype, head_dim=a.head_dim), torch.device("cpu"))
    sample = _sample(a.workload) if a.workload in ("prolong", "wlbllm") else None
    say(rank, f"{world} ranks, {a.workload} x {a.tokens} tokens per rank, {a.layers} layers, kernel {kernel.name}, "
              f"{a.warmup} + {a.steps} steps")
    records: dict = {v: [] for v in VARIANTS}
    check = None
    for step in range(a.warmup + a.steps):
        pieces = step_pieces(a, step, world, sample)[rank]
        layouts = {v: planners[v].plan(pieces=pieces) for v in VARIANTS}
        gen = torch.Generator().manual_seed(7919 * step + rank)
        rows = layouts["sequential"].num_local_rows
        inputs = [[torch.randn(rows, h, a.head_dim, generator=gen).to(dtype)
                   for h in (a.heads, a.kv_heads, a.kv_heads, a.heads)] for _ in range(a.layers)]
        if check is None:   # correctness once, before any timing
            (o_s, g_s), (o_p, g_p) = (_run(layouts[v], inputs, kernel) for v in VARIANTS)
            worst = torch.tensor([_relative(o_p + [g for layer in g_p for g in layer],
                                            o_s + [g for layer in g_s for g in layer])])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=control)
            check = float(worst)
            limit = CHECK_TOLERANCE if dtype == torch.float32 else 2.0 ** -6
            if check > limit:
                say(rank, f"check FAILED: ping-pong against sequential, relative {check:.3g} > {limit:g}")
                dist.destroy_process_group()
                return 1
        order = VARIANTS if step % 2 == 0 else VARIANTS[::-1]
        for v in order:
            kernel.seconds = 0.0
            dist.barrier(group=control)
            start = time.perf_counter()
            _run(layouts[v], inputs, kernel)
            seconds = time.perf_counter() - start
            sent = exchange_bytes(layouts[v], dtype)
            stats = torch.tensor([seconds, kernel.seconds, float(sent["total"])] + [float(sent[x]) for x in PHASES],
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=control)
            if step >= a.warmup:
                # link_bytes: each phase's busier sender, phase after phase (the sequential step
                # waits for every phase), what a link of one rate per direction must carry in turn.
                record = {"step": step, "seconds": float(stats[0]), "kernel_seconds": float(stats[1]),
                          "max_rank_bytes": int(stats[2]) * a.layers, "link_bytes": int(stats[3:].sum()) * a.layers}
                if len(layouts[v].parts) > 1:
                    # Each nano-batch's share of the bytes: what its exchanges can hide behind the
                    # other's compute (the busier sender's, per phase, summed; max over ranks).
                    per_part = [exchange_bytes(replace(layouts[v], parts=[p]), dtype) for p in layouts[v].parts]
                    shares = torch.tensor([[float(b[x]) for x in PHASES] for b in per_part], dtype=torch.float64)
                    dist.all_reduce(shares, op=dist.ReduceOp.MAX, group=control)
                    record["part_bytes"] = [int(x) * a.layers for x in shares.sum(dim=1).tolist()]
                split = layouts[v].split
                if split is not None:
                    whole = float(layouts[v].plan.server_pairs.max())
                    record.update(nano_batches=len(layouts[v].parts), cuts=split.num_cuts,
                                  extra_kv_rows=split.extra_kv_rows, remote_kv_rows=split.remote_kv_rows,
                                  level_over_cap=split.level / split.cap if split.cap else 1.0,
                                  stages_over_whole=sum(split.busiest) / whole if whole else 1.0)
                records[v].append(record)
        if step >= a.warmup:
            last = {v: records[v][-1] for v in VARIANTS}
            say(rank, f"step {step - a.warmup + 1}/{a.steps}: " + ", ".join(
                f"{v} {last[v]['seconds']:.3f} s (kernels {last[v]['kernel_seconds']:.3f} s)" for v in VARIANTS))
    if rank == 0:
        out: dict[str, Any] = {"benchmark": "bench_link_torch", "ranks": world, "workload": a.workload,
                               "tokens_per_rank": a.tokens, "layers": a.layers, "steps": a.steps,
                               "model": model, "dtype": a.dtype, "policy": a.policy, "kernel": kernel.name,
                               "grad_return": a.grad_return, "threads": a.threads, "check_relative": check,
                               "host": os.uname().nodename, "variants": {}}
        for v in VARIANTS:
            rs = records[v]
            summary = {key: statistics.median(r[key] for r in rs) for key in ("seconds", "kernel_seconds")}
            for key in ("max_rank_bytes", "link_bytes"):
                summary[key] = statistics.median(r[key] for r in rs)
            for key in ("level_over_cap", "stages_over_whole", "extra_kv_rows", "remote_kv_rows", "cuts"):
                if key in rs[0]:
                    summary[key] = statistics.median(r[key] for r in rs)
            if "part_bytes" in rs[0]:
                summary["part_bytes"] = [statistics.median(r["part_bytes"][i] for r in rs) for i in range(2)]
            out["variants"][v] = {"median": summary, "steps": rs}
        out["pingpong_over_sequential"] = (out["variants"]["pingpong"]["median"]["seconds"]
                                           / out["variants"]["sequential"]["median"]["seconds"])
        print(json.dumps(out), flush=True)
    dist.barrier(group=control)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
