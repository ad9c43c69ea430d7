"""distca.torch on one CUDA GPU, in one process (run by scripts/gpu-check.sh; CI does not run it).

1. Server kernels: for every server of a 4-rank plan with key-split tasks, each CUDA backend's
   forward (O, LSE) and backward (dQ, dK, dV, given the merged O/LSE) against the truth: `reference`
   on the bf16-rounded inputs held in float64 (its math runs in fp32, far below bf16's error). The
   bound is derived from bf16 itself: `reference` fed the bf16 tensors, its results rounded to bf16,
   differs from the truth by e_ref, and a backend passes when its error is within 4 e_ref + 2^-7
   (relative to the largest value).
2. The whole path: cad_attention on a 1-rank NCCL group (every backend) against whole-document
   attention in fp64.
3. distca's own CUDA kernels (`_distca.CudaAttention`, the `distca` backend) on random server task
   lists (tests/attention_cases.py: lengths 1, primes and tile sizes +-1, shards sharing their
   document's K/V rows, key-split shards merged by the LSE rule, rows that see no key, tasks with
   no queries, uncovered rows, unread key rows) in bf16 and fp16, D 64 and 128, GQA 4:1, against
   float64 truth within error bounds derived per element from the dtypes' unit roundoff and the
   reduction lengths; outputs filled with NaN before each call, so an element not written fails.
4. Speed: forward + backward of each backend on one 16K-token document and on the same tokens as
   128-token causal shards (each with its own copy of its key prefix, as the varlen layout holds
   it), timed with CUDA events (median of 5).

Writes JSON to --json and prints a markdown table; exit 1 when a check fails. A build without
distca's CUDA kernels (no nvcc where it was installed) is reported as unavailable, and fails only
with --require-distca.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distca  # noqa: E402
from distca.torch import StepPlanner, cad_attention, get_backend, rank_layout  # noqa: E402
from distca.torch.kernels.server import BackendUnavailable, causal_shards  # noqa: E402
from attention_cases import check_distca_kernels  # noqa: E402
from torch_cases import COST_MODEL, doc_data, local_rows, whole_document  # noqa: E402

HQ, HKV, D = 8, 2, 128
BACKENDS = ("reference", "sdpa", "varlen", "flash_attn", "flex", "distca", "cudnn", "hopper")


def rel(got, want):
    return (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)


def kernel_check(device, report):
    batch = [[2048, 64], [128] * 8, [512, 512, 256], [1024]]
    plan = distca.plan(batch, policy="minbytes", granularity=64, model=COST_MODEL)
    rows = [tuple(int(x) for x in r) for r in plan.batch.to_dict()["pieces"].tolist()]
    ref = get_backend("reference", device, torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(0)
    noncausal = 0
    for server in range(plan.num_ranks):
        tasks = rank_layout(plan, plan.batch, rows, server, device, pingpong=False).parts[0].tasks
        noncausal += tasks.groups[1].num_tasks
        x = {n: torch.randn(m, h, D, generator=gen, dtype=torch.float64)
             for n, m, h in (("q", tasks.num_q, HQ), ("k", tasks.num_k, HKV), ("v", tasks.num_k, HKV), ("do", tasks.num_q, HQ))}
        # The truth from the bf16-rounded inputs (fp32 math); the bf16 reference's own error sets the bound.
        xb = {n: t.to(torch.bfloat16).to(device) for n, t in x.items()}
        x64 = {n: t.double() for n, t in xb.items()}
        scale = D ** -0.5
        truth_o, truth_lse = ref.forward(*(x64[n] for n in "qkv"), tasks, scale)
        truth_g = ref.backward(x64["do"], *(x64[n] for n in "qkv"), truth_o, truth_lse, tasks, scale)
        base_o, base_lse = ref.forward(*(xb[n] for n in "qkv"), tasks, scale)
        base_g = ref.backward(xb["do"], *(xb[n] for n in "qkv"), base_o, base_lse, tasks, scale)
        e_ref = [rel(base_o, truth_o)] + [rel(g.to(torch.bfloat16), t) for g, t in zip(base_g, truth_g)]
        for name in BACKENDS[1:]:
            try:
                kernel = get_backend(name, device, torch.bfloat16)
            except BackendUnavailable as e:
                report["unavailable"][name] = str(e)
                continue
            o, lse = kernel.forward(*(xb[n] for n in "qkv"), tasks, scale)
            # The backward gets the truth's O and LSE, as a merged row would.
            g = kernel.backward(xb["do"], *(xb[n] for n in "qkv"), truth_o.to(torch.bfloat16), truth_lse.float(), tasks, scale)
            errors = [rel(o, truth_o), rel(lse, truth_lse)] + [rel(a.to(torch.bfloat16), t) for a, t in zip(g, truth_g)]
            bounds = [4 * e_ref[0] + 2 ** -7, 1e-3] + [4 * e + 2 ** -7 for e in e_ref[1:]]
            ok = all(e <= b for e, b in zip(errors, bounds))
            report["kernels"].append({"server": server, "backend": name, "errors": errors, "bounds": bounds, "ok": ok})
    report["noncausal_tasks"] = noncausal
    return noncausal > 0 and all(k["ok"] for k in report["kernels"])


def path_check(device, report):
    lengths = [700, 300, 24]
    ok = True
    for name in BACKENDS:
        try:
            get_backend(name, device, torch.bfloat16)
        except BackendUnavailable:
            continue
        head_dim = 64 if name in ("distca", "cudnn", "hopper") else 16   # the smallest head dim distca's CUDA kernels are built for
        data = doc_data(lengths, 3, head_dim=head_dim)
        planner = StepPlanner(model={"heads": 4, "kv_heads": 2, "head_dim": head_dim}, policy="minbytes", granularity=16,
                              backend=name, device=device)
        layout = planner.plan(np.cumsum([0] + lengths))
        pieces = [(d, 0, n, n) for d, n in enumerate(lengths)]
        refs = [whole_document(*x) for x in data]
        want = [local_rows([r[i] for r in refs], pieces) for i in range(4)]
        q, k, v, do = (local_rows([x[i] for x in data], pieces).to(device, torch.bfloat16).contiguous() for i in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = cad_attention(q, k, v, layout)
        o.backward(do)
        errors = [rel(a.cpu(), w) for a, w in zip((o, q.grad, k.grad, v.grad), want)]
        passed = all(e <= 2e-2 for e in errors)
        ok &= passed
        report["path"].append({"backend": name, "errors": errors, "ok": passed})
    return ok


def distca_check(device, report, require: bool):
    """Section 3: distca's kernels on random task lists, every dtype and head dim they take here."""
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.bfloat16,)
    reasons = {}
    for dtype in dtypes:
        try:
            get_backend("distca", device, dtype)
        except BackendUnavailable as e:
            reasons[str(dtype)] = str(e)
    if reasons:
        report["unavailable"]["distca (section 3)"] = reasons
        print(f"check_torch_cuda: distca's kernels NOT CHECKED: {reasons}")
        return not require
    # CPU (the dry run): fewer rows, shorter documents: its float64 truth runs on the CPU.
    rows, lengths = (3000, None) if device.type == "cuda" else (500, (1, 2, 3, 5, 7, 13, 31, 63, 64, 65, 131))
    ok = True
    kernels = ["distca"]
    if device.type == "cuda":
        for name in ("cudnn", "hopper"):
            try:
                get_backend(name, device, torch.bfloat16)
                kernels.append(name)
            except BackendUnavailable as e:
                report["unavailable"][f"{name} (section 3)"] = str(e)
    for kernel in kernels:
        for dtype in dtypes:
            for head_dim in (64, 128):
                for seed in (0, 1):
                    case = check_distca_kernels(device, dtype, head_dim, seed, rows, hq=HQ, hkv=HKV, kernel=kernel,
                                                **({"lengths": lengths} if lengths else {}))
                    report["distca"].append(case)
                    ok &= case["ok"]
                    if not case["ok"]:
                        print(f"check_torch_cuda: {kernel} {case['dtype']} D {head_dim} seed {seed}: "
                              f"{ {k: r for k, r in case['results'].items() if not r['ok']} }")
    return ok


def speed(device, report):
    n = 16384
    flops = 4 * D * HQ * (n * (n + 1) / 2)   # causal pairs x 4 D Hq; backward counted as 2.5x
    for shard in (None, 128):
        tasks = causal_shards(n, shard or 0, device)
        q = torch.randn(tasks.num_q, HQ, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(tasks.num_k, HKV, D, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        do = torch.randn_like(q)
        for name in BACKENDS[1:]:
            try:
                kernel = get_backend(name, device, torch.bfloat16)
            except BackendUnavailable:
                continue
            times = {"fwd": [], "bwd": []}
            try:
                for _ in range(6):
                    a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                    a.record()
                    o, lse = kernel.forward(q, k, v, tasks, D ** -0.5)
                    b.record()
                    kernel.backward(do, q, k, v, o, lse, tasks, D ** -0.5)
                    c.record()
                    torch.cuda.synchronize()
                    times["fwd"].append(a.elapsed_time(b) / 1e3)
                    times["bwd"].append(b.elapsed_time(c) / 1e3)
            except (RuntimeError, TypeError, NotImplementedError) as e:   # memory runs out, or torch refuses the shape
                report["unavailable"][f"{name} (speed, shard {shard})"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                print(f"check_torch_cuda: {name} not timed (shard {shard}): {type(e).__name__}: {str(e).splitlines()[0]}")
                torch.cuda.empty_cache()
                continue
            fwd, bwd = (float(np.median(times[p][1:])) for p in ("fwd", "bwd"))
            report["speed"].append({"backend": name, "tokens": n, "shard": shard, "fwd_s": fwd, "bwd_s": bwd,
                                    "fwd_tflops": flops / fwd / 1e12, "bwd_tflops": 2.5 * flops / bwd / 1e12})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of the checks with the CPU backends (no speed part)")
    parser.add_argument("--require-distca", action="store_true",
                        help="fail when distca's kernels cannot run here (default: report them as unavailable)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_torch_cuda: no GPU: skipped")
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "kernels": [], "path": [], "distca": [], "speed": [], "unavailable": {}}
    ok_k = kernel_check(device, report)
    ok_p = path_check(device, report)
    ok_d = distca_check(device, report, args.require_distca)
    report["ok"] = bool(ok_k and ok_p and ok_d)
    Path(args.json).write_text(json.dumps(report, indent=1))   # the checks are kept if the speed part fails
    if device.type == "cuda":
        speed(device, report)
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("| backend | server | max error (O, LSE, dQ, dK, dV) | ok |\n|---|---|---|---|")
    for k in report["kernels"]:
        print(f"| {k['backend']} | {k['server']} | {', '.join(f'{e:.2e}' for e in k['errors'])} | {k['ok']} |")
    for p in report["path"]:
        print(f"| path {p['backend']} | 1 rank | {', '.join(f'{e:.2e}' for e in p['errors'])} | {p['ok']} |")
    print("\n| kernel | dtype | D | seed | tasks | worst error / bound (O, LSE, dQ, dK, dV) | ok |\n|---|---|---|---|---|---|---|")
    for c in report["distca"]:
        worst = ", ".join(f"{c['results'][n]['worst_ratio']:.2f}" for n in ("O", "LSE", "dQ", "dK", "dV"))
        off = {n: r for n, r in c["results"].items() if not r["ok"]}
        print(f"| {c['kernel']} | {c['dtype']} | {c['head_dim']} | {c['seed']} | {c['tasks']} | {worst} | {c['ok']}"
              f"{'' if c['ok'] else ' ' + json.dumps(off)} |")
    print("\n| backend | shard | fwd TFLOP/s | bwd TFLOP/s |\n|---|---|---|---|")
    for s in report["speed"]:
        print(f"| {s['backend']} | {s['shard'] or 'whole'} | {s['fwd_tflops']:.1f} | {s['bwd_tflops']:.1f} |")
    for name, why in report["unavailable"].items():
        print(f"unavailable: {name}: {why}")
    dist.destroy_process_group()
    print(f"check_torch_cuda: {'ok' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
