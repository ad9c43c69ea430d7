"""distca.torch on CPU with gloo, 2 and 4 processes: cad_attention against whole-document
attention over random batches x every policy x the CPU backends, ping-pong on and off, both
backward modes, documents spanning ranks, key-split tasks, one layout over several layers, bf16,
and bad input on one rank ending every rank with the same error."""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import distca  # noqa: E402
from distca.torch.spawn import run_ranks  # noqa: E402
from sizes import soak  # noqa: E402
from torch_cases import (  # noqa: E402
    COST_MODEL, HKV, HQ, D, MODEL, doc_data, local_rows, random_batch, sdpa_whole_documents, whole_document)

# Random batches per world size: four ranks share this machine's two cores, so they get fewer
# (every policy, ping-pong on and off, spanning and whole documents in each). The quick sizes are
# the soak's first batches (the same seeds); each has every kind of batch the counts below ask for
# (3 and 1 second-layer batches; 12 and 4 in the soak). 24 and 10 since 2026-12-02 (were 40 and 14:
# the two tests were 30 s of pytest's 170 s on 2 cores).
NUM_BATCHES = soak({2: 24, 4: 10}, {2: 120, 4: 40})
TOLERANCE = 1e-5
POLICIES = ("none", "distca", "minmax", "minbytes")


def _max_rel(pairs):
    """max over tensors of |got - want|max / |want|max, reduced over the ranks."""
    stats = torch.tensor([[(g.double() - w).abs().max().item(), w.abs().max().item()] for g, w in pairs])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return [a / max(b, 1e-30) for a, b in stats.tolist()]


def _run_layer(layout, data, pieces, backend, dtype=torch.float32):
    q, k, v, do = (local_rows([d[i] for d in data], pieces).to(dtype).contiguous() for i in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    from distca.torch import cad_attention
    o = cad_attention(q, k, v, layout, backend=backend)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


def matrix_worker(rank, world, num_batches, seed):
    from distca.torch import StepPlanner
    planners = {}
    for policy in POLICIES:
        for pingpong in (False, True):
            # stateful: every call keeps its servers' Q/K/V (no state budget); budgeted: the default
            # budget (stateful only where no server holds more rows than it owns).
            for backward in ("stateful", "budgeted", "stateless"):
                planners[policy, pingpong, backward] = StepPlanner(
                    model=MODEL, cost_model=COST_MODEL, policy=policy, granularity=16 if policy in ("minmax", "minbytes") else None,
                    pingpong=pingpong, backward="stateless" if backward == "stateless" else "stateful",
                    state_budget=None if backward == "stateful" else 0, backend="sdpa")
    rng = np.random.default_rng(seed)
    worst = {}
    counts = {"cases": 0, "merged_entries": 0, "spanning_batches": 0, "pingpong_split": 0, "pingpong_identical": 0,
              "pingpong_cuts": 0, "pingpong_max_diff": 0.0, "multi_layer": 0, "mixed_layers": 0, "budgeted_stateless": 0}
    for b in range(num_batches):
        spanning = b % 2 == 1
        lengths, ranks = random_batch(rng, world, spanning)
        counts["spanning_batches"] += int(any(len({p[0] for p in r}) and any(p[2] - p[1] < p[3] for p in r)
                                              for r in ranks))
        data = doc_data(lengths, seed * 100003 + b)
        refs = [whole_document(*d) for d in data]
        pieces = ranks[rank]
        want = [local_rows([r[i] for r in refs], pieces) for i in range(4)]
        backward = ("stateful", "budgeted", "stateless")[b % 3]
        for policy in POLICIES:
            layouts = {}
            for pingpong in (False, True):
                layouts[pingpong] = planners[policy, pingpong, backward].plan(
                    pieces=[(doc, begin, end, n) for doc, begin, end, n in pieces])
            merged = torch.tensor([sum(p.merge_entries.numel() for p in layouts[False].parts)])
            dist.all_reduce(merged)
            counts["merged_entries"] += int(merged.item())
            results = {}
            for backend, pingpong in (("reference", False), ("sdpa", False), ("sdpa", True)):
                got = _run_layer(layouts[pingpong], data, pieces, backend)
                errors = _max_rel(list(zip(got, want)))
                key = f"{backend}{'+pingpong' if pingpong else ''}"
                worst[key] = [max(a, e) for a, e in zip(worst.get(key, [0.0] * 4), errors)]
                results[backend, pingpong] = got
                counts["cases"] += 1
            if backward == "budgeted":
                counts["budgeted_stateless"] += int(layouts[True].stateless_calls > 0)
            counts["pingpong_split"] += int(layouts[True].is_pingpong)
            off, on = results["sdpa", False], results["sdpa", True]
            diff = _max_rel(list(zip(on, [x.double() for x in off])))
            counts["pingpong_identical"] += int(all(torch.equal(a, c) for a, c in zip(on[:2], off[:2])))
            counts["pingpong_cuts"] += layouts[True].split.num_cuts if layouts[True].split is not None else 0
            counts["pingpong_max_diff"] = max(counts["pingpong_max_diff"], max(diff))
            if b % 10 == 0 and policy == "minbytes":
                # One layout serves several layers: a second layer's inputs through the same layout.
                data2 = doc_data(lengths, seed * 100003 + b + 7777)
                refs2 = [whole_document(*d) for d in data2]
                want2 = [local_rows([r[i] for r in refs2], pieces) for i in range(4)]
                # Stateful: a budget of the calls so far sends this one's Q/K/V again (stateless)
                # while the first layer's servers kept theirs: both in one step's layout.
                lay = layouts[True]
                extra, before = lay.extra_state_bytes(torch.float32), lay.stateless_calls
                if lay.backward == "stateful" and extra > 0 and lay.kept_calls > 0:
                    lay.state_budget = extra * lay.kept_calls
                got2 = _run_layer(lay, data2, pieces, "sdpa")
                counts["mixed_layers"] += int(lay.kept_calls > 0 and lay.stateless_calls == before + 1)
                errors = _max_rel(list(zip(got2, want2)))
                worst["sdpa second layer"] = [max(a, e) for a, e in zip(worst.get("sdpa second layer", [0.0] * 4), errors)]
                counts["multi_layer"] += 1
    return {"worst": worst, "counts": counts}


@pytest.mark.parametrize("world", [2, 4])
def test_cad_attention_equals_whole_document_attention(world):
    num_batches = NUM_BATCHES[world]
    results = run_ranks(matrix_worker, world, num_batches, 17 + world, timeout=900)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    report = results[0]["result"]
    counts, worst = report["counts"], report["worst"]
    print(f"\n{world} ranks: {counts}\nworst relative error (O, dQ, dK, dV): {worst}")
    assert counts["cases"] == num_batches * len(POLICIES) * 3
    for key, errs in worst.items():
        assert max(errs) <= TOLERANCE, f"{key}: {errs}"
    assert counts["merged_entries"] > 0, "no plan split a row's keys: the LSE merge went untested"
    assert counts["spanning_batches"] >= num_batches // 4, counts
    assert counts["pingpong_split"] >= num_batches * len(POLICIES) // 2, counts
    # Ping-pong computes the plan's pairs, a few tasks cut in two at a query row (nanobatch.py):
    # O, dQ, dK and dV equal up to fp32 rounding (a cut task's rows see their keys in other
    # blocks; a K/V row's contributions from the two nano-batches are summed in another order; a
    # key-split row's parts may be merged over both nano-batches). Plans with no cut mostly give
    # bit-identical O and dQ.
    assert counts["pingpong_cuts"] > 0, counts
    assert counts["pingpong_identical"] >= num_batches * len(POLICIES) // 4, counts
    assert counts["pingpong_max_diff"] <= 1e-6, counts
    assert counts["multi_layer"] == (num_batches + 9) // 10  # the batches b with b % 10 == 0
    assert counts["mixed_layers"] >= 1, counts          # batch 0: stateful, then stateless, in one layout
    assert counts["budgeted_stateless"] >= 1, counts    # the default budget sent Q/K/V again somewhere


def bf16_worker(rank, world, num_batches, seed):
    """bf16 CAD against float64 truth, beside bf16 whole-document SDPA against the same truth."""
    from distca.torch import StepPlanner
    planner = StepPlanner(model=MODEL, cost_model=COST_MODEL, policy="minbytes", granularity=16, pingpong=True)
    rng = np.random.default_rng(seed)
    worst = []
    for b in range(num_batches):
        lengths, ranks = random_batch(rng, world, spanning=b % 2 == 1)
        data = doc_data(lengths, seed + b, torch.bfloat16)
        refs = [whole_document(*d) for d in data]
        pieces = ranks[rank]
        want = [local_rows([r[i] for r in refs], pieces) for i in range(4)]
        # The same-precision baseline: PyTorch's SDPA on each whole document in bf16.
        base = sdpa_whole_documents(data)
        base_local = [local_rows([r[i] for r in base], pieces) for i in range(4)]
        layout = planner.plan(pieces=pieces)
        for backend in ("reference", "sdpa"):
            got = _run_layer(layout, data, pieces, backend, torch.bfloat16)
            worst.append({"backend": backend, "cad": _max_rel(list(zip(got, want))),
                          "baseline": _max_rel(list(zip(base_local, want)))})
    return worst


def test_bf16_within_a_derived_bound():
    results = run_ranks(bf16_worker, 2, 20, 5)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    worst_ratio = 0.0
    for case in results[0]["result"]:
        for name, cad, base in zip(("O", "dQ", "dK", "dV"), case["cad"], case["baseline"]):
            # bf16 storage rounds each value at 2^-8 relative; CAD rounds Q/K/V once more than a whole
            # call only where outputs are merged or sums are split, so allow twice the baseline's
            # error plus one bf16 ulp.
            bound = 2 * base + 2 ** -8
            assert cad <= bound, f"{case['backend']} {name}: {cad:.3g} > {bound:.3g} (baseline {base:.3g})"
            worst_ratio = max(worst_ratio, cad / bound)
    print(f"\nbf16: worst error / bound {worst_ratio:.2f}")


def bad_input_worker(rank, world, case):
    from distca.torch import InputError, StepPlanner
    planner = StepPlanner(model=MODEL, policy="minbytes", granularity=16)
    start = time.time()
    try:
        if case == "plan":
            planner.plan([0, 100, 50] if rank == world - 1 else [0, 64, 100])
        else:
            layout = planner.plan([0, 64, 100])
            q = torch.randn(100, HQ, D)
            k, v = torch.randn(100, HKV, D), torch.randn(100, HKV, D)
            if rank == world - 1:
                if case == "shape":
                    q = torch.randn(100, HQ + 1, D)
                elif case == "dtype":
                    k = k.double()
                elif case == "contiguous":
                    q = torch.randn(HQ, 100, D).transpose(0, 1)
                elif case == "device":
                    k = k.to("meta")
                elif case == "foreign":  # a layout built without the planner (no group, no model shape)
                    from distca.torch import rank_layout
                    rows = [tuple(int(x) for x in r) for r in layout.plan.batch.to_dict()["pieces"].tolist()]
                    layout = rank_layout(layout.plan, layout.plan.batch, rows, rank, torch.device("cpu"), pingpong=False)
            if case == "stale":  # every rank plans a second step; the last rank keeps the first one's layout
                newer = planner.plan([0, 64, 100])
                layout = layout if rank == world - 1 else newer
            from distca.torch import cad_attention
            cad_attention(q, k, v, layout)
        return {"raised": None, "seconds": time.time() - start}
    except InputError as e:
        return {"raised": str(e), "seconds": time.time() - start}


@pytest.mark.parametrize("case", ["plan", "shape", "dtype", "contiguous", "device", "foreign", "stale"])
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(case):
    results = run_ranks(bad_input_worker, 2, case, timeout=120)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    messages = {r["result"]["raised"] for r in results}
    assert len(messages) == 1 and None not in messages, results
    message = messages.pop()
    print(f"\n{case}: {message}")
    assert all(r["result"]["seconds"] < 10 for r in results), results
    expected = {"plan": "cu_seqlens must increase strictly", "shape": "q has shape (100, 5, 16)",
                "dtype": "must share a dtype", "contiguous": "not contiguous", "device": "k is on meta, the layout on cpu",
                "foreign": "the layout has no model shape", "stale": "rank 1 passed the layout of an earlier step"}
    assert expected[case] in message


def prefetch_worker(rank, world):
    from distca.torch import StepPlanner
    planner = StepPlanner(model=MODEL, policy="minbytes", granularity=16, prefetch=True)
    cu = [0, 200, 300] if rank == 0 else [0, 20, 300]
    pending = planner.plan_async(cu)
    now = planner.plan([0, 150, 300])
    later = pending.result()
    again = planner.plan(cu)
    planner.close()
    return {"hashes": [now.hash, later.hash, again.hash], "current": planner.current is again}


def test_plan_async_makes_the_same_plan():
    results = run_ranks(prefetch_worker, 2, timeout=120)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    for r in results:
        now, later, again = r["result"]["hashes"]
        assert later == again and now != later and r["result"]["current"]


def test_named_backend_that_cannot_run_says_why():
    from distca.torch import BackendUnavailable, get_backend
    with pytest.raises(BackendUnavailable, match="runs on cuda, not cpu"):
        get_backend("varlen", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="must be one of"):
        get_backend("fast", torch.device("cpu"), torch.float32)
    assert get_backend("auto", torch.device("cpu"), torch.float16).name == "sdpa"   # distca takes fp32/bf16


def _server_tasks_with_key_splits():
    """One server's tasks (causal and non-causal) of a 3-rank minbytes plan that splits keys."""
    from distca.torch import rank_layout
    plan = distca.plan([[700, 40], [64] * 4, [300]], policy="minbytes", granularity=16, model=COST_MODEL)
    rows = [tuple(int(x) for x in r) for r in plan.batch.to_dict()["pieces"].tolist()]
    for server in range(plan.num_ranks):
        tasks = rank_layout(plan, plan.batch, rows, server, torch.device("cpu"), pingpong=False).parts[0].tasks
        if tasks.groups[0].num_tasks and tasks.groups[1].num_tasks:
            return tasks
    raise AssertionError("no server with causal and non-causal tasks")


def _server_inputs(tasks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, D, generator=gen) for n, h in
            ((tasks.num_q, HQ), (tasks.num_k, HKV), (tasks.num_k, HKV), (tasks.num_q, HQ))]


def test_flex_forward_on_cpu_equals_reference():
    """FlexAttention's mask over a server's whole task list (its backward is refused on CPU; the
    GPU check runs it)."""
    from distca.torch.kernels.pytorch import FlexKernel, ReferenceKernel
    tasks = _server_tasks_with_key_splits()
    q, k, v, _ = _server_inputs(tasks)
    want_o, want_lse = ReferenceKernel().forward(q, k, v, tasks, D ** -0.5)
    o, lse = FlexKernel().forward(q, k, v, tasks, D ** -0.5)
    assert (o - want_o).abs().max() <= 1e-5 * want_o.abs().max()
    assert (lse - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()


def test_lse_autograd_backward_equals_the_merged_row_formula():
    """The flex backward's rule (autograd through O and LSE with the merge's gradients) equals the
    reference's explicit backward given a merged O and LSE that differ from the part's own."""
    from distca.torch.kernels.pytorch import ReferenceKernel
    from distca.torch.kernels.server import lse_autograd_backward
    tasks = _server_tasks_with_key_splits()
    q, k, v, do = _server_inputs(tasks, 1)
    ref = ReferenceKernel()
    o_part, lse_part = ref.forward(q, k, v, tasks, D ** -0.5)
    # Pretend each row was merged with another part of its keys: LSE grows, O moves.
    other_lse = lse_part + torch.rand(lse_part.shape) - 0.5
    other_o = torch.randn(o_part.shape)
    lse = torch.logaddexp(lse_part, other_lse)
    o = torch.exp(lse_part - lse)[..., None] * o_part + torch.exp(other_lse - lse)[..., None] * other_o
    want = ref.backward(do, q, k, v, o, lse, tasks, D ** -0.5)
    got = lse_autograd_backward(lambda *x: ref.forward(*x, tasks, D ** -0.5), do, q, k, v, o, lse)
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max() <= 1e-5 * w.abs().max()


def static_buffers_worker(rank, world):
    from distca.torch import StepPlanner
    common = dict(model=MODEL, cost_model=COST_MODEL, policy="minbytes", granularity=16, pingpong=True)
    pooled = StepPlanner(static_buffers=True, buffer_capacity=1 << 20, **common)
    plain = StepPlanner(**common)
    rng = np.random.default_rng(3)
    allocations, identical = [], True
    for step in range(6):
        lengths, ranks = random_batch(rng, world, spanning=step % 2 == 1)
        pieces = ranks[rank]
        for layer in range(2):
            data = doc_data(lengths, 100 * step + layer)
            got = _run_layer(pooled.plan(pieces=pieces), data, pieces, "sdpa")
            want = _run_layer(plain.plan(pieces=pieces), data, pieces, "sdpa")
            identical &= all(torch.equal(a, b) for a, b in zip(got, want))
        allocations.append(pooled.buffers.allocations)
    return {"allocations": allocations, "identical": identical, "nbytes": pooled.buffers.nbytes}


def test_static_buffers_allocate_once_and_change_nothing():
    results = run_ranks(static_buffers_worker, 2, timeout=120)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    for r in results:
        allocations = r["result"]["allocations"]
        # Every slot (phase x nano-batch x tensor) is allocated in the first step, at the capacity,
        # and never again.
        assert r["result"]["identical"] and allocations[0] > 0 and len(set(allocations)) == 1, r
