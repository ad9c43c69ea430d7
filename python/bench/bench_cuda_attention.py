"""distca's CUDA attention kernels beside PyTorch's on one GPU, in one process and one run:
TFLOP/s of the forward and of the backward, for whole causal documents (--tokens) and for one
document (--shard-doc tokens) as fused causal shards (--shards): every shard of the document in
one call, each shard a causal task over its key prefix.

Backends: `distca` (torch.ops.distca.attention_fwd/_bwd: the task list in one call, the shards
reading the document's one K/V), `cudnn` (the same operators with kernel="cudnn": cuDNN's fused
attention on the task list, each task a sequence of one ragged batch), `varlen` (torch.nn.attention.varlen.varlen_attn, GQA native;
shards as one varlen batch, each with its own copy of its key prefix, as a varlen layout holds
it: the copy and the sum of the copies' dK/dV are not timed), `sdpa-flash` and `sdpa-cudnn`
(scaled_dot_product_attention under sdpa_kernel with that one backend; shards as one call per
shard, bottom-right causal: flash through torch.nn.attention.bias.causal_lower_right, cuDNN with
a boolean mask; K/V heads expanded where the backend refuses enable_gqa, noted in the row). A
backend that refuses a shape is listed with torch's reason, not timed.

FLOPs count causal (query, key) pairs (`_distca.attention_pairs` of the task list): forward
4 D Hq per pair, backward 2.5x the forward, the same for every backend of a shape. Times: CUDA
events around each call, --repeats after --warmup; the median is reported with the spread (min,
max). The backward of the PyTorch backends is torch.autograd.grad over a retained graph (the
forward it needs is not timed). Correctness is checked once before timing: on a --check-tokens
document (whole and as 128-token shards) every backend against float32 attention per task
(distca beyond 3e-2 of the largest value, about 8 bf16 ulps, stops the run: exit 1), and on every
timed shape each backend against distca (recorded; exit 1 when every PyTorch backend differs from
distca beyond 3e-2, i.e. distca is the one off; exit 1 too, after the report, when a task-list
kernel such as cudnn differs from distca). The layout `reversed` is the smallest shard size with
the shards' query rows in reverse order: the task-list kernels only, and a case cudnn cannot merge
into one sequence (in order, consecutive shards of a document are one cuDNN sequence).

The plan case (--plan-server, on by default): a skewed batch (--plan-ranks ranks of --plan-tokens
tokens, two of them one whole document each, the rest documents of 512-16K) planned by distca
(minlink), the busiest server's task list (most causal pairs) run by `distca` and `cudnn`, beside
PyTorch's cuDNN SDPA (and flash) on one whole document with the same number of causal pairs: the
equal-work baseline a colocated rank runs. Its ratios are each task-list kernel over sdpa-cudnn's
TFLOP/s.

With --kernel-names, each backend's timing on each shape is followed by one forward + backward under
torch.profiler (CUDA activity, not timed): what ran on the device by name (kernels, and the copies and
memsets the profiler lists beside them), with its device time summed over the shapes, into the
report's "kernel_names" (backend -> [{name, cuda_ms}], the longest first): which of cuDNN's kernels
our graphs run beside those PyTorch's SDPA runs.

    python/bench/bench_cuda_attention.py [--tokens 4096,16384,32768,65536] [--shard-doc 16384]
        [--shards 64,128,256,1024] [--heads 32] [--kv-heads 8] [--head-dim 128] [--kernel-names] [--json F]
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import numpy as np

TOLERANCE = 3e-2
BACKENDS = ("distca", "cudnn", "hopper", "varlen", "sdpa-flash", "sdpa-cudnn")
# Take any task list (the others: one document's shards). hopper: distca's sm_90a kernels, timed
# where the device has compute capability 9.0.
TASK_LIST_BACKENDS = ("distca", "cudnn", "hopper")


def shard_tasks(tokens: int, shard: Optional[int], reverse: bool = False) -> np.ndarray:
    """One document of `tokens` as distca's (n, 5) task rows: one causal task (shard None), or causal
    shards of `shard` queries (the last one the remainder), each over its key prefix [0, end). With
    `reverse`, the shards' query rows lie in reverse order (the last shard's first), so no two
    shards are adjacent: the cudnn kernel cannot merge them into one sequence."""
    if not shard or shard >= tokens:
        return np.array([[0, tokens, 0, tokens, 1]], dtype=np.int64)
    starts = np.arange(0, tokens, shard, dtype=np.int64)
    ends = np.minimum(starts + shard, tokens)
    q_offsets = tokens - ends if reverse else starts
    return np.stack([q_offsets, ends - starts, np.zeros_like(starts), ends, np.ones_like(starts)], axis=1)


def causal_pairs(tasks: np.ndarray) -> int:
    from distca import _distca
    return int(_distca.attention_pairs(np.ascontiguousarray(tasks, dtype=np.int64)))


def summarize(seconds: list, flops: float) -> dict:
    """Median and spread of the timings, as seconds and TFLOP/s."""
    s = sorted(seconds)
    median = float(np.median(s))
    return {"seconds": median, "tflops": flops / median / 1e12, "seconds_spread": [s[0], s[-1]],
            "tflops_spread": [flops / s[-1] / 1e12, flops / s[0] / 1e12], "repeats": len(s)}


def ratios(rows: list) -> list:
    """Per shape: distca's TFLOP/s over the fastest PyTorch backend's, forward and backward."""
    out = []
    for key in dict.fromkeys((r["layout"], r["tokens"], r["shard"]) for r in rows):
        shape = [r for r in rows if (r["layout"], r["tokens"], r["shard"]) == key]
        ours = next((r for r in shape if r["backend"] == "distca"), None)
        entry = {"layout": key[0], "tokens": key[1], "shard": key[2]}
        for p in ("fwd", "bwd"):
            theirs = [r for r in shape if r["backend"] not in TASK_LIST_BACKENDS and r.get(p)]
            best = max(theirs, key=lambda r: r[p]["tflops"], default=None)
            entry[f"{p}_fastest_pytorch"] = best["backend"] if best else None
            entry[f"{p}_ratio"] = (ours[p]["tflops"] / best[p]["tflops"]) if ours and best and ours.get(p) else None
        out.append(entry)
    return out


def cudnn_stats(torch, device) -> dict:
    """The cuDNN kernel's graph cache so far (graphs built, build seconds, calls): the native object
    the `cudnn` rows share; zeros where the build has no cuDNN."""
    from distca import _distca
    from distca.torch.kernels import ops
    if not _distca.cudnn_built():
        return {"graphs_built": 0, "build_seconds": 0.0, "calls": 0}
    return dict(ops.cuda_native(device.index if device.index is not None else torch.cuda.current_device(),
                                "cudnn").graph_stats)


def vs_sdpa_cudnn(rows: list) -> list:
    """Per shape: each task-list kernel's TFLOP/s over sdpa-cudnn's on the same shape."""
    out = []
    for key in dict.fromkeys((r["layout"], r["tokens"], r["shard"]) for r in rows):
        shape = {r["backend"]: r for r in rows if (r["layout"], r["tokens"], r["shard"]) == key}
        base = shape.get("sdpa-cudnn")
        for name in TASK_LIST_BACKENDS:
            if base is not None and name in shape:
                out.append({"backend": name, "layout": key[0], "tokens": key[1], "shard": key[2],
                            **{p: shape[name][p]["tflops"] / base[p]["tflops"] for p in ("fwd", "bwd")}})
    return out


def parse_list(text: str, what: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{what}: positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    first, _, rest = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(description=first, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=lambda t: parse_list(t, "--tokens"), default=[4096, 16384, 32768, 65536],
                        help="whole-document lengths (default 4096,16384,32768,65536)")
    parser.add_argument("--shard-doc", type=int, default=16384, help="the document cut into shards (default 16384)")
    parser.add_argument("--shards", type=lambda t: parse_list(t, "--shards"), default=[64, 128, 256, 1024],
                        help="shard sizes in query rows (default 64,128,256,1024)")
    parser.add_argument("--heads", type=int, default=32, help="query heads Hq (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="D (default 128)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per pass (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--check-tokens", type=int, default=2048, help="the correctness check's document (default 2048)")
    parser.add_argument("--plan-ranks", type=int, default=8, help="the plan case's ranks (default 8; 0: no plan case)")
    parser.add_argument("--plan-tokens", type=int, default=32768, help="the plan case's tokens per rank (default 32768)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated, from {', '.join(BACKENDS)} (default all)")
    parser.add_argument("--kernel-names", action="store_true",
                        help="profile one forward + backward per backend and shape after its timing (torch.profiler) "
                             "and report the device's kernels by name with their time (JSON: kernel_names)")
    parser.add_argument("--json", default=None, help="write the report here")
    return parser


def check_args(parser, args) -> None:
    for name in ("shard_doc", "heads", "kv_heads", "repeats", "check_tokens", "plan_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.plan_ranks != 0 and not 3 <= args.plan_ranks <= 64:
        parser.error(f"--plan-ranks must be 0 (no plan case) or in [3, 64], got {args.plan_ranks}")
    if args.plan_ranks and args.plan_tokens < 4096:
        parser.error(f"--plan-tokens must be at least 4096 for the plan case, got {args.plan_tokens}")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown or "distca" not in args.backends:
        parser.error(f"--backends: from {', '.join(BACKENDS)}, distca included; got {unknown or args.backends}")
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        parser.error(f"--json {args.json}: not a file in an existing folder")


class Unavailable(Exception):
    """A backend refuses a shape; the message says why."""


def make_runner(name: str, torch, q, k, v, do, tasks: np.ndarray, scale: float):
    """(forward(), backward(), outputs()) for backend `name` on one shape: forward and backward run
    one pass each (backward after one untimed forward with autograd); outputs() gives O, dQ, dK, dV
    on the document's rows (dK/dV summed over a varlen layout's copies) for the checks."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if name in TASK_LIST_BACKENDS:
        from distca.torch.kernels import ops
        if name == "cudnn":
            from distca import _distca
            if not _distca.cudnn_built():
                raise Unavailable("this build of distca has no cuDNN kernel (cuDNN or cudnn-frontend not found at "
                                  "configure time)")
        if name == "hopper" and tuple(torch.cuda.get_device_capability(q.device)) != (9, 0):
            raise Unavailable("the hopper kernel runs on compute capability 9.0 (H100, H200)")
        t = torch.from_numpy(tasks)
        state: dict = {}

        def forward():
            state["o"], state["lse"] = ops.attention_fwd(q, k, v, t, scale, 0, name)

        def backward():
            state["grads"] = ops.attention_bwd(do, q, k, v, state["o"], state["lse"], t, scale, 0, name)

        def outputs():
            forward()
            backward()
            return [state["o"]] + list(state["grads"])
        return forward, backward, outputs

    is_whole = len(tasks) == 1
    if name == "varlen":
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as e:
            raise Unavailable(f"torch {torch.__version__} has no torch.nn.attention.varlen: {e}") from None
        ends = tasks[:, 0] + tasks[:, 1]
        cu_q = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32)).to(q.device)
        if is_whole:
            cu_k, k_index = cu_q, None   # the same tensor: cuDNN's varlen takes causal only so
        else:   # every shard with its own copy of its key prefix (not timed)
            cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(ends)]).astype(np.int32)).to(q.device)
            k_index = torch.from_numpy(np.concatenate([np.arange(e) for e in ends])).to(q.device)
        max_q, max_k = int(tasks[:, 1].max()), int(ends.max())
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        kx = leaves[1] if k_index is None else leaves[1].index_select(0, k_index)
        vx = leaves[2] if k_index is None else leaves[2].index_select(0, k_index)
        kv_leaves = [kx.detach().requires_grad_(), vx.detach().requires_grad_()]

        # torch 2.11's varlen_attn has no enable_gqa (later ones do); its FlashAttention-2 kernel takes
        # Hq a multiple of Hkv either way.
        gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}

        def call(qq, kk, vv):
            return varlen_attn(qq, kk, vv, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **gqa)

        graph: dict = {}

        def forward():
            with torch.no_grad():
                graph["o"] = call(q, kx, vx)

        def backward():
            if "out" not in graph:
                graph["out"] = call(leaves[0], *kv_leaves)
            graph["grads"] = torch.autograd.grad(graph["out"], [leaves[0]] + kv_leaves, do, retain_graph=True)

        def outputs():
            forward()
            backward()
            dq, dkx, dvx = graph["grads"]
            if k_index is not None:
                dkx = torch.zeros(k.shape, dtype=torch.float32, device=q.device).index_add_(0, k_index, dkx.float())
                dvx = torch.zeros(k.shape, dtype=torch.float32, device=q.device).index_add_(0, k_index, dvx.float())
            return [graph["o"], dq, dkx, dvx]
        return forward, backward, outputs

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    bhld = lambda x: x.detach().transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731 ([L, H, D] -> [1, H, L, D])
    leaves = [bhld(x).requires_grad_() for x in (q, k, v)]
    do_b = bhld(do)
    spans = [(int(a), int(a + lq), int(k1)) for a, lq, _, k1, _ in tasks]   # (q0, q1, key end) per task

    def attend(qb, kb, vb, gqa: str):
        if gqa == "expanded":
            kb, vb = (x.repeat_interleave(group, dim=1) for x in (kb, vb))
        outs = []
        with sdpa_kernel([backend]):
            for q0, q1, k1 in spans:
                qs, ks, vs = qb[:, :, q0:q1], kb[:, :, :k1], vb[:, :, :k1]
                if q1 - q0 == k1:
                    mask, causal = None, True
                elif backend == SDPBackend.FLASH_ATTENTION:
                    mask, causal = causal_lower_right(q1 - q0, k1), False
                else:
                    rows = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - (q1 - q0))
                    mask, causal = torch.arange(k1, device=q.device)[None, :] <= rows, False
                outs.append(torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa == "native"))
        return outs

    gqa = "native" if group > 1 else "none"
    try:
        with torch.no_grad():
            attend(*leaves, gqa)   # one untimed forward: refused or not
    except RuntimeError as e:
        if gqa != "native":
            raise Unavailable(f"{name}: {str(e).splitlines()[0]}") from None
        try:
            with torch.no_grad():
                attend(leaves[0], *leaves[1:], "expanded")
            gqa = "expanded"
        except RuntimeError as e2:
            raise Unavailable(f"{name}: {str(e2).splitlines()[0]}") from None
    graph = {"gqa": gqa}

    def forward():
        with torch.no_grad():
            graph["o"] = attend(*leaves, gqa)

    def backward():
        if "outs" not in graph:
            graph["outs"] = attend(*leaves, gqa)
            graph["dos"] = [do_b[:, :, q0:q1] for q0, q1, _ in spans]
        graph["grads"] = torch.autograd.grad(graph["outs"], leaves, graph["dos"], retain_graph=True)

    def outputs():
        forward()
        backward()
        back = lambda x: x[0].transpose(0, 1)  # noqa: E731 ([1, H, L, D] -> [L, H, D])
        return [back(torch.cat(graph["o"], dim=2))] + [back(g) for g in graph["grads"]]
    outputs.gqa = gqa
    return forward, backward, outputs


def max_rel(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def reference(torch, q, k, v, do, tasks: np.ndarray, scale: float) -> list:
    """float32 attention per task (autograd): O, dQ, dK, dV."""
    hq, hkv = q.shape[1], k.shape[1]
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    outs = []
    for q0, lq, k0, lk, _ in tasks.tolist():
        qt = leaves[0][q0:q0 + lq]
        kt, vt = (x[k0:k0 + lk].repeat_interleave(hq // hkv, dim=1) for x in leaves[1:])
        s = torch.einsum("qhd,khd->hqk", qt, kt) * scale
        allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vt))
    o = torch.cat(outs)
    return [o.detach()] + list(torch.autograd.grad(o, leaves, do.float()))


def plan_server_tasks(ranks: int, tokens: int, hq: int, hkv: int, d: int):
    """The busiest server's task list (n, 5) of a skewed batch planned by distca (minlink), and the
    batch: ranks 0 and 1 one whole document each, the others documents of 512-16K tokens."""
    import distca
    from distca.torch import rank_layout
    from distca.torch.kernels.native import DistcaKernel
    import torch
    rng = np.random.default_rng(0)
    batch = [[tokens], [tokens]]
    for _ in range(ranks - 2):
        docs, left = [], tokens
        while left > 0:
            n = int(min(left, 2 ** rng.integers(9, 15)))
            docs.append(n)
            left -= n
        batch.append(docs)
    plan = distca.plan(batch, policy="minlink", model={"preset": "llama-8b", "heads": hq, "kv_heads": hkv, "head_dim": d})
    rows = [tuple(int(x) for x in r) for r in plan.batch.to_dict()["pieces"].tolist()]
    best, best_pairs, server = None, -1, -1
    for r in range(plan.num_ranks):
        tasks = DistcaKernel.task_array(rank_layout(plan, plan.batch, rows, r, torch.device("cpu"),
                                                    pingpong=False).parts[0].tasks)
        pairs = causal_pairs(tasks)
        if pairs > best_pairs:
            best, best_pairs, server = tasks, pairs, r
    return best, server, batch


def device_work(events) -> dict:
    """name -> milliseconds of the device activities among torch.profiler's events (the CPU side's
    ops and launches left out), summed over the events of each name."""
    from torch.autograd import DeviceType
    times: dict = {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    return times


def profile_pass(torch, forward: Callable, backward: Callable) -> dict:
    """device_work of one forward + backward, the device idle before and drained after."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        backward()
        torch.cuda.synchronize()
    return device_work(prof.events())


def add_work(total: dict, work: dict) -> None:
    for name, ms in work.items():
        total[name] = total.get(name, 0.0) + ms


def kernel_names_report(per_backend: dict) -> dict:
    """backend -> [{name, cuda_ms}], the longest first, from backend -> {name: ms}."""
    return {backend: [{"name": name, "cuda_ms": ms} for name, ms in sorted(work.items(), key=lambda x: (-x[1], x[0]))]
            for backend, work in per_backend.items()}


def time_pass(torch, fn: Callable, repeats: int, warmup: int) -> list:
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    import torch
    if not torch.cuda.is_available():
        print("bench_cuda_attention: no CUDA device (torch.cuda.is_available() is False): this benchmark times "
              "CUDA kernels; run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    from distca import _distca
    from distca.torch.kernels import ops
    why = ops.unavailable(device, dtype)
    if why is not None:
        print(f"bench_cuda_attention: distca's CUDA kernels cannot run here: {why}", file=sys.stderr)
        return 1
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)

    def inputs(n):
        q, do = (torch.randn(n, hq, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(n, hkv, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
        return q, k, v, do

    # 1. Correctness once before timing: every backend against float32 attention, whole and sharded.
    checks, unavailable = [], {}
    for shard in (None, 128):
        tasks = shard_tasks(args.check_tokens, shard)
        x = inputs(args.check_tokens)
        want = reference(torch, *x, tasks, scale)
        for name in args.backends:
            try:
                got = make_runner(name, torch, *x, tasks, scale)[2]()
            except (Unavailable, RuntimeError, TypeError, NotImplementedError) as e:
                if name == "distca":
                    raise
                unavailable[f"{name} (check, shard {shard})"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                continue
            errors = [max_rel(g, w) for g, w in zip(got, want)]
            checks.append({"backend": name, "tokens": args.check_tokens, "shard": shard,
                           "max_rel_error_o_dq_dk_dv": errors, "ok": max(errors) <= TOLERANCE})
            if name == "distca" and max(errors) > TOLERANCE:
                print(f"bench_cuda_attention: distca differs from float32 attention by {errors} (O, dQ, dK, dV) "
                      f"on {args.check_tokens} tokens, shard {shard}", file=sys.stderr)
                return 1
    # 2. The timed shapes.
    shapes = [("whole", n, None) for n in args.tokens] + [("shards", args.shard_doc, s) for s in args.shards]
    shapes.append(("reversed", args.shard_doc, min(args.shards)))   # task-list kernels only
    rows = []
    kernels: dict = {}   # --kernel-names: backend -> {device activity: ms}
    for layout, n, shard in shapes:
        tasks = shard_tasks(n, shard, reverse=layout == "reversed")
        pairs = causal_pairs(tasks)
        fwd_flops = 4.0 * d * hq * pairs
        x = inputs(n)
        base = None
        for name in args.backends:
            if layout == "reversed" and name not in TASK_LIST_BACKENDS:
                continue
            try:
                forward, backward, outputs = make_runner(name, torch, *x, tasks, scale)
                got = outputs()
            except Unavailable as e:
                unavailable[f"{name} ({layout} {n}, shard {shard})"] = str(e)
                continue
            except (RuntimeError, TypeError, NotImplementedError) as e:   # torch refuses the shape or an argument, or memory runs out
                unavailable[f"{name} ({layout} {n}, shard {shard})"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                torch.cuda.empty_cache()
                continue
            row = {"backend": name, "layout": layout, "tokens": n, "shard": shard, "tasks": int(len(tasks)),
                   "pairs": pairs, "fwd_flops": fwd_flops, "bwd_flops": 2.5 * fwd_flops}
            if getattr(outputs, "gqa", None):
                row["gqa"] = outputs.gqa
            if name == "distca":
                base = got
            elif base is not None:
                diff = [max_rel(g, b) for g, b in zip(got, base)]
                row["max_rel_diff_vs_distca_o_dq_dk_dv"] = diff
                row["agrees_with_distca"] = max(diff) <= TOLERANCE
                if not row["agrees_with_distca"]:
                    print(f"bench_cuda_attention: {name} and distca differ by {diff} (O, dQ, dK, dV) on {layout} {n} "
                          f"shard {shard}", file=sys.stderr)
            del got
            backward()   # the graph the timed backward reuses
            row["fwd"] = summarize(time_pass(torch, forward, args.repeats, args.warmup), fwd_flops)
            row["bwd"] = summarize(time_pass(torch, backward, args.repeats, args.warmup), 2.5 * fwd_flops)
            rows.append(row)
            if args.kernel_names:
                add_work(kernels.setdefault(name, {}), profile_pass(torch, forward, backward))
            del forward, backward, outputs
            torch.cuda.empty_cache()
        del x, base
        others = [r for r in rows if (r["layout"], r["tokens"], r["shard"]) == (layout, n, shard)
                  and r["backend"] not in TASK_LIST_BACKENDS]
        if others and not any(r["agrees_with_distca"] for r in others):
            print(f"bench_cuda_attention: every PyTorch backend differs from distca on {layout} {n} shard {shard}: "
                  f"distca is off", file=sys.stderr)
            return 1
    # 3. The plan case: the busiest server's task list, and the equal-work whole document.
    plan_case = None
    if args.plan_ranks:
        tasks, server, batch = plan_server_tasks(args.plan_ranks, args.plan_tokens, hq, hkv, d)
        pairs = causal_pairs(tasks)
        n_equal = int(round((math.sqrt(8 * pairs + 1) - 1) / 2))   # n (n + 1) / 2 = pairs
        plan_case = {"ranks": args.plan_ranks, "tokens_per_rank": args.plan_tokens, "server": server,
                     "tasks": int(len(tasks)), "causal_tasks": int(tasks[:, 4].sum()), "pairs": pairs,
                     "equal_work_tokens": n_equal, "batch_documents": [len(b) for b in batch]}
        num_q, num_kv = int((tasks[:, 0] + tasks[:, 1]).max()), int((tasks[:, 2] + tasks[:, 3]).max())
        for layout, n_rows, task_rows in (("plan", None, tasks), ("equal-work", n_equal, shard_tasks(n_equal, None))):
            fwd_flops = 4.0 * d * hq * causal_pairs(task_rows)
            if n_rows is None:
                q, do = (torch.randn(num_q, hq, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
                k, v = (torch.randn(num_kv, hkv, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
                x = (q, k, v, do)
            else:
                x = inputs(n_rows)
            names = [b for b in args.backends if (b in TASK_LIST_BACKENDS) == (layout == "plan")]
            for name in names:
                try:
                    forward, backward, outputs = make_runner(name, torch, *x, task_rows, scale)
                    calls_before = cudnn_stats(torch, device)["calls"] if name == "cudnn" else 0
                    forward()
                    backward()
                    if name == "cudnn":   # cuDNN calls (so graphs, at worst) one step's forward + backward needs
                        plan_case["cudnn_calls_per_layer"] = cudnn_stats(torch, device)["calls"] - calls_before
                except (Unavailable, RuntimeError, TypeError, NotImplementedError) as e:
                    unavailable[f"{name} ({layout})"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    torch.cuda.empty_cache()
                    continue
                row = {"backend": name, "layout": layout, "tokens": n_rows or num_q, "shard": None,
                       "tasks": int(len(task_rows)), "pairs": causal_pairs(task_rows), "fwd_flops": fwd_flops,
                       "bwd_flops": 2.5 * fwd_flops}
                row["fwd"] = summarize(time_pass(torch, forward, args.repeats, args.warmup), fwd_flops)
                row["bwd"] = summarize(time_pass(torch, backward, args.repeats, args.warmup), 2.5 * fwd_flops)
                rows.append(row)
                if args.kernel_names:
                    add_work(kernels.setdefault(name, {}), profile_pass(torch, forward, backward))
                del forward, backward, outputs
                torch.cuda.empty_cache()
            del x
        graphs = cudnn_stats(torch, device)
        cudnn_row = next((r for r in rows if r["layout"] == "plan" and r["backend"] == "cudnn"), None)
        if cudnn_row is not None and graphs["graphs_built"] > 0:
            # Graph building against a 32-layer step's attention: at worst every call of the step
            # needs a new graph (a new bucket); each costs the run's mean build time.
            per_graph = graphs["build_seconds"] / graphs["graphs_built"]
            step = 32 * (cudnn_row["fwd"]["seconds"] + cudnn_row["bwd"]["seconds"])
            worst = plan_case.get("cudnn_calls_per_layer", 0) * per_graph
            plan_case["cudnn_graph_build"] = {"mean_build_seconds_per_graph": per_graph,
                                              "attention_seconds_32_layers": step,
                                              "worst_case_build_seconds_per_step": worst,
                                              "worst_case_fraction_of_step": worst / step}
        base = next((r for r in rows if r["layout"] == "equal-work" and r["backend"] == "sdpa-cudnn"), None)
        plan_case["vs_sdpa_cudnn_equal_work"] = {
            r["backend"]: {p: r[p]["tflops"] / base[p]["tflops"] for p in ("fwd", "bwd")}
            for r in rows if r["layout"] == "plan" and base is not None}
    report = {"format": "distca-bench-cuda-attention", "version": 2, "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
              "torch": torch.__version__, "distca_archs": _distca.cuda_kernels_archs(),
              "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": args.dtype, "repeats": args.repeats,
              "warmup": args.warmup,
              "flop_convention": "causal (query, key) pairs x 4 D Hq forward; backward 2.5x the forward",
              "timing": "CUDA events per call; median of repeats, spread = [min, max]",
              "varlen_shards": "each shard with its own copy of its key prefix (the copy and the dK/dV sum not timed)",
              "checks": checks, "rows": rows, "ratios": ratios(rows), "plan_case": plan_case,
              "vs_sdpa_cudnn": vs_sdpa_cudnn(rows), "cudnn_graphs": cudnn_stats(torch, device),
              "unavailable": unavailable}
    if args.kernel_names:
        report["kernel_names"] = kernel_names_report(kernels)
    print(f"{report['device']}, Hq {hq}, Hkv {hkv}, D {d}, {args.dtype}; TFLOP/s, medians of {args.repeats} "
          f"(spread min-max)")
    print(f"{'layout':7s} {'tokens':>6s} {'shard':>5s} {'backend':11s} {'fwd':>18s} {'bwd':>18s}")
    for r in rows:
        cell = lambda p: f"{r[p]['tflops']:6.1f} ({r[p]['tflops_spread'][0]:.1f}-{r[p]['tflops_spread'][1]:.1f})"  # noqa: E731
        print(f"{r['layout']:7s} {r['tokens']:6d} {str(r['shard'] or '-'):>5s} {r['backend']:11s} {cell('fwd'):>18s} "
              f"{cell('bwd'):>18s}")
    for e in report["ratios"]:
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
        print(f"distca / fastest PyTorch, {e['layout']} {e['tokens']} shard {e['shard'] or '-'}: forward "
              f"{fmt(e['fwd_ratio'])} ({e['fwd_fastest_pytorch']}), backward {fmt(e['bwd_ratio'])} "
              f"({e['bwd_fastest_pytorch']})")
    for e in report["vs_sdpa_cudnn"]:
        print(f"{e['backend']} / sdpa-cudnn, {e['layout']} {e['tokens']} shard {e['shard'] or '-'}: forward "
              f"{e['fwd']:.2f}x, backward {e['bwd']:.2f}x")
    if plan_case:
        print(f"plan case: server {plan_case['server']} of {plan_case['ranks']}, {plan_case['tasks']} tasks, "
              f"{plan_case['pairs']} pairs = a {plan_case['equal_work_tokens']}-token document")
        build = plan_case.get("cudnn_graph_build")
        if build:
            print(f"plan case: cuDNN graphs {build['mean_build_seconds_per_graph'] * 1e3:.0f} ms each; a step needing "
                  f"{plan_case['cudnn_calls_per_layer']} new ones: {100 * build['worst_case_fraction_of_step']:.1f} % of "
                  f"32 layers' attention ({build['attention_seconds_32_layers'] * 1e3:.0f} ms)")
        for name, r in plan_case.get("vs_sdpa_cudnn_equal_work", {}).items():
            print(f"plan case: {name} on the task list / sdpa-cudnn on the equal-work document: forward "
                  f"{r['fwd']:.2f}x, backward {r['bwd']:.2f}x")
    for backend, work in report.get("kernel_names", {}).items():
        top = "; ".join(f"{k['name'][:100]} {k['cuda_ms']:.1f}" for k in work[:3])
        print(f"kernels of {backend}, device ms over one forward + backward per shape: {top or 'none recorded'}")
    for what, why in unavailable.items():
        print(f"bench_cuda_attention: not timed: {what}: {why}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    # A task-list kernel off (against float32 attention in the check, or against distca where distca
    # agrees with PyTorch): the run's numbers are written, and it fails.
    off = [r for r in rows if r["backend"] != "distca" and r["backend"] in TASK_LIST_BACKENDS
           and r.get("agrees_with_distca") is False]
    for r in off:
        print(f"bench_cuda_attention: {r['backend']} is off on {r['layout']} {r['tokens']} shard {r['shard']}: "
              f"{r['max_rel_diff_vs_distca_o_dq_dk_dv']} (O, dQ, dK, dV) against distca, beyond {TOLERANCE}",
              file=sys.stderr)
    failed_checks = [c for c in checks if c["backend"] in TASK_LIST_BACKENDS and not c["ok"]]
    for c in failed_checks:
        print(f"bench_cuda_attention: {c['backend']} differs from float32 attention by {c['max_rel_error_o_dq_dk_dv']} "
              f"(O, dQ, dK, dV) on {c['tokens']} tokens, shard {c['shard']}", file=sys.stderr)
    return 1 if off or failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
