"""Faults that used to get through distca.torch (issue 72, its rows 7 and 14), one test per case:

- row 7: a second backward through cad_attention's default (stateful) backward with
  retain_graph=True: it raised TypeError; now it gives the same gradients again (2x one backward's,
  accumulated), equal to the reference kernel's, and a third without retain_graph PyTorch's own
  "backward through the graph a second time" error;
- row 14: a scale that is inf or 0 once rounded to float32 (1e300, 1e-300), the precision the
  kernels compute in, is refused by cad_attention and by the distca ops.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from distca.torch import ops  # noqa: E402
from distca.torch.spawn import run_ranks  # noqa: E402
from torch_cases import COST_MODEL, HKV, HQ, doc_data, local_rows, whole_document  # noqa: E402

D = 32   # a head dim distca's CPU kernels are built for, so `auto` runs them on an AVX2 or AVX-512 CPU
# Document 0 spans both ranks, so the plan moves rows and splits some rows' keys.
LENGTHS = [300, 40, 200]
PIECES = [[(0, 0, 250, 300)], [(0, 250, 300, 300), (1, 0, 40, 40), (2, 0, 200, 200)]]


def _grads(q, k, v):
    return [x.grad.detach().clone() for x in (q, k, v)]


def _max_rel(got, want) -> float:
    return max(float((g.double() - w.double()).abs().max() / w.double().abs().max()) for g, w in zip(got, want))


def faults_worker(rank, world):
    """Every case that needs a process group, each caught on its own so each test reports its own."""
    from distca.torch import StepPlanner, cad_attention
    model = {"heads": HQ, "kv_heads": HKV, "head_dim": D}
    data = doc_data(LENGTHS, 72, head_dim=D)
    pieces = PIECES[rank]
    truth = [local_rows([whole_document(*d)[i] for d in data], pieces) for i in range(4)]
    rows = [local_rows([d[i] for d in data], pieces).contiguous() for i in range(4)]
    out: dict = {}

    def leaves(dtype=torch.float32):
        return [x.detach().to(dtype).clone().requires_grad_() for x in rows[:3]]

    # Row 7: twice through the default (stateful) backward, then once more without retain_graph.
    for pingpong in (False, True):
        case = out[f"row7 pingpong={pingpong}"] = {}
        try:
            planner = StepPlanner(model=model, cost_model=COST_MODEL, policy="minbytes", granularity=16,
                                  pingpong=pingpong)
            layout = planner.plan(pieces=pieces)
            case["parts"], case["backward"] = len(layout.parts), layout.backward
            q, k, v = leaves()
            cad_attention(q, k, v, layout, backend="reference").backward(rows[3])
            reference = _grads(q, k, v)
            q, k, v = leaves()
            o = cad_attention(q, k, v, layout)
            o.backward(rows[3], retain_graph=True)
            once = _grads(q, k, v)
            o.backward(rows[3])
            twice = _grads(q, k, v)
            case["once_vs_truth"] = _max_rel(once, truth[1:])
            case["once_vs_reference"] = _max_rel(once, reference)
            case["twice_vs_2x_reference"] = _max_rel(twice, [2 * g for g in reference])
            case["twice_is_2x_once"] = all(torch.equal(t, 2 * g) for t, g in zip(twice, once))
            try:
                o.backward(rows[3])
                case["third"] = None
            except RuntimeError as e:
                case["third"] = str(e).splitlines()[0]
        except Exception as e:  # noqa: BLE001 (the test reports it)
            case["error"] = f"{type(e).__name__}: {e}"
    # Row 14: scales that float32 turns into inf or 0, refused on every rank; a tiny finite one runs.
    planner = StepPlanner(model=model, cost_model=COST_MODEL, policy="minbytes", granularity=16)
    layout = planner.plan(pieces=pieces)
    for name, scale, dtype in (("1e300", 1e300, torch.float32), ("1e-300", 1e-300, torch.float32),
                               ("1e-300 bf16", 1e-300, torch.bfloat16), ("1e39", 1e39, torch.float32),
                               ("10**400", 10 ** 400, torch.float32), ("1e-30", 1e-30, torch.float32)):
        try:
            o = cad_attention(*leaves(dtype), layout, scale=scale)
            out[f"row14 {name}"] = {"accepted": True, "finite": bool(torch.isfinite(o).all())}
        except ValueError as e:   # InputError is a ValueError
            out[f"row14 {name}"] = {"accepted": False, "error": str(e)}
    return out


@pytest.fixture(scope="module")
def faults():
    results = run_ranks(faults_worker, 2, timeout=120)
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, errors[0]
    return [r["result"] for r in results]


# --- Row 7 ---

@pytest.mark.parametrize("pingpong", [False, True])
def test_row7_stateful_backward_twice_with_retain_graph(faults, pingpong):
    for rank, result in enumerate(faults):
        case = result[f"row7 pingpong={pingpong}"]
        assert "error" not in case, f"rank {rank}: {case['error']}"
        assert case["backward"] == "stateful"
        if pingpong:
            assert case["parts"] == 2, case   # both nano-batches' server state saved and found again
        assert case["once_vs_truth"] <= 1e-5 and case["once_vs_reference"] <= 1e-5, case
        assert case["twice_vs_2x_reference"] <= 1e-5, case
        assert case["twice_is_2x_once"], case   # the second backward computed exactly the first's gradients
        # Without retain_graph the saved state is freed, as for any PyTorch op.
        assert case["third"] is not None and "backward through the graph a second time" in case["third"], case


# --- Row 14 ---

@pytest.mark.parametrize("name, fp32", [("1e300", "inf"), ("1e-300", "0"), ("1e-300 bf16", "0"), ("1e39", "inf"),
                                        ("10**400", None)])
def test_row14_scale_not_finite_and_positive_in_float32_is_refused(faults, name, fp32):
    for result in faults:
        case = result[f"row14 {name}"]
        assert not case["accepted"], f"scale {name} accepted ({case})"
        message = case["error"]
        assert "\n" not in message and message.startswith("cad_attention: rank ") and \
            "scale must be a finite positive number" in message, message
        if fp32 is not None:
            assert f"which is {fp32} in float32" in message, message


def test_row14_scale_finite_in_float32_still_runs(faults):
    for result in faults:
        assert result["row14 1e-30"] == {"accepted": True, "finite": True}


@pytest.mark.parametrize("scale, fp32", [(1e300, "inf"), (1e-300, "0"), (float("inf"), None), (-1.0, None), (0.0, None)])
def test_row14_scale_refused_by_the_distca_ops(scale, fp32):
    g = torch.Generator().manual_seed(14)
    q, do = (torch.randn(64, 4, D, generator=g) for _ in range(2))
    k, v = (torch.randn(64, 2, D, generator=g) for _ in range(2))
    tasks = torch.tensor([[0, 64, 0, 64, 1]], dtype=torch.int64)
    for call in (lambda: ops.attention_fwd(q, k, v, tasks, scale),
                 lambda: ops.attention_bwd(do, q, k, v, q, torch.zeros(64, 4), tasks, scale)):
        with pytest.raises(ValueError, match="scale must be a finite positive number") as e:
            call()
        assert fp32 is None or f"which is {fp32} in float32" in str(e.value)
    assert ops.scale_problem(D ** -0.5) is None and ops.scale_problem(None) is None
