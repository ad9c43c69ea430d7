"""Faults that used to get through distca.torch (issue 72), one test per case:

- row 7: a second backward through cad_attention's default (stateful) backward with
  retain_graph=True: it raised TypeError; now it gives the same gradients again (2x one backward's,
  accumulated), equal to the reference kernel's, and a third without retain_graph PyTorch's own
  "backward through the graph a second time" error.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
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
