"""One case of the `hopper` kernels for tools that watch a run (scripts/gpu-check.sh runs it under
Nsight Compute and compute-sanitizer): forward and backward on one causal document of --tokens
tokens (Hq 32, Hkv 8, D --head-dim, bf16), each run --runs times (ncu: --launch-skip 2
--launch-count 2 on the kernels' names profiles the second forward and backward).

    python python/bench/hopper_profile_case.py [--tokens 16384] [--head-dim 128] [--runs 2] [--shard 0]
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="the document's tokens (default 16384)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="D (default 128)")
    parser.add_argument("--runs", type=int, default=2, help="runs of the forward and of the backward (default 2)")
    parser.add_argument("--shard", type=int, default=0,
                        help="cut the document into causal shards of this many query rows sharing its K/V "
                             "(the backward's K/V tiles then hold several tasks); 0: one task (default)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.runs < 1 or args.shard < 0:
        parser.error("--tokens and --runs must be at least 1, --shard at least 0")
    import torch
    if not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != (9, 0):
        print("hopper_profile_case: needs a GPU of compute capability 9.0 (H100, H200)", file=sys.stderr)
        return 1
    from distca.torch.kernels import ops
    n, hq, hkv, d = args.tokens, 32, 8, args.head_dim
    q, do = (torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    step = args.shard or n
    tasks = torch.tensor([[a, min(step, n - a), 0, min(a + step, n), 1] for a in range(0, n, step)], dtype=torch.int64)
    for _ in range(args.runs):   # forward, backward, forward, backward, ...
        o, lse = ops.attention_fwd(q, k, v, tasks, d ** -0.5, 0, "hopper")
        ops.attention_bwd(do, q, k, v, o, lse, tasks, d ** -0.5, 0, "hopper")
    torch.cuda.synchronize()
    print(f"hopper_profile_case: {n} tokens in {len(tasks)} task(s), D {d}: forward and backward run {args.runs} "
          f"times each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
