"""distca.torch's server kernels side by side on one server's tasks: forward and backward of one
whole causal document, and of the same tokens as causal shards of `--shard` query rows (each with
its key prefix, as CAD's tasks are), for every backend that runs on the device.

GFLOP/s count causal pairs: forward 4 * D * Hq * L(L+1)/2, backward 2.5x that. Medians of
--repeats runs after one warm-up; CPU times with perf_counter, CUDA times with CUDA events. Checks
each backend against `reference` once before timing, on the same layout of --check-tokens tokens
(`reference` materialises the scores: Hq x L^2 floats, 32 GiB at 16K tokens and 32 heads), fp32
on CPU to 1e-4 relative. A backend that cannot run a shape (memory, a refused argument) is
reported as not timed, with the reason; the others still run.

    .venv/bin/python python/bench/bench_torch_kernels.py [--tokens 4096] [--shard 128] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from distca.torch.kernels.backends import backend_names, get_backend
from distca.torch.kernels.server import BackendUnavailable, causal_shards


def timed(device, fn):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shard", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-tokens", type=int, default=2048,
                        help="the correctness check's document, cut like the timed one (default 2048, at most --tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for name in ("tokens", "shard", "heads", "kv_heads", "head_dim", "repeats", "threads", "check_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        parser.error(f"--json {args.json}: not a file in an existing folder")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    n, hq, hkv, d = args.tokens, args.heads, args.kv_heads, args.head_dim
    flops = 4 * d * hq * n * (n + 1) / 2
    scale = d ** -0.5
    rows, unavailable = [], {}
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2

    def inputs(tokens, shard):
        tasks = causal_shards(tokens, shard, device)
        gen = torch.Generator().manual_seed(0)
        q, do = (torch.randn(tasks.num_q, hq, d, generator=gen).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(tasks.num_k, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
        return tasks, q, k, v, do

    for shard in (0, args.shard):
        # The check, on --check-tokens tokens cut the same way.
        tasks, q, k, v, do = inputs(min(args.check_tokens, n), shard)
        ref = get_backend("reference", device, dtype)
        want_o, want_lse = ref.forward(q, k, v, tasks, scale)
        want = ref.backward(do, q, k, v, want_o, want_lse, tasks, scale)
        errors = {}
        for name in backend_names()[1:]:
            try:
                kernel = get_backend(name, device, dtype)
                o, lse = kernel.forward(q, k, v, tasks, scale)
                got = kernel.backward(do, q, k, v, o, lse, tasks, scale)
            except BackendUnavailable as e:
                unavailable[name] = str(e)
                continue
            except (RuntimeError, TypeError, NotImplementedError) as e:   # memory, or a refused argument
                unavailable[f"{name} (check, shard {shard or None})"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                continue
            errors[name] = max((a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
                               for a, b in zip((o,) + tuple(got), (want_o,) + tuple(want)))
            if errors[name] > tolerance:
                print(f"bench_torch_kernels: {name} differs from reference by {errors[name]:.2e} "
                      f"({min(args.check_tokens, n)} tokens, shard {shard or None})", file=sys.stderr)
                return 1
        del q, k, v, do, want_o, want_lse, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # The timed shape.
        tasks, q, k, v, do = inputs(n, shard)
        for name, error in errors.items():
            kernel = get_backend(name, device, dtype)
            fwd, bwd = [], []
            try:
                for _ in range(args.repeats + 1):
                    (o, lse), tf = timed(device, lambda: kernel.forward(q, k, v, tasks, scale))
                    _, tb = timed(device, lambda: kernel.backward(do, q, k, v, o, lse, tasks, scale))
                    fwd.append(tf)
                    bwd.append(tb)
            except (RuntimeError, TypeError, NotImplementedError) as e:
                unavailable[f"{name} ({n} tokens, shard {shard or None})"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            f, b = float(np.median(fwd[1:])), float(np.median(bwd[1:]))
            rows.append({"backend": name, "shard": shard or None, "tasks": tasks.groups[0].num_tasks,
                         "fwd_seconds": f, "bwd_seconds": b, "fwd_gflops": flops / f / 1e9,
                         "bwd_gflops": 2.5 * flops / b / 1e9, "max_rel_error_vs_reference": error,
                         "checked_on_tokens": min(args.check_tokens, n),
                         "fwd_spread": [min(fwd[1:]), max(fwd[1:])], "bwd_spread": [min(bwd[1:]), max(bwd[1:])]})
        del q, k, v, do
    for name, why in unavailable.items():
        print(f"bench_torch_kernels: not timed: {name}: {why}", file=sys.stderr)
    print(f"{n} tokens (checked on {min(args.check_tokens, n)}), Hq {hq}, Hkv {hkv}, D {d}, {dtype}, {device}, {args.threads} thread(s); medians of {args.repeats}")
    print(f"{'backend':10s} {'tasks':>6s} {'fwd ms':>9s} {'GFLOP/s':>8s} {'bwd ms':>9s} {'GFLOP/s':>8s}")
    for r in rows:
        print(f"{r['backend']:10s} {r['tasks']:6d} {r['fwd_seconds'] * 1e3:9.1f} {r['fwd_gflops']:8.1f} "
              f"{r['bwd_seconds'] * 1e3:9.1f} {r['bwd_gflops']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"format": "distca-bench-torch-kernels", "version": 2, "tokens": n,
                       "check_tokens": min(args.check_tokens, n), "heads": hq,
                       "kv_heads": hkv, "head_dim": d, "dtype": str(dtype), "device": str(device),
                       "threads": args.threads, "flop_convention": "causal pairs x 4 D Hq; backward 2.5x",
                       "rows": rows, "unavailable": unavailable}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
