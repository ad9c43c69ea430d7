"""One case of the `hopper` kernels for tools that watch a run (scripts/gpu-check.sh runs it under
Nsight Compute and compute-sanitizer): forward and backward on one causal document of --tokens
tokens (Hq 32, Hkv 8, D --head-dim, bf16), each run --runs times (ncu: --launch-skip 2
--launch-count 2 on the kernels' names profiles the second forward and backward).

    python python/bench/hopper_profile_case.py [--tokens 16384] [--head-dim 128] [--runs 2]
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="the document's tokens (default 16384)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="D (default 128)")
    parser.add_argument("--runs", type=int, default=2, help="runs of the forward and of the backward (default 2)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.runs < 1:
        parser.error("--tokens and --runs must be at least 1")
    import torch
    if not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != (9, 0):
        print("hopper_profile_case: needs a GPU of compute capability 9.0 (H100, H200)", file=sys.stderr)
        return 1
    from distca.torch import ops
    n, hq, hkv, d = args.tokens, 32, 8, args.head_dim
    q, do = (torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tasks = torch.tensor([[0, n, 0, n, 1]], dtype=torch.int64)
    for _ in range(args.runs):   # forward, backward, forward, backward, ...
        o, lse = ops.attention_fwd(q, k, v, tasks, d ** -0.5, 0, "hopper")
        ops.attention_bwd(do, q, k, v, o, lse, tasks, d ** -0.5, 0, "hopper")
    torch.cuda.synchronize()
    print(f"hopper_profile_case: {n} tokens, D {d}: forward and backward run {args.runs} times each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
