"""StepPlanner(grad_return="bf16") (issue 54): the servers' dK/dV partial sums travel as bf16 and
are summed in fp32 at the owner, as the paper does. On 2 gloo processes, with fp32 inputs:

- dK/dV within the bound bf16 rounding gives: each travelling partial sum p is rounded once to
  the nearest bf16 (relative error at most 2^-8), so |dK_bf16 - dK_fp32| <= 2^-8 sum |p| over the
  row's travelling partials (read off the exchange in the test), plus fp32 summation noise; and
  not equal to the fp32 return (the rounding happens), while O and dQ are bit-identical;
- the dK/dV return's bytes exactly halved (what all_to_all_single is given, and exchange_bytes);
- the rows a rank serves itself are not rounded: with 1 rank nothing travels, and bf16 equals fp32;
- a bad value is a one-line ValueError at construction.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from distca.torch.spawn import run_ranks  # noqa: E402
from torch_cases import COST_MODEL, HKV, HQ, D, MODEL, doc_data, local_rows  # noqa: E402

U_BF16 = 2.0 ** -8          # unit roundoff of bf16 (8 significant bits with the implicit one, round to nearest)
# Documents spanning both ranks, one long: minbytes splits key ranges and sends K/V both ways.
LENGTHS = [700, 90, 300, 46]
PIECES = [[(0, 0, 400, 700), (1, 0, 90, 90), (2, 0, 100, 300)],
          [(2, 100, 300, 300), (0, 400, 700, 700), (3, 0, 46, 46)]]


def _recording_exchange(attention, log: list):
    """attention._Exchange that logs (slot, sent bytes, received tensor) of every exchange."""
    class Recording(attention._Exchange):
        def __init__(self, x, send_splits, recv_splits, group, buffers=None, slot=(), stage=False):
            super().__init__(x, send_splits, recv_splits, group, buffers, slot, stage)
            self.slot, self.sent_bytes = slot, x.numel() * x.element_size()
            log.append(self)
    return Recording


def grad_return_worker(rank, world, dtype_name):
    from distca.torch import StepPlanner, cad_attention, exchange_bytes
    import distca.torch.cad.attention as attention
    dtype = getattr(torch, dtype_name)
    pieces = PIECES[rank] if world == 2 else PIECES[0] + [(d, b, e, n) for d, b, e, n in PIECES[1]]
    data = doc_data(LENGTHS, 5, dtype=torch.float64)
    inputs = [local_rows([d[i] for d in data], pieces).to(dtype).contiguous() for i in range(4)]
    out: dict = {}
    real_exchange = attention._Exchange
    for grad_return in ("fp32", "bf16"):
        planner = StepPlanner(model=MODEL, cost_model=COST_MODEL, policy="minbytes", granularity=16,
                              backend="sdpa", grad_return=grad_return)
        layout = planner.plan(pieces=[tuple(p) for p in pieces])
        log: list = []
        attention._Exchange = _recording_exchange(attention, log)
        try:
            q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
            o = cad_attention(q, k, v, layout)
            o.backward(inputs[3])
        finally:
            attention._Exchange = real_exchange
        dkv_log = [x for x in log if x.slot[:1] == ("bwd_return",) and x.slot[-1] == "dkv"]
        # Sum of |travelling partials| per owner element: received rows less this rank's own.
        abs_sum = torch.zeros((layout.num_local_rows, 2, HKV, D), dtype=torch.float64)
        for p, x in zip(layout.parts, dkv_log):
            got = x.out.double().abs()
            own = p.kv_send_splits[rank]
            at = sum(p.kv_send_splits[:rank])
            got[at:at + own] = 0
            abs_sum.index_add_(0, p.kv_send_index, got)
        out[grad_return] = {
            "o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "abs_sum": abs_sum,
            "dkv_bytes": sum(x.sent_bytes for x in dkv_log), "wire": str(dkv_log[0].out.dtype),
            "bwd_return": exchange_bytes(layout, dtype)["bwd_return"],
            "dq_bytes": exchange_bytes(layout, dtype, grad_return="fp32")["bwd_return"]
            - exchange_bytes(layout, dtype, grad_return="bf16")["bwd_return"]}
    a, b = out["fp32"], out["bf16"]
    diff = torch.stack((b["dk"], b["dv"]), dim=1).double() - torch.stack((a["dk"], a["dv"]), dim=1).double()
    bound = U_BF16 * a["abs_sum"] + 1e-6 * a["abs_sum"].max()
    if dtype == torch.bfloat16:
        # Both returns' fp32 sums are then rounded to bf16 once more: up to 2^-8 |dK| each.
        bound = bound + 2 * U_BF16 * torch.stack((a["dk"], a["dv"]), dim=1).double().abs()
    result = {
        "within_bound": bool((diff.abs() <= bound).all()),
        "worst_over_bound": float((diff.abs() / bound.clamp_min(1e-30)).max()),
        "changed": float(diff.abs().max()),
        "o_dq_identical": bool(torch.equal(a["o"], b["o"]) and torch.equal(a["dq"], b["dq"])),
        "dkv_bytes": (a["dkv_bytes"], b["dkv_bytes"]), "wire": (a["wire"], b["wire"]),
        "bwd_return": (a["bwd_return"], b["bwd_return"]), "kv_part": a["dq_bytes"],
        "travelled": float(a["abs_sum"].sum()),
    }
    # A bad value is refused at construction, in one line.
    for bad in ("fp16", "BF16", None, 16):
        try:
            StepPlanner(model=MODEL, grad_return=bad)
            result.setdefault("accepted", []).append(repr(bad))
        except ValueError as e:
            result.setdefault("refused", []).append(str(e))
    return result


@pytest.mark.parametrize("world", [2, 1])
def test_bf16_grad_return_rounds_only_travelling_partial_sums_and_halves_their_bytes(world):
    results = run_ranks(grad_return_worker, world, "float32", timeout=180)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    for rank, r in enumerate(x["result"] for x in results):
        print(f"\nrank {rank}/{world}: {r}")
        assert r["within_bound"], r
        assert r["o_dq_identical"], r
        assert r["wire"] == ["torch.float32", "torch.bfloat16"], r
        fp32_bytes, bf16_bytes = r["dkv_bytes"]
        assert bf16_bytes * 2 == fp32_bytes and fp32_bytes > 0, r
        if world == 1:   # nothing travels: nothing is rounded
            assert r["changed"] == 0 and r["travelled"] == 0, r
        else:
            assert r["changed"] > 0 and r["travelled"] > 0, r
            # exchange_bytes: the dK/dV part of the backward return halves, dQ's stays
            assert r["bwd_return"][0] - r["bwd_return"][1] == r["kv_part"] > 0, r
        assert "accepted" not in r, r
        assert len(r["refused"]) == 4 and all(m.startswith("grad_return must be 'fp32' or 'bf16'") and "\n" not in m
                                              for m in r["refused"]), r


def test_bf16_grad_return_with_bf16_inputs_only_changes_the_wire():
    """With bf16 q/k/v the partial sums still travel in fp32 by default (distca.torch sums them in
    fp32 whatever the inputs' dtype, and the gradients come back in bf16 either way);
    grad_return="bf16" halves that phase, within the same bound plus the final bf16 rounding of
    each return's sum."""
    results = run_ranks(grad_return_worker, 2, "bfloat16", timeout=180)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    for r in (x["result"] for x in results):
        assert r["within_bound"] and r["o_dq_identical"], r
        assert r["dkv_bytes"][1] * 2 == r["dkv_bytes"][0] > 0, r
    assert any(x["result"]["changed"] > 0 for x in results), results
