"""distca's CPU attention kernels beside PyTorch's on one server's tasks, in one process and one run:
distca.torch's backends `reference`, `sdpa` and `distca` (the C++ kernels through the native
module), the `distca` kernels on shards that share the document's K/V (`distca-shared`, what the
C++ kernel allows and distca.torch's server layout does not), and the C++ CLI's `distca bench
attention` for the same shapes (a subprocess, its JSON parsed).

Shapes: whole causal documents of --tokens (4K and 16K) and the same documents as causal shards of
--shard (128) query rows, each with its key prefix (distca.torch's server layout: every task its
own key rows); head dims --head-dims (64, 128), GQA --heads:--kv-heads (4:1); --threads (1 and 2).

GFLOP/s: causal (query, key) pairs x 4 D Hq for the forward (QK^T and PV, a multiply-add counting
2); the backward counted as 2.5x the forward (FlashAttention's convention), whatever a kernel
recomputes. Times: medians of --repeats runs with the min..max spread, backends interleaved within
each repeat so that load on the machine falls on all of them alike; one warm-up first where the
document has at most --warmup-max tokens (above, the first repeat also serves as the correctness
run; the spread includes it). The CLI reports the best of its repeats (its own convention), not a
median. Correctness before timing: every backend against `reference` up to --reference-max tokens
(`reference` is timed there too, slow), above it against sdpa; fp32 relative 1e-4.

The build of distca's kernels: --isa (or DISTCA_CPU_ISA), default the fastest this CPU runs. To
measure an AVX2 machine's case on an AVX-512 one, hold PyTorch to AVX2 as well
(ATEN_CPU_CAPABILITY=avx2, and MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 for the libraries
it calls); the header and the JSON name both sides' instruction sets.

    .venv/bin/python python/bench/bench_cpu_kernels.py [--quick] [--isa avx2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from distca import _distca
from distca.torch.kernels.backends import get_backend
from distca.torch.kernels.native import DistcaKernel
from distca.torch.kernels.server import causal_shards

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("reference", "sdpa", "distca", "distca-shared")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def shared_task_array(n: int, shard: int) -> np.ndarray:
    """Shards of `shard` queries of one n-token document, all reading its one copy of K/V."""
    starts = np.arange(0, n, shard, dtype=np.int64)
    ends = np.minimum(starts + shard, n)
    return np.stack([starts, ends - starts, np.zeros_like(starts), ends, np.ones_like(starts)], axis=1)


def prefix_rows(n: int, shard: int) -> torch.Tensor:
    """The document rows of causal_shards(n, shard)'s key rows: each shard's prefix [0, end)."""
    ends = np.minimum(np.arange(shard, n + shard, shard), n)
    return torch.from_numpy(np.concatenate([np.arange(e) for e in ends]))


def max_rel(got, want) -> float:
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
               for g, w in zip(got, want))


class Case:
    """One (D, tokens, layout) problem's inputs and the callables of each backend on it."""

    def __init__(self, n: int, shard: int, hq: int, hkv: int, d: int, seed: int):
        self.n, self.shard, self.d = n, shard, d
        self.tasks = causal_shards(n, shard, torch.device("cpu"))
        gen = torch.Generator().manual_seed(seed)
        self.q, self.do = (torch.randn(self.tasks.num_q, hq, d, generator=gen) for _ in range(2))
        # Key rows: each task's own prefix (distca.torch's layout); for `distca-shared`, the
        # document's n rows, which every shard's prefix copies.
        doc_k, doc_v = (torch.randn(n, hkv, d, generator=gen) for _ in range(2))
        self.key_rows = prefix_rows(n, shard) if shard else None
        if self.key_rows is not None:
            self.k, self.v = doc_k.index_select(0, self.key_rows), doc_v.index_select(0, self.key_rows)
        else:
            self.k, self.v = doc_k, doc_v
        self.doc_k, self.doc_v = doc_k, doc_v
        self.shared = shared_task_array(n, shard or n)
        self.scale = d ** -0.5
        self.pairs = int(_distca.attention_pairs(DistcaKernel.task_array(self.tasks)))
        assert self.pairs == n * (n + 1) // 2
        self.fwd_flops = 4.0 * d * hq * self.pairs

    def run(self, backend: str, threads: int, kernels: dict):
        """(forward, backward) callables of `backend` on this case; the backward uses the forward's last output."""
        state: dict = {}
        if backend == "distca-shared":
            kern = kernels["distca", threads]

            def fwd():
                state["o"] = kern.forward_tasks(self.q, self.doc_k, self.doc_v, self.shared, self.scale)
                return state["o"]

            def bwd():
                o, lse = state["o"]
                return kern.backward_tasks(self.do, self.q, self.doc_k, self.doc_v, o, lse, self.shared, self.scale)
        else:
            kern = kernels[backend, threads]

            def fwd():
                state["o"] = kern.forward(self.q, self.k, self.v, self.tasks, self.scale)
                return state["o"]

            def bwd():
                o, lse = state["o"]
                return kern.backward(self.do, self.q, self.k, self.v, o, lse, self.tasks, self.scale)
        return fwd, bwd


def comparable(case: Case, backend: str, out) -> tuple:
    """(o, dq, dk, dv) with dk/dv on the per-task key rows (the shared layout's summed per document
    row, so compared through the per-task layout's sum)."""
    (o, _), (dq, dk, dv) = out
    if backend == "distca-shared":
        return o, dq, dk, dv
    if case.key_rows is not None:   # fold per-task key rows back onto document rows
        dk = torch.zeros(case.n, *dk.shape[1:]).index_add_(0, case.key_rows, dk)
        dv = torch.zeros(case.n, *dv.shape[1:]).index_add_(0, case.key_rows, dv)
    return o, dq, dk, dv


def run_cli(cli: str, n: int, shard: int, hq: int, hkv: int, d: int, threads: int, repeats: int,
            docs: list[int]) -> dict:
    cmd = [cli, "bench", "attention", "--docs", ",".join(map(str, docs)), "--shard-doc", str(n), "--shards",
           str(shard), "--head-dim", str(d), "--heads", str(hq), "--kv-heads", str(hkv), "--threads", str(threads),
           "--repeats", str(repeats), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=ints, default=None, help="document lengths (default 4096,16384)")
    parser.add_argument("--shard", type=int, default=128, help="query rows per shard")
    parser.add_argument("--head-dims", type=ints, default=None, help="default 64,128")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--threads", type=ints, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=None, help="default 3")
    parser.add_argument("--reference-max", type=int, default=4096, help="time `reference` up to this many tokens")
    parser.add_argument("--warmup-max", type=int, default=4096, help="a warm-up run up to this many tokens")
    parser.add_argument("--cli", default=None, help="the distca binary (default: build/src/tools/distca or PATH)")
    parser.add_argument("--no-cli", action="store_true", help="skip the C++ CLI's numbers")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: --tokens 256,640 --head-dims 64 --repeats 2 unless given")
    parser.add_argument("--isa", default=None,
                        help="the build of distca's kernels (sets DISTCA_CPU_ISA): one of " +
                        ", ".join(_distca.cpu_isas_supported()) + " here (default: the fastest)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.isa is not None:
        if args.isa not in _distca.cpu_isas_supported():
            parser.error(f"--isa {args.isa}: this CPU runs {', '.join(_distca.cpu_isas_supported())}")
        os.environ["DISTCA_CPU_ISA"] = args.isa   # the native objects and the CLI subprocess read it
    try:
        isa = _distca.cpu_isa()
    except ValueError as e:
        parser.error(str(e))
    torch_isa = torch.backends.cpu.get_cpu_capability()
    for name, full, quick in (("tokens", [4096, 16384], [256, 640]), ("head_dims", [64, 128], [64]),
                              ("repeats", 3, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        parser.error(f"--json {args.json}: not a file in an existing folder")
    for name in ("shard", "heads", "kv_heads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.tokens or min(args.tokens) < 1 or not args.threads or min(args.threads) < 1:
        parser.error("--tokens and --threads need positive values")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    bad = [d for d in args.head_dims if d not in DistcaKernel.HEAD_DIMS]
    if bad or not args.head_dims:
        parser.error(f"--head-dims: the kernels are built for {DistcaKernel.HEAD_DIMS}, got {args.head_dims}")
    cli = None
    if not args.no_cli:
        cli = args.cli or next((str(p) for p in (REPO / "build" / "src" / "tools" / "distca",) if p.is_file()),
                               None) or shutil.which("distca")
        if cli is None:
            parser.error("no distca binary (cmake --build build); pass --cli PATH or --no-cli")

    hq, hkv = args.heads, args.kv_heads
    started = time.perf_counter()
    progress = lambda line: print(f"[bench_cpu_kernels {time.perf_counter() - started:6.1f} s] {line}",  # noqa: E731
                                  file=sys.stderr, flush=True)
    kernels: dict = {}
    for t in args.threads:
        kernels["reference", t] = get_backend("reference", torch.device("cpu"), torch.float32)
        kernels["sdpa", t] = get_backend("sdpa", torch.device("cpu"), torch.float32)
        kernels["distca", t] = DistcaKernel(num_threads=t)
    rows, checks = [], []
    for d in args.head_dims:
        for n in args.tokens:
            for shard in (0, args.shard):
                if shard >= n:
                    continue
                case = Case(n, shard, hq, hkv, d, seed=d * 7 + n)
                layout = f"shards of {shard}" if shard else "whole"
                names = [b for b in BACKENDS if b != "reference" or n <= args.reference_max]
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    times: dict = {b: ([], []) for b in names}
                    outputs: dict = {}
                    calls = {b: case.run(b, threads, kernels) for b in names}
                    if n <= args.warmup_max:   # a warm-up, which is also the correctness run
                        for b in names:
                            fwd, bwd = calls[b]
                            outputs[b] = (fwd(), bwd())
                    for r in range(args.repeats):
                        for b in names:
                            fwd, bwd = calls[b]
                            t0 = time.perf_counter()
                            fo = fwd()
                            t1 = time.perf_counter()
                            bo = bwd()
                            t2 = time.perf_counter()
                            times[b][0].append(t1 - t0)
                            times[b][1].append(t2 - t1)
                            outputs.setdefault(b, (fo, bo))
                    base = "reference" if "reference" in names else "sdpa"
                    want = comparable(case, base, outputs[base])
                    for b in names:
                        if b == base:
                            continue
                        err = max_rel(comparable(case, b, outputs[b]), want)
                        checks.append({"head_dim": d, "tokens": n, "layout": layout, "threads": threads, "backend": b,
                                       "against": base, "max_rel_error": err})
                        if err > 1e-4:
                            print(f"bench_cpu_kernels: {b} differs from {base} by {err:.2e} (D {d}, {n} tokens, "
                                  f"{layout}, {threads} threads)", file=sys.stderr)
                            return 1
                    outputs.clear()
                    for b in names:
                        f, bw = (np.asarray(x) for x in times[b])
                        ff, bf = case.fwd_flops, 2.5 * case.fwd_flops
                        row = {"head_dim": d, "tokens": n, "layout": layout, "shard": shard or None, "threads": threads,
                               "backend": b, "tasks": int(case.shared.shape[0]),
                               "fwd_seconds": float(np.median(f)), "bwd_seconds": float(np.median(bw)),
                               "fwd_gflops": ff / float(np.median(f)) / 1e9, "bwd_gflops": bf / float(np.median(bw)) / 1e9,
                               "fwd_gflops_spread": [ff / f.max() / 1e9, ff / f.min() / 1e9],
                               "bwd_gflops_spread": [bf / bw.max() / 1e9, bf / bw.min() / 1e9], "repeats": len(f)}
                        rows.append(row)
                        progress(f"D {d} {n:6d} {layout:13s} {threads}t {b:13s} fwd {row['fwd_gflops']:7.1f} "
                                 f"bwd {row['bwd_gflops']:7.1f} GFLOP/s")
                del case
    # The C++ CLI on the same shapes: per D and thread count of its all-threads runs (it also runs 1 thread).
    cli_reports = []
    if cli:
        for d in args.head_dims:
            for n in args.tokens:
                if args.shard >= n:
                    continue
                all_threads = max(args.threads)
                progress(f"distca bench attention: D {d}, {n} tokens, shards of {args.shard}, threads 1 and {all_threads}")
                report = run_cli(cli, n, args.shard, hq, hkv, d, all_threads, args.repeats, [n])
                cli_reports.append({"head_dim": d, "tokens": n, "report": report})
                for x in report["results"]:
                    if x["impl"] != "fused" or x["threads"] not in args.threads or x["tokens"] != n:
                        continue
                    layout = "whole" if x["shard"] == 0 else f"shards of {x['shard']}"
                    key = (d, n, layout, x["threads"])
                    row = next((r for r in rows if r["backend"] == "cli" and
                                (r["head_dim"], r["tokens"], r["layout"], r["threads"]) == key), None)
                    if row is None:
                        row = {"head_dim": d, "tokens": n, "layout": layout, "shard": x["shard"] or None,
                               "threads": x["threads"], "backend": "cli", "statistic": "best of repeats"}
                        rows.append(row)
                    row[f"{x['pass']}_seconds"] = x["seconds"]
                    row[f"{x['pass']}_gflops"] = x["gflops"]

    def get(d, n, layout, t, b, key):
        r = next((r for r in rows if (r["head_dim"], r["tokens"], r["layout"], r["threads"], r["backend"]) ==
                  (d, n, layout, t, b)), None)
        return None if r is None else r.get(key)

    ratios = []
    for d in args.head_dims:
        for n in args.tokens:
            for layout in ("whole", f"shards of {args.shard}"):
                for t in args.threads:
                    s = (get(d, n, layout, t, "sdpa", "fwd_gflops"), get(d, n, layout, t, "sdpa", "bwd_gflops"))
                    g = (get(d, n, layout, t, "distca", "fwd_gflops"), get(d, n, layout, t, "distca", "bwd_gflops"))
                    if None in s or None in g:
                        continue
                    entry = {"head_dim": d, "tokens": n, "layout": layout, "threads": t,
                             "distca_over_sdpa_fwd": g[0] / s[0], "distca_over_sdpa_bwd": g[1] / s[1]}
                    if layout != "whole":
                        # The shards share the document's K/V (`distca-shared`); in
                        # distca.torch's server layout (`distca`) each has its own key prefix.
                        w = (get(d, n, "whole", t, "distca", "fwd_gflops"), get(d, n, "whole", t, "distca", "bwd_gflops"))
                        sh = (get(d, n, layout, t, "distca-shared", "fwd_gflops"),
                              get(d, n, layout, t, "distca-shared", "bwd_gflops"))
                        if None not in w and None not in sh:
                            entry["shared_shards_over_whole_fwd"] = sh[0] / w[0]
                            entry["shared_shards_over_whole_bwd"] = sh[1] / w[1]
                        if None not in w:
                            entry["server_layout_shards_over_whole_fwd"] = g[0] / w[0]
                            entry["server_layout_shards_over_whole_bwd"] = g[1] / w[1]
                    ratios.append(entry)

    names = [b for b in BACKENDS + ("cli",) if any(r["backend"] == b for r in rows)]
    print(f"CPU attention, Hq {hq}, Hkv {hkv}, fp32, {os.cpu_count()} CPUs, distca kernels "
          f"{kernels['distca', args.threads[0]].native().isa}, PyTorch {torch.__version__} CPU capability {torch_isa}; "
          f"GFLOP/s fwd/bwd, medians of {args.repeats} "
          f"(cli: best of {args.repeats}); causal pairs x 4 D Hq, backward 2.5x")
    head = f"{'D':>4s} {'tokens':>6s} {'layout':13s} {'thr':>3s} " + " ".join(f"{b:>15s}" for b in names) + \
        f" {'distca/sdpa':>12s}"
    print(head)
    for d in args.head_dims:
        for n in args.tokens:
            for layout in ("whole", f"shards of {args.shard}"):
                for t in args.threads:
                    cells = []
                    for b in names:
                        f, bw = get(d, n, layout, t, b, "fwd_gflops"), get(d, n, layout, t, b, "bwd_gflops")
                        cells.append(f"{'-' if f is None else f'{f:.0f}':>7s}/{'-' if bw is None else f'{bw:.0f}':<7s}")
                    if all(c.strip() == "-/-" for c in cells):
                        continue
                    ratio = next((r for r in ratios if (r["head_dim"], r["tokens"], r["layout"], r["threads"]) ==
                                  (d, n, layout, t)), None)
                    rtext = "-" if ratio is None else \
                        f"{ratio['distca_over_sdpa_fwd']:.2f}/{ratio['distca_over_sdpa_bwd']:.2f}"
                    print(f"{d:4d} {n:6d} {layout:13s} {t:3d} " + " ".join(f"{c:>15s}" for c in cells) + f" {rtext:>12s}")
    spread = {}
    for b in BACKENDS:
        mine = [r for r in rows if r["backend"] == b]
        if mine:
            spread[b] = max(max((r[f"{p}_gflops_spread"][1] - r[f"{p}_gflops_spread"][0]) / r[f"{p}_gflops"]
                                for p in ("fwd", "bwd")) for r in mine)
    print("largest spread (max - min) / median over the repeats: " +
          ", ".join(f"{b} {v * 100:.0f}%" for b, v in spread.items()))
    if ratios:
        worst_f = min(ratios, key=lambda r: r["distca_over_sdpa_fwd"])
        worst_b = min(ratios, key=lambda r: r["distca_over_sdpa_bwd"])
        line = (f"distca over sdpa: forward {worst_f['distca_over_sdpa_fwd']:.2f}x at worst (target 1.1x), backward "
                f"{worst_b['distca_over_sdpa_bwd']:.2f}x at worst (target 1.0x)")
        for key, what in (("shared", "shards sharing the document's K/V over whole documents"),
                          ("server_layout", "shards in the server layout (own key prefixes) over whole documents")):
            sh = [r for r in ratios if f"{key}_shards_over_whole_fwd" in r]
            if sh:
                line += (f"; {what}: forward {min(r[f'{key}_shards_over_whole_fwd'] for r in sh):.2f}x, backward "
                         f"{min(r[f'{key}_shards_over_whole_bwd'] for r in sh):.2f}x at worst" +
                         (" (target 0.9x)" if key == "shared" else " (no target)"))
        print(line)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"format": "distca-bench-cpu-kernels", "version": 1, "quick": args.quick,
                       "heads": hq, "kv_heads": hkv, "dtype": "float32", "cpus": os.cpu_count(),
                       "isa": kernels["distca", args.threads[0]].native().isa, "torch": torch.__version__,
                       "torch_cpu_capability": torch_isa,
                       "env": {k: os.environ[k] for k in ("DISTCA_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                          "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE") if k in os.environ},
                       "repeats": args.repeats, "threads": args.threads, "tokens": args.tokens,
                       "head_dims": args.head_dims, "shard": args.shard,
                       "flop_convention": "causal (query, key) pairs x 4 D Hq forward; backward 2.5x forward",
                       "statistic": "median of repeats with [min, max] GFLOP/s; cli rows: best of repeats",
                       "rows": rows, "ratios": ratios, "checks": checks, "spread": spread,
                       "cli": cli_reports, "seconds": time.perf_counter() - started}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
