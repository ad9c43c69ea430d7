#!/usr/bin/env python3
"""Hugging Face transformers with CAD attention: a training step against HF's own sdpa and against
colocated attention with CAD's server kernel, on 2 gloo processes, in one run.

The batch is skewed: rank 0 holds one document of --tokens (16384) tokens, rank 1 short documents
of 2..tokens/8 tokens (a fixed seed, the last trimmed so the rank holds exactly --tokens), each
rank's row packed with position_ids restarting at 0 (TRL's padding-free form). The model is a
Llama built from a config (--layers 2, --hidden 256, --heads 4 over --kv-heads 2: head_dim 64,
vocab 512), fp32, one thread a rank, trained under DDP with AdamW. Variants, each its own copy of
the same initial weights:
  hf_sdpa     HF's sdpa attention, use_cache=False (its packed-sequence mask: right without a cache)
  colocated   apply_cad(model, policy="none"): every rank attends its own documents, with the server
              kernel CAD uses and the same code path (so what CAD adds is the balance, not a kernel)
  cad         apply_cad(model, policy=--policy (minlink)): the plan moves attention rows between ranks
A step is forward (the CAD plan included) + backward + AdamW, timed from a barrier to a barrier; its
time is the max over the ranks. Variants are interleaved within each step, their order reversed
every other step; --warmup (1) untimed steps first, then --steps (3) timed; medians reported, and
each rank's own forward and backward seconds beside. speedup = a baseline's median / cad's median,
measured in the same run. The variants' losses at every step are compared (max relative difference;
exit 1 above 1e-5: the variants must train the same model).

    OMP_NUM_THREADS=1 .venv/bin/python python/bench/bench_hf_cad.py [--tokens 16384] [--steps 3] [--json F]

A benchmark, not a test: exit 0 whatever the timings (1 when the losses differ, 2 for bad arguments).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distca.torch.spawn import run_ranks  # noqa: E402

NAME = "bench_hf_cad"
VARIANTS = ("hf_sdpa", "colocated", "cad")
TOLERANCE = 1e-5


def rank_documents(rank: int, tokens: int) -> list:
    if rank == 0:
        return [tokens]
    rng = np.random.default_rng(7)
    out, left = [], tokens
    while left > 0:
        n = min(int(rng.integers(2, max(2, tokens // 8) + 1)), left)
        out.append(n)
        left -= n
    return out


def worker(rank: int, world: int, a: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM
    from distca.torch.adapters.transformers import apply_cad, cad_state
    cfg = LlamaConfig(vocab_size=512, hidden_size=a["hidden"], intermediate_size=4 * a["hidden"],
                      num_hidden_layers=a["layers"], num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"],
                      max_position_embeddings=max(4096, a["tokens"]), use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    models, ddps, opts = {}, {}, {}
    for v in VARIANTS:
        m = LlamaForCausalLM(copy.deepcopy(cfg))   # a config of its own: apply_cad sets its attention
        m.load_state_dict(base.state_dict())
        m.train()
        if v != "hf_sdpa":
            apply_cad(m, policy="none" if v == "colocated" else a["policy"])
        models[v], ddps[v] = m, DDP(m)
        opts[v] = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-4, foreach=False)
    docs = rank_documents(rank, a["tokens"])
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 512, (1, a["tokens"]), generator=g)
    labels = ids.clone()
    at = 0
    for n in docs:
        labels[0, at] = -100
        at += n
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    times = {v: [] for v in VARIANTS}
    parts = {v: [] for v in VARIANTS}
    losses = {v: [] for v in VARIANTS}
    plan_ms = []
    for step in range(a["warmup"] + a["steps"]):
        order = VARIANTS if step % 2 == 0 else VARIANTS[::-1]
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = ddps[v](input_ids=ids, labels=labels, position_ids=positions).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opts[v].step()
            opts[v].zero_grad(set_to_none=True)
            dist.barrier()
            t3 = time.perf_counter()
            wall = torch.tensor([t3 - t0], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses[v].append(float(total) / world)
            if step >= a["warmup"]:
                times[v].append(float(wall))
                parts[v].append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_and_wait_s": t3 - t2})
                if v == "cad":
                    plan_ms.append(cad_state(models[v]).layout.plan_ms)
    cad = cad_state(models["cad"])
    layout = cad.layout
    report = layout.plan.report()
    out = {"documents": len(docs), "times": times, "parts": parts, "losses": losses, "plan_ms": plan_ms,
           "plans": cad.plans, "forwards": cad.forwards, "backend": layout.backend, "backend_note": layout.backend_note,
           "rows_served_remotely": sum(sum(n for j, n in enumerate(p.q_send_splits) if j != rank) for p in layout.parts),
           "plan_imbalance_before": float(report["load_before"]["imbalance"]),
           "plan_imbalance_after": float(report["load_after"]["imbalance"])}
    for v in ("colocated", "cad"):
        cad_state(models[v]).finish()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank (default 16384)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of every variant (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--policy", default="minlink", help="CAD's planner policy (default minlink)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the ranks are killed (default 3600)")
    p.add_argument("--json", metavar="FILE", help="also write the report here (a new file)")
    a = p.parse_args(argv)
    for name in ("tokens", "steps", "layers", "hidden", "heads", "kv_heads"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.warmup < 0 or a.tokens < 16:
        p.error("--warmup must be >= 0 and --tokens >= 16")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if a.json and (os.path.exists(a.json) or not os.path.isdir(os.path.dirname(os.path.abspath(a.json)))):
        p.error(f"--json {a.json}: {'exists' if os.path.exists(a.json) else 'no such folder'}")
    print(f"{NAME}: 2 gloo ranks, {a.tokens} tokens each (rank 0 one document, rank 1 short ones), Llama "
          f"{a.layers} layers hidden {a.hidden} heads {a.heads}/{a.kv_heads}; {a.warmup} warm-up + {a.steps} timed "
          f"steps of each of {', '.join(VARIANTS)}", flush=True)
    args = {k: getattr(a, k) for k in ("tokens", "steps", "warmup", "layers", "hidden", "heads", "kv_heads", "policy")}
    runs = run_ranks(worker, 2, args, timeout=a.timeout)
    for r, run in enumerate(runs):
        if run["error"] is not None:
            print(f"{NAME}: rank {r} failed: {run['error']}", file=sys.stderr)
            return 1
    res = [run["result"] for run in runs]
    times = res[0]["times"]
    median = {v: statistics.median(times[v]) for v in VARIANTS}
    loss_diff = max(abs(x - y) / abs(y) for v in ("colocated", "cad")
                    for x, y in zip(res[0]["losses"][v], res[0]["losses"]["hf_sdpa"]))
    report = {"format": "distca-bench-hf-cad", "args": args, "host": platform.node(), "cpu": platform.processor(),
              "torch": torch.__version__, "median_step_s": median,
              "speedup_over_hf_sdpa": median["hf_sdpa"] / median["cad"],
              "speedup_over_colocated": median["colocated"] / median["cad"],
              "loss_max_relative_difference": loss_diff, "ranks": res}
    for v in VARIANTS:
        per_rank = "; ".join(f"rank {r}: forward {statistics.median(x['forward_s'] for x in res[r]['parts'][v]):.2f} s, "
                             f"backward {statistics.median(x['backward_s'] for x in res[r]['parts'][v]):.2f} s"
                             for r in range(2))
        print(f"  {v:<10} step {median[v]:7.2f} s (median of {len(times[v])}; min {min(times[v]):.2f}, max "
              f"{max(times[v]):.2f})   {per_rank}")
    print(f"  CAD plan: attention imbalance {res[0]['plan_imbalance_before']:.2f} -> {res[0]['plan_imbalance_after']:.2f} "
          f"(planner's estimate), rows served remotely: rank 0 {res[0]['rows_served_remotely']}, rank 1 "
          f"{res[1]['rows_served_remotely']}; plan {statistics.median(res[0]['plan_ms']):.1f} ms; server kernel "
          f"{res[0]['backend']}{' (' + res[0]['backend_note'] + ')' if res[0]['backend_note'] else ''}")
    print(f"  speedup of CAD (same run): {report['speedup_over_hf_sdpa']:.2f}x over HF sdpa, "
          f"{report['speedup_over_colocated']:.2f}x over colocated with the same kernel; losses within "
          f"{loss_diff:.1e} of HF sdpa's")
    if a.json:
        with open(a.json, "x") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    if loss_diff > TOLERANCE:
        print(f"{NAME}: the variants' losses differ by {loss_diff:.2e} > {TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
