"""Issue 72 row 2 through distca.torch: one NaN, +inf or -inf element in q, k, v or the upstream
gradient gives NaN and infinities in cad_attention's output and in q/k/v's gradients (backend
`distca`, what `auto` picks on CPU; 2 gloo ranks, a plan that moves and key-splits a long
document) exactly where exact attention puts them: each output element a sum over the (query,
key) pairs that exist, never over a pair the causal mask hides. Before, distca's CPU kernel read a
NaN score as 0 and a NaN row sum as "no keys": a NaN in q gave that row 0.0.

The ground truth here is float64 attention per document in which every sum runs over visible pairs
only (torch.where around each product). PyTorch's SDPA and distca.torch's `reference` backend
multiply masked pairs by a zero probability instead, so a NaN in v reaches rows that cannot see
it (0 * NaN); they never hide a NaN either, but they put more of them."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from distca.torch.spawn import run_ranks  # noqa: E402
from torch_cases import COST_MODEL, HKV, HQ, doc_data, local_rows  # noqa: E402

D = 32  # the smallest head dim distca's kernels are built for
LENGTHS = [200, 30, 50, 40]
PIECES = [[(0, 0, 200, 200)], [(1, 0, 30, 30), (2, 0, 50, 50), (3, 0, 40, 40)]]
# (tensor, row of document 0): its first query (one key), rows in the middle and at the end.
WHERES = [("q", 0), ("q", 150), ("k", 0), ("k", 100), ("v", 120), ("do", 180)]
VALUES = [float("nan"), float("inf"), float("-inf")]


def exact_document(q, k, v, do):
    """O, dQ, dK, dV of causal attention, float64, every sum over visible (query, key) pairs only."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    n, scale = q.shape[0], q.shape[-1] ** -0.5
    kr, vr = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    seen = torch.ones(n, n, dtype=torch.bool).tril()                                  # [i, j]
    s = torch.where(seen, torch.einsum("qhd,khd->hqk", q, kr) * scale, float("-inf"))
    p = torch.softmax(s, dim=-1)                                                       # [h, i, j]
    pair = seen[None, :, :, None]
    o = torch.where(pair, p[..., None] * vr.permute(1, 0, 2)[:, None], 0).sum(2).permute(1, 0, 2)  # [i, h, d]
    dp = torch.einsum("qhd,khd->hqk", do, vr)
    delta = (do * o).sum(-1).transpose(0, 1)                                           # [h, i]
    ds = p * (dp - delta[..., None])
    k_hjd = kr.permute(1, 0, 2)[:, None]                                               # [h, 1, j, d]
    dq = (torch.where(pair, ds[..., None] * k_hjd, 0).sum(2) * scale).permute(1, 0, 2)
    q_hid = q.permute(1, 0, 2)[:, :, None]                                             # [h, i, 1, d]
    do_hid = do.permute(1, 0, 2)[:, :, None]
    dk = (torch.where(pair, ds[..., None] * q_hid, 0).sum(1) * scale).permute(1, 0, 2)  # [j, h, d]
    dv = torch.where(pair, p[..., None] * do_hid, 0).sum(1).permute(1, 0, 2)
    fold = lambda g: g.reshape(n, HKV, HQ // HKV, -1).sum(2)  # noqa: E731
    return [o, dq, fold(dk), fold(dv)]


def kinds(x):
    """0 finite, 1 NaN, 2 +inf, 3 -inf, per element."""
    return torch.where(torch.isnan(x), 1, torch.where(x == float("inf"), 2, torch.where(x == float("-inf"), 3, 0)))


def nonfinite_worker(rank, world):
    from distca.torch import StepPlanner, cad_attention
    planner = StepPlanner(model={"heads": HQ, "kv_heads": HKV, "head_dim": D}, cost_model=COST_MODEL,
                          policy="minbytes", granularity=16, backend="distca")
    layout = planner.plan(pieces=PIECES[rank])
    merged = sum(p.merge_entries.numel() for p in layout.parts)
    pieces = PIECES[rank]
    out = {"cases": [], "merged_entries": merged}
    clean = doc_data(LENGTHS, 7, head_dim=D)
    exact = [exact_document(*d) for d in clean]
    for tensor, row in WHERES:
        for value in VALUES:
            data = [[x.clone() for x in d] for d in clean]
            data[0][("q", "k", "v", "do").index(tensor)][row, 0, 5] = value
            truth = [exact_document(*data[0]) if any(doc == 0 for doc, *_ in pieces) else exact[0]] + exact[1:]
            want = [local_rows([t[i] for t in truth], pieces) for i in range(4)]
            q, k, v, do = (local_rows([d[i] for d in data], pieces).float().contiguous() for i in range(4))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            o = cad_attention(q, k, v, layout, backend="distca")
            o.backward(do)
            case = {"case": f"{tensor}[{row}] = {value}", "mismatch": {}, "non_finite": 0}
            for name, got, w in zip(("O", "dQ", "dK", "dV"), (o.detach(), q.grad, k.grad, v.grad), want):
                bad = kinds(got) != kinds(w)
                case["non_finite"] += int((kinds(w) != 0).sum())
                if bad.any():
                    i = int(bad.flatten().nonzero()[0])
                    case["mismatch"][name] = (f"{int(bad.sum())} elements, first at {i}: got {got.flatten()[i].item()}, "
                                              f"exact {w.flatten()[i].item()}")
            out["cases"].append(case)
    return out


def test_non_finite_inputs_reach_exactly_the_outputs_exact_attention_puts_them_in():
    results = run_ranks(nonfinite_worker, 2, timeout=300)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    assert sum(r["result"]["merged_entries"] for r in results) > 0, "no key-split row: the LSE merge went untested"
    for rank, r in enumerate(results):
        for case in r["result"]["cases"]:
            assert not case["mismatch"], f"rank {rank}, {case['case']}: {case['mismatch']}"
    # Every case reaches the outputs on some rank (rank 0 holds document 0, where they are).
    for i, case in enumerate(results[0]["result"]["cases"]):
        assert case["non_finite"] > 0, case["case"]
