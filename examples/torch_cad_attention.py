"""CAD core attention in a PyTorch loop with distca.torch, checked against whole-document attention.

Run (2 processes, gloo on CPU), from the repository root:

    .venv/bin/torchrun --nproc-per-node 2 examples/torch_cad_attention.py

Each rank holds packed documents (here one document spans both ranks). Every step:
  layout = planner.plan(pieces=...)      gathers the ranks' documents, plans, builds the layout
  o = cad_attention(q, k, v, layout)     in every layer: dispatch, server kernel, return, merge
and autograd runs the backward (exact, also for rows whose keys were split between servers).
On GPUs the same code runs with NCCL (`torchrun ... --device cuda`): init the group with "nccl" and
put q/k/v on the GPU; `auto` then picks PyTorch's FlashAttention varlen kernel.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distca.torch import StepPlanner, cad_attention

HQ, HKV, D = 8, 2, 64
# The cost model the planner prices: wide heads make these short documents' attention worth moving.
COST_MODEL = {"heads": 64, "kv_heads": 16, "head_dim": 128, "layers": 1, "hidden": 8192, "ffn_hidden": 8192}


def whole_document(q, k, v, do):
    """Causal attention of one whole document with PyTorch's SDPA, and its gradients."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                       enable_gqa=True).transpose(0, 1)
    return (o.detach(),) + torch.autograd.grad(o, (q, k, v), do)


def main():
    parser = argparse.ArgumentParser(description="CAD attention with distca.torch on 2 ranks")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("torch_cad_attention: the batch below is laid out for 2 ranks (--nproc-per-node 2)")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    # Documents 0 (1800 tokens) and 1 (248 tokens) packed over 2 ranks of 1024 tokens: document 0 spans both.
    lengths = [1800, 248]
    pieces = {0: [(0, 0, 1024, 1800)], 1: [(0, 1024, 1800, 1800), (1, 0, 248, 248)]}[rank]
    gen = torch.Generator().manual_seed(0)  # the same global data on every rank, so each checks its rows
    data = [[torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV, HQ)] for n in lengths]
    local = lambda i: torch.cat([data[d][i][b:e] for d, b, e, _ in pieces]).to(device, dtype)  # noqa: E731

    planner = StepPlanner(model={"heads": HQ, "kv_heads": HKV, "head_dim": D}, cost_model=COST_MODEL,
                          policy="minbytes", granularity=64)
    layout = planner.plan(pieces=pieces)                 # once per step, reused by every layer
    q, k, v = (local(i).requires_grad_() for i in range(3))
    o = cad_attention(q, k, v, layout)
    o.backward(local(3))

    refs = [whole_document(*(x.to(dtype) for x in d)) for d in data]
    errors = []
    for got, i in zip((o, q.grad, k.grad, v.grad), range(4)):
        want = torch.cat([refs[d][i][b:e] for d, b, e, _ in pieces]).to(device)
        stats = torch.stack([(got.float() - want.float()).abs().max(), want.float().abs().max()])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        errors.append(stats[0].item() / stats[1].item())
    merged = sum(p.merge_entries.numel() for p in layout.parts)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    line = ", ".join(f"{n} {e:.1e}" for n, e in zip(("O", "dQ", "dK", "dV"), errors))
    if max(errors) > tolerance:
        raise SystemExit(f"torch_cad_attention: FAILED on rank {rank}: relative error {line} (tolerance {tolerance:.0e})")
    print(f"torch_cad_attention: rank {rank} ok: {layout.num_local_rows} rows, {len(layout.plan.tasks)} tasks in the "
          f"plan, {merged} key-split entries merged here, plan {layout.plan_ms:.1f} ms + layout {layout.layout_ms:.1f} ms, "
          f"relative error {line} (tolerance {tolerance:.0e})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
