"""Shared by the distca.torch tests: random batches, whole-document attention in float64 (the
ground truth) and in the inputs' dtype through PyTorch's SDPA (a same-precision baseline), and the
benchmark scripts' runner."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parents[2] / "python" / "bench"

HQ, HKV, D = 4, 2, 16
MODEL = {"heads": HQ, "kv_heads": HKV, "head_dim": D}
# What the planners price (test_metadata.py's): a model wide enough that these short documents'
# attention outweighs a task's fixed cost, so minbytes splits key ranges.
COST_MODEL = {"layers": 1, "hidden": 4096, "heads": 512, "kv_heads": 64, "head_dim": 512, "ffn_hidden": 4096}


def random_batch(rng: np.random.Generator, world: int, spanning: bool):
    """(doc_lengths, per-rank pieces [(doc, begin, end, length)]): documents of 1..300 tokens, a long
    one in most batches. spanning: documents packed in order over the ranks (a document may span
    several); else each rank holds whole documents."""
    if spanning:
        per_rank = int(rng.integers(64, 320))
        lengths, total = [], 0
        while total < per_rank * world:
            n = int(min(rng.integers(1, 2 * per_rank), per_rank * world - total))
            lengths.append(n)
            total += n
        ranks: list = [[] for _ in range(world)]
        at = 0
        for doc, n in enumerate(lengths):
            begin = 0
            while begin < n:
                rank = at // per_rank
                take = min(n - begin, per_rank * (rank + 1) - at)
                ranks[rank].append((doc, begin, begin + take, n))
                begin, at = begin + take, at + take
        return lengths, ranks
    lengths, ranks = [], []
    for r in range(world):
        mine = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(1, 300)) if rng.random() < 0.8 else int(rng.integers(1, 24))
            mine.append((len(lengths), 0, n, n))
            lengths.append(n)
        ranks.append(mine)
    return lengths, ranks


def doc_data(lengths, seed: int, dtype=torch.float32, head_dim: int = D):
    """Per document: q [L, HQ, D], k, v [L, HKV, D], do [L, HQ, D], the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, h, head_dim, generator=gen, dtype=torch.float64).to(dtype) for h in (HQ, HKV, HKV, HQ)]
            for n in lengths]


def whole_document(q, k, v, do):
    """Causal attention of one whole document and its gradients, float64: O, dQ, dK, dV."""
    q, k, v, do = (x.detach().double().requires_grad_() for x in (q, k, v, do))
    kr, vr = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, kr) / q.shape[-1] ** 0.5
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vr)
    grads = torch.autograd.grad(o, (q, k, v), do.detach())
    return [o.detach()] + [g.detach() for g in grads]


def local_rows(per_doc, pieces):
    """This rank's rows of per-document tensors, in its pieces' order."""
    return torch.cat([per_doc[doc][b:e] for doc, b, e, _ in pieces])


def sdpa_whole_documents(data):
    """Per document: O, dQ, dK, dV of PyTorch's SDPA on the whole document in the inputs' dtype."""
    out = []
    for q, k, v, do in data:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
        out.append([o.detach()] + list(torch.autograd.grad(o, (q, k, v), do)))
    return out


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """python/bench/<script> with args, one OpenMP thread, output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
