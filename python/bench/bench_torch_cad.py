#!/usr/bin/env python3
"""distca.torch end to end: what planning a step costs, and what CAD buys over colocated attention.

Part 1, planning + layout per step at 8, 64 and 512 ranks (one process simulating the group): the
shared reference batches (ProLong and WLB-LLM; 64 and 512 ranks as shipped, 8 ranks = the first 8
ranks of the 64-rank ones), policies minbytes and distca, model llama-8b. Per batch and policy,
medians over --repeats of
  plan wall   distca.plan(batch) timed with time.perf_counter (the batch is parsed beforehand)
  plan_ms     the C++ planner alone, as the plan reports it
  layout      distca.torch.rank_layout(...) for rank 0, and the largest over a few ranks (0, the
              busiest server, the server with the most tasks, the last rank): this rank's layout
              and device tensors, ping-pong off and on (on: the tasks split into two nano-batches)
beside the attention the step's planning precedes: the busiest server's core attention for one
step (max(plan.server_seconds): every layer of llama-8b, forward + backward), an ESTIMATE from the
built-in H200 profile, not a measurement; and the ratio (plan wall + layout max) / that estimate.
The gather of every rank's lengths over the group is not in Part 1 (one process); StepPlanner.plan
includes it in layout.plan_ms, reported in Part 2.

Part 2, one attention layer on 2 gloo processes (spawned), the C++ demo's skewed batch: Hq 4,
Hkv 1, D 64, fp32; rank 0 holds one document of --tokens (6144) tokens, rank 1 short documents
(lengths 2..tokens/8 drawn with a fixed seed, the last trimmed to fill the rank exactly). Variants,
all with the same server kernel (sdpa) and the same code path:
  colocated      StepPlanner(policy="none"): each rank attends its own documents
  cad            StepPlanner(policy="minbytes", pingpong=False)
  cad_pingpong   StepPlanner(policy="minbytes", pingpong=True)
Each step plans once per variant (outside the timed region; plan_ms and layout_ms reported beside),
then times forward + backward of cad_attention (o.backward(do)) from a barrier; a step's time is
the max over ranks (all_reduce MAX). Variants are interleaved within each step, their order
reversed every other step; 1 warm-up step, then --steps timed. Each rank's own wall time is
reported (the collectives make the fast rank wait, so both are close to the step), and so is its
server-kernel time (the sdpa kernel wrapped with a timer, its gathers included), which shows the
straggler; wall - kernel is the exchange, the layout's index work and the waiting. Before timing,
CAD's output and gradients are checked against colocated (max abs diff / max abs <= 1e-5; exit 1
if not). speedup = colocated median / CAD median, measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python python/bench/bench_torch_cad.py [--repeats 5] [--steps 10] [--json F]

A benchmark, not a test: it exits 0 whatever the timings (1 only when the correctness check fails).
The batches are $DISTCA_SHARED_DATA/reference/batch_*.json (default <repo>/../shared/data/reference).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distca  # noqa: E402
from distca.torch import StepPlanner, cad_attention, rank_layout, split_tasks  # noqa: E402
from distca.torch.kernels.backends import get_backend  # noqa: E402
from distca.torch.kernels.server import ServerKernel  # noqa: E402
from distca.torch.spawn import run_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAME = "bench_torch_cad"
FAMILIES = ["prolong", "wlbllm"]
RANKS = [8, 64, 512]
POLICIES = ["minbytes", "distca"]
PRICED_MODEL = "llama-8b"
LAYER_MODEL = {"heads": 4, "kv_heads": 1, "head_dim": 64}
VARIANTS = {  # name -> StepPlanner options (backend sdpa for all)
    "colocated": {"policy": "none", "pingpong": False},
    "cad": {"policy": "minbytes", "pingpong": False},
    "cad_pingpong": {"policy": "minbytes", "pingpong": True},
}
TOLERANCE = 1e-5
SEED = 0


def progress(message: str) -> None:
    print(f"{NAME}: {message}", file=sys.stderr, flush=True)


def shared_data() -> Path:
    return Path(distca.knobs.get("DISTCA_SHARED_DATA") or REPO.parent / "shared" / "data")


def median(xs: list) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------------------------------
# Part 1: planning + layout per step, one process simulating the group


def reference_batches() -> list[tuple[int, str, Any]]:
    """(ranks, family, Batch) for 8, 64 and 512 ranks of each family."""
    out = []
    for family in FAMILIES:
        paths = {r: shared_data() / "reference" / f"batch_{family}_r{r}.json" for r in (64, 512)}
        for path in paths.values():
            if not path.is_file():
                raise SystemExit(f"{NAME}: no batch {path} (set DISTCA_SHARED_DATA to the shared data folder)")
        first8 = json.loads(paths[64].read_text())["ranks"][:8]
        lengths = [n for rank in first8 for n in rank]
        pieces, doc = [], 0
        for r, rank in enumerate(first8):
            for n in rank:
                pieces.append((doc, 0, n, r))
                doc += 1
        batches = {8: distca.batch_from_pieces(lengths, np.asarray(pieces, dtype=np.int64)),
                   64: distca._distca.batch_from_file(str(paths[64]), 0),
                   512: distca._distca.batch_from_file(str(paths[512]), 0)}
        out += [(r, family, batches[r]) for r in RANKS]
    return sorted(out, key=lambda x: (x[0], FAMILIES.index(x[1])))


def sampled_ranks(plan: Any, num_ranks: int) -> list[int]:
    """Rank 0, the busiest server, the server with the most tasks, the last rank."""
    busiest = int(np.argmax(plan.server_seconds))
    most_tasks = int(np.argmax(np.bincount(plan.tasks["server"], minlength=num_ranks)))
    return sorted({0, busiest, most_tasks, num_ranks - 1})


def measure_planning(batch: Any, policy: str, repeats: int) -> list[dict]:
    rows = [tuple(int(x) for x in r) for r in np.asarray(batch.to_dict()["pieces"])]
    cpu = torch.device("cpu")
    plan = distca.plan(batch, policy=policy, model=PRICED_MODEL)  # warm-up (untimed)
    ranks = sampled_ranks(plan, batch.num_ranks)
    for pingpong in (False, True):
        rank_layout(plan, batch, rows, 0, cpu, pingpong=pingpong)
    del plan
    wall, plan_ms, split_ms, layout = [], [], [], {False: [], True: []}  # layout[pp]: per repeat, {rank: ms}
    tasks = attention = None
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        plan = distca.plan(batch, policy=policy, model=PRICED_MODEL)
        wall.append((time.perf_counter() - start) * 1e3)
        plan_ms.append(plan.plan_ms)
        tasks, attention = len(plan.tasks), float(np.max(plan.server_seconds))
        start = time.perf_counter()
        split_tasks(plan.tasks, batch, tolerance=plan.tolerance)  # what ping-pong adds to every rank's layout
        split_ms.append((time.perf_counter() - start) * 1e3)
        for pingpong in (False, True):
            per_rank = {}
            for r in ranks:
                gc.collect()
                per_rank[r] = rank_layout(plan, batch, rows, r, cpu, pingpong=pingpong).layout_ms
            layout[pingpong].append(per_rank)
        del plan
    out = []
    for pingpong in (False, True):
        rank0 = [d[0] for d in layout[pingpong]]
        worst = [max(d.values()) for d in layout[pingpong]]
        total = median([w + m for w, m in zip(wall, worst)])
        out.append({
            "ranks": batch.num_ranks, "documents": batch.num_docs, "policy": policy, "pingpong": pingpong,
            "tasks": tasks, "layout_ranks": ranks,
            "plan_wall_ms": wall, "plan_ms": plan_ms, "layout_rank0_ms": rank0, "layout_max_ms": worst,
            "layout_ms_by_rank": [{str(r): ms for r, ms in d.items()} for d in layout[pingpong]],
            "median_plan_wall_ms": median(wall), "median_plan_ms": median(plan_ms),
            "median_layout_rank0_ms": median(rank0), "median_layout_max_ms": median(worst),
            "median_total_ms": total,
            "split_ms": split_ms if pingpong else None, "median_split_ms": median(split_ms) if pingpong else None,
            "estimated_attention_s": attention,
            "ratio_to_estimated_attention": total / 1e3 / attention,
        })
    return out


def ranks_part(repeats: int) -> dict:
    rows = []
    # Each timing starts after a gc.collect(), so that no collection of earlier garbage lands in it.
    # What is alive now (PyTorch's modules, the batches) is frozen first: a collection then walks
    # only what the measurements allocate (about 1 ms) instead of the whole heap (165 ms here, 108
    # times: 18 s of a 30 s --quick part 1, 2026-11-28).
    gc.collect()
    gc.freeze()
    for num_ranks, family, batch in reference_batches():
        for policy in POLICIES:
            progress(f"part 1: {num_ranks} ranks, {family}, {policy} ({repeats} repeat(s))")
            for row in measure_planning(batch, policy, repeats):
                rows.append({"batch": family, **row})
    return {
        "model": PRICED_MODEL,
        "repeats": repeats,
        "note": "one process: the gather of lengths over the group is not included here "
                "(StepPlanner.plan includes it in layout.plan_ms: see the layer part)",
        "estimated_attention": "max(plan.server_seconds): the busiest server's core attention for one step, every "
                               "layer forward + backward, estimated from the built-in H200 profile (not measured)",
        "rows": rows,
    }


def print_ranks_part(part: dict) -> None:
    print(f"Part 1: planning + layout per step, one process simulating the group; model {part['model']}; "
          f"medians of {part['repeats']} in ms")
    print("  layout max: the largest of rank_layout over ranks 0, the busiest server, the server with the most "
          "tasks and the last rank")
    print("  est. attn: the busiest server's attention for one step (all layers, fwd+bwd), ESTIMATED on the "
          "H200 profile, not measured")
    print("  (split): split_tasks alone, timed apart: the two nano-batches of ping-pong, the same work on every rank, "
          "inside layout")
    print("  total: plan wall + layout max; not included: the gather of lengths over the group (one process here; included in layout.plan_ms "
          "in Part 2)")
    header = (f"{'ranks':>5} {'batch':<8} {'policy':<9} {'pp':<3} {'tasks':>6} {'plan wall':>9} {'plan_ms':>8} "
              f"{'layout r0':>9} {'layout max':>10} {'(split)':>8} {'total':>8} {'est. attn s':>11} {'total/attn':>10}")
    print(header)
    print("-" * len(header))
    for r in part["rows"]:
        print(f"{r['ranks']:>5} {r['batch']:<8} {r['policy']:<9} {'on' if r['pingpong'] else 'off':<3} "
              f"{r['tasks']:>6} {r['median_plan_wall_ms']:>9.2f} {r['median_plan_ms']:>8.2f} "
              f"{r['median_layout_rank0_ms']:>9.2f} {r['median_layout_max_ms']:>10.2f} "
              f"{'' if r['median_split_ms'] is None else format(r['median_split_ms'], '.2f'):>8} {r['median_total_ms']:>8.2f} "
              f"{r['estimated_attention_s']:>11.3f} {100 * r['ratio_to_estimated_attention']:>9.3f}%")


# ---------------------------------------------------------------------------------------------
# Part 2: one CAD layer vs one colocated layer on 2 gloo processes


class TimedKernel(ServerKernel):
    """A server kernel with a stopwatch: seconds spent in forward and backward (CPU: synchronous)."""

    def __init__(self, inner: ServerKernel):
        self.inner, self.name = inner, inner.name
        self.seconds = 0.0

    def unavailable(self, device, dtype):
        return self.inner.unavailable(device, dtype)

    def forward(self, *args):
        start = time.perf_counter()
        try:
            return self.inner.forward(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def backward(self, *args):
        start = time.perf_counter()
        try:
            return self.inner.backward(*args)
        finally:
            self.seconds += time.perf_counter() - start


def skewed_lengths(tokens: int, seed: int) -> list[list[int]]:
    """Rank 0: one document of `tokens`; rank 1: lengths 2..tokens/8 drawn with `seed`, the last
    trimmed so the rank holds exactly `tokens`."""
    rng = np.random.default_rng(seed)
    short, left = [], tokens
    while left > 0:
        n = min(int(rng.integers(2, max(2, tokens // 8) + 1)), left)
        short.append(n)
        left -= n
    return [[tokens], short]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def layer_worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank of Part 2 (runs in a spawned process): correctness once, then the timed steps."""
    lengths = skewed_lengths(cfg["tokens"], cfg["seed"])
    cu = np.concatenate([[0], np.cumsum(lengths[rank])]).tolist()
    rows = int(cu[-1])
    planners = {name: StepPlanner(model=LAYER_MODEL, backend="sdpa", **opts) for name, opts in VARIANTS.items()}
    kernel = TimedKernel(get_backend("sdpa", torch.device("cpu"), torch.float32))
    gen = torch.Generator().manual_seed(1000 + rank)
    hq, hkv, d = LAYER_MODEL["heads"], LAYER_MODEL["kv_heads"], LAYER_MODEL["head_dim"]
    q, do = (torch.randn(rows, hq, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(rows, hkv, d, generator=gen) for _ in range(2))

    def run(name: str, timed: bool) -> dict:
        layout = planners[name].plan(cu)
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        if timed:
            dist.barrier()
        kernel.seconds = 0.0
        start = time.perf_counter()
        o = cad_attention(qq, kk, vv, layout, backend=kernel)
        o.backward(do)
        wall = time.perf_counter() - start
        return {"wall": wall, "kernel": kernel.seconds, "plan_ms": layout.plan_ms, "layout_ms": layout.layout_ms,
                "outputs": (o.detach(), qq.grad, kk.grad, vv.grad), "pairs": layout.plan.server_pairs.tolist(),
                "tasks": len(layout.plan.tasks)}

    # Correctness: CAD (both variants) against colocated, output and every gradient.
    base = run("colocated", timed=False)
    errors = {}
    for name in ("cad", "cad_pingpong"):
        got = run(name, timed=False)
        errors[name] = {what: _rel(a, b) for what, a, b in zip(("o", "dq", "dk", "dv"), got["outputs"], base["outputs"])}
    flat = torch.tensor([e for name in ("cad", "cad_pingpong") for e in errors[name].values()], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    worst = iter(flat.tolist())
    errors = {name: {what: next(worst) for what in ("o", "dq", "dk", "dv")} for name in ("cad", "cad_pingpong")}

    # Timed steps: every variant per step, order reversed every other step.
    names = list(VARIANTS)
    record: dict = {name: {"step_s": [], "rank_wall_s": [], "rank_kernel_s": [], "plan_ms": [], "layout_ms": []}
                    for name in names}
    pairs, tasks = {}, {}
    for step in range(cfg["warmup"] + cfg["steps"]):
        for name in (names if step % 2 == 0 else names[::-1]):
            r = run(name, timed=True)
            mine = torch.tensor([r["wall"], r["kernel"], r["plan_ms"], r["layout_ms"]], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            step_s = torch.tensor([r["wall"]], dtype=torch.float64)
            dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
            pairs[name], tasks[name] = r["pairs"], r["tasks"]
            if step < cfg["warmup"]:
                continue
            rec = record[name]
            rec["step_s"].append(step_s.item())
            rec["rank_wall_s"].append([e[0].item() for e in every])
            rec["rank_kernel_s"].append([e[1].item() for e in every])
            rec["plan_ms"].append(max(e[2].item() for e in every))
            rec["layout_ms"].append(max(e[3].item() for e in every))
        if rank == 0:
            progress(f"part 2: step {step + 1}/{cfg['warmup'] + cfg['steps']}"
                     f"{' (warm-up)' if step < cfg['warmup'] else ''}")
    for name in names:
        record[name]["server_pairs"], record[name]["tasks"] = pairs[name], tasks[name]
    return {"lengths": lengths, "errors": errors, "variants": record}


def launch(world: int, cfg: dict, timeout: float) -> list[dict]:
    try:
        out = run_ranks(layer_worker, world, cfg, timeout=timeout)
    except TimeoutError as e:
        raise SystemExit(f"{NAME}: {e}")
    for r, o in enumerate(out):
        if o["error"]:
            raise SystemExit(f"{NAME}: rank {r} failed: {o['error']}")
    return [o["result"] for o in out]


def summarize_variant(rec: dict) -> dict:
    steps = rec["step_s"]
    walls = np.asarray(rec["rank_wall_s"])
    kernels = np.asarray(rec["rank_kernel_s"])
    rank_wall = [median(walls[:, r].tolist()) for r in range(walls.shape[1])]
    rank_kernel = [median(kernels[:, r].tolist()) for r in range(kernels.shape[1])]
    straggler = int(np.argmax(rank_kernel))
    return {
        **rec,
        "median_step_s": median(steps), "min_step_s": min(steps), "max_step_s": max(steps),
        "median_rank_wall_s": rank_wall, "median_rank_kernel_s": rank_kernel,
        "median_rank_other_s": [w - k for w, k in zip(rank_wall, rank_kernel)],
        "straggler_rank": straggler,
        "straggler_wall_s": rank_wall[straggler], "straggler_kernel_s": rank_kernel[straggler],
        "kernel_imbalance": max(rank_kernel) / (sum(rank_kernel) / len(rank_kernel)),
        "lower_bound_s": sum(rank_kernel) / len(rank_kernel),
        "median_plan_ms": median(rec["plan_ms"]), "median_layout_ms": median(rec["layout_ms"]),
    }


def layer_part(tokens: int, steps: int, warmup: int, timeout: float) -> dict:
    cfg = {"tokens": tokens, "steps": steps, "warmup": warmup, "seed": SEED}
    progress(f"part 2: spawning 2 gloo ranks ({tokens} tokens per rank, {warmup} warm-up + {steps} timed step(s) "
             f"of {len(VARIANTS)} variants)")
    results = launch(2, cfg, timeout)
    r0 = results[0]
    variants = {name: summarize_variant(rec) for name, rec in r0["variants"].items()}
    worst = max(e for errs in r0["errors"].values() for e in errs.values())
    return {
        "world": 2, "backend": "gloo", "kernel": "sdpa", "dtype": "float32", "model": LAYER_MODEL,
        "tokens_per_rank": tokens, "steps": steps, "warmup": warmup, "seed": SEED,
        "lengths": r0["lengths"],
        "timed": "forward + backward of cad_attention (o.backward(do)) from a barrier; step = max over ranks; "
                 "planning once per step per variant, outside the timed region",
        "kernel_time": "each rank's time inside the sdpa server kernel (its gathers included), timed by a wrapper",
        "correctness": {"ran": True, "tolerance": TOLERANCE, "max_rel": r0["errors"], "worst": worst,
                        "passed": worst <= TOLERANCE},
        "variants": variants,
        "speedup": variants["colocated"]["median_step_s"] / variants["cad"]["median_step_s"],
        "speedup_pingpong": variants["colocated"]["median_step_s"] / variants["cad_pingpong"]["median_step_s"],
    }


def print_layer_part(part: dict) -> None:
    m = part["model"]
    short = part["lengths"][1]
    print(f"Part 2: one attention layer, 2 gloo ranks, Hq {m['heads']} Hkv {m['kv_heads']} D {m['head_dim']} fp32, "
          f"sdpa kernel; rank 0: one document of {part['tokens_per_rank']}, rank 1: {len(short)} documents "
          f"({min(short)}..{max(short)} tokens)")
    c = part["correctness"]
    print(f"  correctness (CAD vs colocated, o and grads, max abs diff / max abs): worst {c['worst']:.2e} "
          f"<= {c['tolerance']:g}: {'ok' if c['passed'] else 'FAILED'}")
    print(f"  forward + backward, {part['steps']} timed step(s) after {part['warmup']} warm-up, variants "
          f"interleaved; seconds; step = max over ranks; kernel = time in the server kernel; "
          f"other = wall - kernel (exchange, index work, waiting)")
    header = (f"{'variant':<13} {'step med':>8} {'(min..max)':>15} {'r0 wall':>8} {'r1 wall':>8} {'r0 kern':>8} "
              f"{'r1 kern':>8} {'r0 other':>8} {'r1 other':>8} {'straggler':>14} {'kern imb':>8} {'bound':>6} "
              f"{'plan_ms':>7} {'layout_ms':>9} {'pairs r0/r1 (M)':>16}")
    print(header)
    print("-" * len(header))
    for name, v in part["variants"].items():
        w, k, o = v["median_rank_wall_s"], v["median_rank_kernel_s"], v["median_rank_other_s"]
        spread = f"({v['min_step_s']:.3f}..{v['max_step_s']:.3f})"
        strag = f"r{v['straggler_rank']} {v['straggler_wall_s']:.3f}/{v['straggler_kernel_s']:.3f}"
        pairs = "/".join(f"{p / 1e6:.1f}" for p in v["server_pairs"])
        print(f"{name:<13} {v['median_step_s']:>8.3f} {spread:>15} {w[0]:>8.3f} {w[1]:>8.3f} {k[0]:>8.3f} "
              f"{k[1]:>8.3f} {o[0]:>8.3f} {o[1]:>8.3f} {strag:>14} {v['kernel_imbalance']:>8.2f} "
              f"{v['lower_bound_s']:>6.3f} {v['median_plan_ms']:>7.2f} {v['median_layout_ms']:>9.2f} {pairs:>16}")
    print("  straggler: the rank with the most kernel time, its wall/kernel seconds; kern imb: max/mean kernel time; "
          "bound: mean kernel time (compute balanced, communication free); plan_ms includes the gather over the group")
    print(f"  speedup (colocated median / CAD median, same run): cad {part['speedup']:.2f}x, "
          f"cad_pingpong {part['speedup_pingpong']:.2f}x")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="distca.torch end to end: planning + layout per step at 8, 64 and 512 ranks (one process), "
                    "and one CAD attention layer vs a colocated one on 2 gloo processes (the skewed batch).")
    parser.add_argument("--repeats", type=int, default=5, help="Part 1: timed plans per batch and policy (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="Part 2: timed steps of every variant (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="Part 2: untimed steps first (default 1)")
    parser.add_argument("--tokens", type=int, default=None, help="Part 2: tokens per rank (default 6144; --quick 4608, the smallest "
                             "size around which minbytes still moves work and splits a key range)")
    parser.add_argument("--skip-ranks-part", action="store_true", help="skip Part 1 (planning at 8/64/512 ranks)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes for the tests: --repeats 1, --steps 2, --tokens 4608 unless given")
    parser.add_argument("--timeout", type=float, default=600, help="Part 2: seconds before the ranks are killed")
    parser.add_argument("--json", metavar="FILE", help="also write the full report (every measurement) here")
    args = parser.parse_args(argv)
    given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
    if args.quick:
        if "--repeats" not in given:
            args.repeats = 1
        if "--steps" not in given:
            args.steps = 2
    if args.tokens is None:
        args.tokens = 4608 if args.quick else 6144
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.tokens < 16:
        parser.error("--tokens must be at least 16")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder):
            print(f"{NAME}: --json {args.json}: {'is a folder' if os.path.isdir(args.json) else 'no folder ' + folder}; "
                  f"give a file in an existing folder", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    started = time.perf_counter()

    ranks = None if args.skip_ranks_part else ranks_part(args.repeats)
    layer = layer_part(args.tokens, args.steps, args.warmup, args.timeout)

    if ranks is not None:
        print_ranks_part(ranks)
        print()
    print_layer_part(layer)
    if args.json:
        report = {
            "benchmark": NAME,
            "quick": args.quick,
            "repeats": args.repeats,
            "steps": args.steps,
            "timer": "time.perf_counter; Part 1 in one process, Part 2 in 2 spawned gloo processes",
            "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                        "torch": torch.__version__, "distca": distca.__version__,
                        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}},
            "ranks_part": ranks,
            "layer_part": layer,
            "seconds": time.perf_counter() - started,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not layer["correctness"]["passed"]:
        print(f"{NAME}: CAD differs from colocated by {layer['correctness']['worst']:.2e} "
              f"(> {TOLERANCE:g}, max abs diff / max abs)", file=sys.stderr)
        return 1
    if ranks is not None:
        big = [r for r in ranks["rows"] if r["ranks"] == max(RANKS)]
        off = [r["median_total_ms"] for r in big if not r["pingpong"]]
        on = [r["median_total_ms"] for r in big if r["pingpong"]]
        share = max(r["ratio_to_estimated_attention"] for r in big)
        planning = (f"planning+layout at {max(RANKS)} ranks {min(off):.1f}-{max(off):.1f} ms "
                    f"({min(on):.1f}-{max(on):.1f} ms with ping-pong; <= {100 * share:.2f}% of the estimated "
                    f"H200 attention per step)")
    else:
        planning = "planning at 8/64/512 ranks skipped"
    print(f"{NAME}: CAD {layer['speedup']:.2f}x colocated (2 gloo ranks, skewed batch, {args.tokens} tokens per rank), "
          f"{planning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
