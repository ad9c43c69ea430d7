"""tests/attention_cases.py, the GPU check's task lists and error bounds, run here against distca's
CPU kernels (bf16 and fp32 storage): the task lists hold every case the GPU check claims (shards
sharing K/V, key splits, lengths 1 and primes, empty ranges, uncovered and unread rows) and pass
the C++ checks; the kernels stay within the derived bounds, which are not vacuous (the errors seen
reach a fair share of them); and the comparison flags what it must (an error beyond the bound, a
NaN left by an unwritten element, a wrong -inf, a non-zero where the truth is exactly 0)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attention_cases import (  # noqa: E402
    LENGTHS, SLACK, UNIT_ROUNDOFF, check_distca_kernels, excess, random_server, reference_forward)

CPU = torch.device("cpu")
SHORT = (1, 2, 3, 5, 7, 13, 31, 63, 64, 65, 131)   # the CPU's float64 truth stays quick


def test_task_lists_hold_every_case():
    totals: dict = {}
    lengths_seen, shared = set(), 0
    for seed in range(6):
        server = random_server(np.random.default_rng(seed), 600, SHORT)
        t = server.tasks
        for key, n in server.counts.items():
            totals[key] = totals.get(key, 0) + n
        causal = t[t[:, 4] == 1]
        lengths_seen |= set(causal[(causal[:, 3] == causal[:, 1]) & (causal[:, 1] > 0), 1].tolist())
        offsets, counts = np.unique(t[t[:, 3] > 0, 2], return_counts=True)
        shared += int((counts > 1).sum())
        # Q ranges disjoint, inside the buffers; sources copy rows only across key-split parts.
        q = t[t[:, 1] > 0]
        q = q[np.argsort(q[:, 0])]
        assert np.all(q[1:, 0] >= q[:-1, 0] + q[:-1, 1]) and q[-1, 0] + q[-1, 1] <= server.num_q
        assert np.all(t[:, 2] + t[:, 3] <= server.num_kv) and len(server.source) == server.num_q
        assert np.any(t[1:, 0] < t[:-1, 0]), "tasks in Q order: the order was not shuffled"
    assert all(n > 0 for n in totals.values()), totals
    assert {1, 2, 3, 5, 7, 13, 31} <= lengths_seen, lengths_seen
    assert shared > 0, "no two tasks read the same K/V rows"


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 32)])
def test_cpu_kernels_within_the_derived_bounds(dtype, head_dim):
    case = check_distca_kernels(CPU, dtype, head_dim, seed=head_dim, target_rows=400, lengths=SHORT)
    assert case["ok"], {k: r for k, r in case["results"].items() if not r["ok"]}
    if dtype == torch.bfloat16:
        # Not vacuous: bf16's rounding of O alone is up to u/2 of |O|, about a quarter of SLACK x bound.
        for name in ("O", "dQ", "dK", "dV"):
            assert case["results"][name]["worst_ratio"] >= 1 / 16, (name, case["results"][name])


def test_excess_flags_what_it_must():
    server = random_server(np.random.default_rng(3), 300, SHORT)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(server.num_q, 4, 32, generator=gen).bfloat16()
    k, v = (torch.randn(server.num_kv, 2, 32, generator=gen).bfloat16() for _ in range(2))
    o, lse, e_o, e_lse = reference_forward(q, k, v, server.tasks, 32 ** -0.5, torch.bfloat16)
    assert excess(o, o, e_o)["ok"] and excess(lse, lse, e_lse)["ok"]
    no_key = torch.isinf(lse)
    assert bool(no_key.any()), "the task list has no row that sees no key"
    i = int(torch.nonzero(e_o > 0)[0, 0])
    bad = o.clone()
    bad[i] += 1.01 * SLACK * e_o[i]
    assert not excess(bad, o, e_o)["ok"] and excess(bad, o, e_o)["off"] > 0
    bad = o.clone()
    bad[i, 0, 0] = float("nan")
    assert excess(bad, o, e_o)["nan"] == 1 and not excess(bad, o, e_o)["ok"]
    bad = lse.clone()
    bad[no_key] = 0.0
    assert not excess(bad, lse, e_lse)["inf_ok"]
    bad = lse.clone()
    bad[~no_key] = float("-inf")
    assert not excess(bad, lse, e_lse)["ok"]
    zero_rows = torch.nonzero(no_key.any(1))[:, 0]
    bad = o.clone()
    bad[zero_rows[0]] = 1e-30   # the truth is exactly 0 there (no key): any value is off
    assert (e_o[zero_rows[0]] == 0).all() and not excess(bad, o, e_o)["ok"]


def test_unit_roundoffs():
    assert UNIT_ROUNDOFF[torch.bfloat16] == torch.finfo(torch.bfloat16).eps / 2
    assert UNIT_ROUNDOFF[torch.float16] == torch.finfo(torch.float16).eps / 2
    assert UNIT_ROUNDOFF[torch.float32] == torch.finfo(torch.float32).eps / 2
    assert 1 in LENGTHS and 509 in LENGTHS
