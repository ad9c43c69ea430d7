"""distca.torch's whole multi-rank path on one GPU (run by scripts/gpu-check.sh; CI runs its CPU dry
run): 2 and 4 processes sharing the device, the server kernels on CUDA, the exchanges over gloo
through host memory (StepPlanner(host_staging=True): NCCL refuses two ranks on one GPU), and
cad_attention's forward and backward against whole-document attention computed independently
(float64, on the CPU, from the same inputs), with key splits (minbytes at granularity 16 over a
wide cost model) and ping-pong on, for each CUDA server kernel that runs here (distca, cudnn, and
`auto`). Bound: 2e-2 of the largest value, bf16's rounding of inputs and outputs with room to spare;
a misrouted row or a wrong merge is off by far more.

    python python/tests/gpu/check_torch_multirank.py [--device cuda|cpu] [--json F]

--device cpu is a dry run of the same path with CPU tensors (gloo moves them; backends sdpa and
distca, float32). Exit 1 when a check fails; "no GPU: skipped" (exit 0) with --device cuda and no GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_cases import COST_MODEL, HKV, HQ, doc_data, local_rows, random_batch, whole_document  # noqa: E402

HEAD_DIM = 64
BOUND = 2e-2
BATCHES = 3


def rel(got, want) -> float:
    want = want.double()
    return float((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def worker(rank, world, device_type, backends, seed):
    import torch.distributed as dist
    from distca.torch import StepPlanner, cad_attention
    from distca.torch.kernels.backends import get_backend
    from distca.torch.kernels.server import BackendUnavailable
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    model = {"heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM}
    results, unavailable = [], {}
    for name in backends:
        try:
            get_backend(name, device, dtype, head_dim=HEAD_DIM)
        except BackendUnavailable as e:
            unavailable[name] = str(e)
            continue
        planner = StepPlanner(model=model, cost_model=COST_MODEL, policy="minbytes", granularity=16, pingpong=True,
                              backend=name, device=device, host_staging=device_type == "cuda")
        rng = np.random.default_rng(seed)
        for b in range(BATCHES):
            lengths, ranks = random_batch(rng, world, spanning=b % 2 == 0)
            data = doc_data(lengths, seed * 1009 + b, head_dim=HEAD_DIM)
            refs = [whole_document(*d) for d in data]
            pieces = ranks[rank]
            want = [local_rows([r[i] for r in refs], pieces) for i in range(4)]
            layout = planner.plan(pieces=[tuple(p) for p in pieces])
            merged = torch.tensor([sum(int(p.merge_entries.numel()) for p in layout.parts)])
            dist.all_reduce(merged)
            q, k, v, do = (local_rows([d[i] for d in data], pieces).to(device, dtype).contiguous() for i in range(4))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            o = cad_attention(q, k, v, layout)
            o.backward(do)
            errors = [rel(x, w) for x, w in zip((o.detach(), q.grad, k.grad, v.grad), want)]
            results.append({"backend": name, "batch": b, "pingpong": layout.is_pingpong,
                            "merged_entries_all_ranks": int(merged.item()), "errors_o_dq_dk_dv": errors,
                            "ok": all(e <= BOUND for e in errors), "note": layout.backend_note})
    return {"results": results, "unavailable": unavailable}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--worlds", default="2,4", help="process counts (default 2,4)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds: comma-separated integers, got {args.worlds!r}")
    if any(not 2 <= w <= 8 for w in worlds):
        parser.error("--worlds: each between 2 and 8")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_torch_multirank: no GPU: skipped")
        return 0
    from distca.torch.spawn import run_ranks
    backends = ("distca", "cudnn", "hopper", "auto") if args.device == "cuda" else ("sdpa", "distca")
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "bound": BOUND, "worlds": {}}
    ok = True
    for world in worlds:
        outs = run_ranks(worker, world, args.device, backends, 7, timeout=600)
        errors = [o["error"] for o in outs if o["error"]]
        if errors:
            report["worlds"][world] = {"error": errors[0]}
            print(f"check_torch_multirank: {world} ranks: {errors[0]}")
            ok = False
            continue
        rows = [dict(r, rank=rank) for rank, o in enumerate(outs) for r in o["result"]["results"]]
        report["worlds"][world] = {"rows": rows, "unavailable": outs[0]["result"]["unavailable"]}
        for name in backends:
            mine = [r for r in rows if r["backend"] == name]
            if not mine:
                print(f"{world} ranks, {name}: not run ({outs[0]['result']['unavailable'].get(name, '?')})")
                continue
            worst = [max(r["errors_o_dq_dk_dv"][i] for r in mine) for i in range(4)]
            splits = max(r["merged_entries_all_ranks"] for r in mine)
            passed = all(r["ok"] for r in mine) and splits > 0
            ok &= passed
            print(f"{world} ranks, {name}: worst error O {worst[0]:.1e}, dQ {worst[1]:.1e}, dK {worst[2]:.1e}, "
                  f"dV {worst[3]:.1e} (bound {BOUND}); key-split merges {splits}; {'ok' if passed else 'FAILED'}"
                  f"{'; ' + mine[0]['note'] if mine[0]['note'] else ''}")
    report["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"check_torch_multirank: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
