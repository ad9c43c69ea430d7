"""distca.torch's agreement: bad input on one rank only, or ranks in different calls, end every
rank within seconds with the same one-line InputError (the call header, distca.torch.cad.planner),
never with ranks waiting in a collective; and the argument checks behind it (cu_seqlens,
scale, backend, dtype, buffer_capacity, split_tasks, rank_layout, double backward).

The workers' default group and each case's planner group have a 20 s timeout, so a regression (a
rank left waiting) fails within seconds instead of at the default 30 minutes. One spawn runs
every two-rank case in turn, each with a planner of its own and followed by a good step (which
shows that both ranks are still in step); the tests below check each case's result."""
from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import distca  # noqa: E402
from distca.torch.spawn import run_ranks  # noqa: E402
from torch_cases import HKV, HQ, D, MODEL  # noqa: E402

# The module's fixture starts ranks once; its tests share one pytest-xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("torch_agreement")

GROUP_TIMEOUT_S = 20
SECONDS = 10        # every rank must have raised within this (the group's timeout is twice it)
CU = [0, 64, 100]   # every rank's documents in the cases below

# case -> what the message must hold (besides one line, the same on both ranks). Bad input is on
# rank 1 only; rank 0 makes the good call.
CASES = {
    "layout None": "cad_attention: rank 1: layout must be a StepLayout",
    "scale 'abc'": "cad_attention: rank 1: scale must be a finite positive number",
    "scale nan": "cad_attention: rank 1: scale must be a finite positive number (default 1/sqrt(head_dim)), got nan",
    "scale True": "cad_attention: rank 1: scale must be a finite positive number",
    "backend ['sdpa']": "cad_attention: rank 1: backend must be a backend's name or a ServerKernel instance, got list",
    "float64": "cad_attention: rank 1: q, k and v are torch.float64: cad_attention supports torch.float32, "
               "torch.bfloat16, torch.float16",
    "q shape": "cad_attention: rank 1: q has shape (100, 4, 17)",
    "plan vs cad_attention": "rank 0 is in StepPlanner.plan, rank 1 in cad_attention: every rank must make the same "
                             "calls in the same order",
    "plan vs plan_async": "rank 0 is in StepPlanner.plan, rank 1 in StepPlanner.plan_async: every rank must make the "
                          "same calls in the same order",
    "plan_async bad cu_seqlens": "StepPlanner.plan_async: rank 1: cu_seqlens must increase strictly",
    "cu_seqlens empty document": "StepPlanner.plan: rank 1: cu_seqlens must increase strictly: document 1 "
                                 "(cu_seqlens[1] = 10 to cu_seqlens[2] = 10) has length 0",
    "cu_seqlens dict": "StepPlanner.plan: rank 1: cu_seqlens must be a sequence (list, tuple), tensor or array of "
                       "integers, got dict",
}


def _inputs(dtype=torch.float32):
    q = torch.randn(CU[-1], HQ, D, dtype=dtype)
    k, v = torch.randn(CU[-1], HKV, D, dtype=dtype), torch.randn(CU[-1], HKV, D, dtype=dtype)
    return q, k, v


def _case(rank, planner, case):
    """Runs one case on this rank (rank 1 errs) and returns what it raised."""
    from distca.torch import cad_attention
    bad = rank == 1
    if case == "plan vs plan_async":
        return planner.plan_async(CU).result() if bad else planner.plan(CU)
    if case == "plan_async bad cu_seqlens":
        return planner.plan_async([0, 50, 50] if bad else CU).result()
    if case == "cu_seqlens empty document":
        return planner.plan([0, 10, 10, 5] if bad else CU)
    if case == "cu_seqlens dict":
        return planner.plan({0: 0, 1: 64, 2: 100} if bad else CU)
    layout = planner.plan(CU)
    q, k, v = _inputs(torch.float64 if bad and case == "float64" else torch.float32)
    kwargs: dict = {}
    if case == "plan vs cad_attention":
        return planner.plan(CU) if rank == 0 else cad_attention(q, k, v, layout)
    if bad:
        if case == "layout None":
            layout = None
        elif case.startswith("scale"):
            kwargs["scale"] = {"scale 'abc'": "abc", "scale nan": float("nan"), "scale True": True}[case]
        elif case == "backend ['sdpa']":
            kwargs["backend"] = ["sdpa"]
        elif case == "q shape":
            q = torch.randn(CU[-1], HQ, D + 1)
    return cad_attention(q, k, v, layout, **kwargs)


def _good_step(planner):
    """A step every rank makes alike: plan, forward and backward."""
    from distca.torch import cad_attention
    layout = planner.plan(CU)
    q, k, v = (x.requires_grad_() for x in _inputs())
    o = cad_attention(q, k, v, layout)
    o.sum().backward()
    return bool(torch.isfinite(o).all() and torch.isfinite(q.grad).all())


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]


def _fresh_planner(**kwargs):
    """A planner over a new gloo group with the short timeout."""
    from distca.torch import StepPlanner
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    return StepPlanner(group, model=MODEL, policy="minbytes", granularity=16, **kwargs), group


def agreement_worker(rank, world, cases):
    from distca.torch import InputError, StepPlanner, cad_attention
    results = {}
    for case in cases:
        # A planner of its own per case, so a regression in one case leaves the next its own group.
        raised, seconds, recovered = None, None, "no planner"
        try:
            planner, _ = _fresh_planner(prefetch=True)
            start = time.time()
            try:
                _case(rank, planner, case)
            except InputError as e:
                raised = str(e)
            finally:
                seconds = time.time() - start
            recovered = _good_step(planner)
        except Exception as e:  # noqa: BLE001 (a regression: reported, and the rest goes on)
            raised = raised or f"not an InputError: {type(e).__name__}: {_one_line(e)}"
            recovered = f"{type(e).__name__}: {_one_line(e)}"
        results[case] = {"raised": raised, "seconds": seconds, "recovered": recovered}
    # Double backward: refused with a clear message on every rank, before any collective.
    planner, group = _fresh_planner()
    try:
        layout = planner.plan(CU)
        q, k, v = (x.requires_grad_() for x in _inputs())
        o = cad_attention(q, k, v, layout)
        torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
        results["double backward"] = {"raised": None}
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        results["double backward"] = {"raised": str(e)}
    try:
        results["double backward"]["recovered"] = _good_step(planner)
    except Exception as e:  # noqa: BLE001
        results["double backward"]["recovered"] = f"{type(e).__name__}: {e}"
    # Arguments StepPlanner refuses at construction (no collective before them).
    for name, kwargs in (("tolerance 2", dict(tolerance=2)), ("max_rank_bytes -1", dict(max_rank_bytes=-1)),
                         ("buffer_capacity 4 EiB", dict(static_buffers=True, buffer_capacity=4 << 60))):
        try:
            StepPlanner(group, model=MODEL, **kwargs)
            results[name] = {"raised": None}
        except (TypeError, ValueError) as e:
            results[name] = {"raised": f"{type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def agreement():
    # The default group with the short timeout too: a rank left waiting anywhere fails fast.
    results = run_ranks(agreement_worker, 2, list(CASES), timeout=120, group_timeout=GROUP_TIMEOUT_S)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    return [r["result"] for r in results]


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_wrong_raises_the_same_input_error_on_every_rank_within_seconds(agreement, case):
    got = [r[case] for r in agreement]
    messages = {g["raised"] for g in got}
    print(f"\n{case}: {messages} in {[g['seconds'] and round(g['seconds'], 2) for g in got]} s")
    assert len(messages) == 1 and None not in messages, got
    message = messages.pop()
    assert CASES[case] in message, message
    assert "\n" not in message and "--" not in message, message
    assert all(g["seconds"] is not None and g["seconds"] < SECONDS for g in got), got
    assert all(g["recovered"] is True for g in got), got


def test_double_backward_is_refused_with_a_clear_message(agreement):
    for r in agreement:
        assert r["double backward"]["raised"] is not None, r["double backward"]
        assert r["double backward"]["raised"].startswith(
            "cad_attention does not support double backward (create_graph=True)"), r["double backward"]
        assert r["double backward"]["recovered"] is True


@pytest.mark.parametrize("name, expected", [
    ("tolerance 2", "ValueError: tolerance must be in [0, 1]"),
    ("max_rank_bytes -1", "ValueError: max_rank_bytes must be a whole number of bytes"),
    ("buffer_capacity 4 EiB", "ValueError: buffer_capacity 4611686018427387904 bytes is more than "),
])
def test_planner_arguments_are_refused_in_python_terms(agreement, name, expected):
    for r in agreement:
        message = r[name]["raised"]
        assert message is not None and message.startswith(expected), message
        assert "--" not in message and "\n" not in message, message


# ---------------------------------------------------------------------------------------------
# Local checks (no process group needed)

def _plan_and_rows():
    plan = distca.plan([[700, 40], [64] * 4, [300]], policy="minbytes", granularity=16,
                       model={"heads": HQ, "kv_heads": HKV, "head_dim": D, "layers": 1, "hidden": HQ * D,
                              "ffn_hidden": 4 * HQ * D})
    rows = [tuple(int(x) for x in r) for r in plan.batch.to_dict()["pieces"].tolist()]
    return plan, rows


def test_cad_attention_without_any_planner_raises_at_once():
    from distca.torch import InputError, cad_attention
    q, k, v = _inputs()
    with pytest.raises(InputError, match=r"^cad_attention: layout must be a StepLayout .*no StepPlanner in this "):
        cad_attention(q, k, v, None)


SPLIT_TASKS_ERRORS = [   # make(tasks, batch) -> (args, kwargs) of split_tasks
    (lambda t, b: (([1, 2, 3], b), {}), TypeError, r"tasks must be a one-dimensional array of distca.TASK_DTYPE"),
    (lambda t, b: ((np.zeros(3), b), {}), TypeError, r"tasks must be a one-dimensional array of distca.TASK_DTYPE"),
    (lambda t, b: ((t.view(np.int64).reshape(-1, 6), b), {}), TypeError, r"got an array of int64, shape"),
    (lambda t, b: ((t[["doc", "q0", "q1"]], b), {}), ValueError, r"tasks: no field 'k0'"),
    (lambda t, b: ((t, 3), {}), TypeError, r"batch must be a distca.Batch \(the plan's batch, Plan.batch\), got int 3"),
    (lambda t, b: ((t, distca.pack([8], 1, 8)), {}), ValueError,
     r"tasks\[\d+\]: server 1 outside \[0, 1\) \(the batch's 1 ranks\)"),
    (lambda t, b: ((np.array([(0, 5, 2, 0, 2, 0)] * 3, dtype=distca.TASK_DTYPE), b), {}), ValueError,
     r"tasks\[0\]: need 0 <= doc < 7 \(the batch's documents\), 0 <= q0 < q1"),
    (lambda t, b: ((np.array([(0, 0, 900, 0, 900, 0)], dtype=distca.TASK_DTYPE), b), {}), ValueError,
     r"tasks\[0\]: rows past the end of document 0 \(700 tokens\)"),
    (lambda t, b: ((t, b), {"tolerance": 2}), ValueError, r"tolerance must be in \[0, 1\]"),
    (lambda t, b: ((t, b), {"tolerance": "x"}), TypeError, r"tolerance must be a number"),
    (lambda t, b: ((t, b), {"kv_budget": -0.1}), ValueError, r"kv_budget must be in \[0, 1\]"),
]


@pytest.mark.parametrize("make, error, match", SPLIT_TASKS_ERRORS)
def test_split_tasks_refuses_bad_input_in_one_line(make, error, match):
    from distca.torch import split_tasks
    plan, _ = _plan_and_rows()
    args, kwargs = make(plan.tasks, plan.batch)
    with pytest.raises(error, match=match) as raised:
        split_tasks(*args, **kwargs)
    assert raised.type is error and "\n" not in str(raised.value)


RANK_LAYOUT_ERRORS = [
    (dict(rank=3), ValueError, r"rank 3 outside the batch's 3 ranks"),
    (dict(rank=-1), ValueError, r"rank -1 outside the batch's 3 ranks"),
    (dict(rank="0"), TypeError, r"rank must be an integer, got '0'"),
    (dict(rows=[]), ValueError, r"rows: rank 0's rows are not the batch's pieces of rank 0"),
    (dict(rows=[(0, 1)]), TypeError, r"rows must be the batch's pieces, \(doc, begin, end, rank\) rows of integers"),
    (dict(plan=None), TypeError, r"plan must be a distca.Plan"),
    (dict(batch=None), TypeError, r"batch must be a distca.Batch"),
    (dict(batch="other"), ValueError, r"batch has 2 ranks, the plan 3"),
    (dict(device=3.5), TypeError, r"device must be a torch.device or a device name"),
    (dict(pingpong="yes"), TypeError, r"pingpong must be a bool"),
]


@pytest.mark.parametrize("change, error, match", RANK_LAYOUT_ERRORS)
def test_rank_layout_refuses_bad_input_in_one_line(change, error, match):
    from distca.torch import rank_layout
    plan, rows = _plan_and_rows()
    args = dict(plan=plan, batch=plan.batch, rows=rows, rank=0, device=torch.device("cpu"), pingpong=False)
    args.update(change)
    if args["batch"] == "other":
        args["batch"] = distca.plan([[10], [20]]).batch
    with pytest.raises(error, match=match) as raised:
        rank_layout(args["plan"], args["batch"], args["rows"], args["rank"], args["device"], pingpong=args["pingpong"])
    assert raised.type is error and "\n" not in str(raised.value)


def test_rank_layout_of_the_batchs_pieces_still_works():
    from distca.torch import rank_layout
    plan, rows = _plan_and_rows()
    for rank in range(plan.num_ranks):
        layout = rank_layout(plan, plan.batch, rows, rank, "cpu", pingpong=True)
        assert layout.serial == 0 and layout.planner_id == 0
        assert layout.num_local_rows == sum(e - b for _, b, e, r in rows if r == rank)


def test_simulate_names_arguments_not_flags():
    with pytest.raises(ValueError, match=r"^simulate: tolerance_sweep must be on or off, got 'x'$"):
        distca.simulate(tolerance_sweep="x")
