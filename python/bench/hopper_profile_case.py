"""One case for profiling the sm_90a forward (scripts/gpu-check.sh runs it under Nsight Compute):
the `hopper` kernel's forward on one causal document of --tokens tokens (Hq 32, Hkv 8, D 128, bf16),
run twice (a warm-up, then the profiled launch: ncu --launch-skip 1 --launch-count 1).

    python python/bench/hopper_profile_case.py [--tokens 16384]
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="the document's tokens (default 16384)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    import torch
    if not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != (9, 0):
        print("hopper_profile_case: needs a GPU of compute capability 9.0 (H100, H200)", file=sys.stderr)
        return 1
    from distca.torch import ops
    n, hq, hkv, d = args.tokens, 32, 8, 128
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tasks = torch.tensor([[0, n, 0, n, 1]], dtype=torch.int64)
    for _ in range(2):
        ops.attention_fwd(q, k, v, tasks, d ** -0.5, 0, "hopper")
    torch.cuda.synchronize()
    print(f"hopper_profile_case: {n} tokens, forward run twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
