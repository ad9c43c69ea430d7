"""distca.torch in pipeline parallelism: ranks with no rows serve (cad_serve), and the lockstep
CAD schedule (ScheduleCADLockstep) against one process and PyTorch's Schedule1F1B."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from pipeline_cases import MICRO_BATCHES, one_process, pipeline_worker, serve_worker  # noqa: E402

from distca.torch.spawn import run_ranks  # noqa: E402
from sizes import soak  # noqa: E402


def ok(results):
    for r, res in enumerate(results):
        assert res["error"] is None, f"rank {r}: {res['error']}"
    return [res["result"] for res in results]


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_a_rank_with_no_rows_serves(backward):
    r0, r1, r2 = ok(run_ranks(serve_worker, 3, backward, timeout=300))
    assert r2["local_rows"] == 0 and r2["served_rows"] > 0, r2
    for r in (r0, r1):
        assert max(r["errors"].values()) < 1e-5, r["errors"]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def merged_params(results) -> dict:
    """Every stage's parameters of replica 0 -> one state dict (the replicas agree: checked)."""
    out = {}
    for res in results:
        for k, v in res["params"].items():
            if res["replica"] == 0:
                out[k] = v
    for res in results:
        for k, v in res["params"].items():
            assert rel(v, out[k]) == 0.0, f"replica {res['replica']} differs in {k}"
    return out


@pytest.fixture(scope="module")
def pp2_dp2():
    steps = 3
    return {"one": one_process(steps, replicas=2),
            "cad": ok(run_ranks(pipeline_worker, 4, 2, "cad", steps, timeout=600)),
            "1f1b": ok(run_ranks(pipeline_worker, 4, 2, "1f1b", steps, timeout=600))}


@pytest.mark.xdist_group("torch_pipeline")
@pytest.mark.parametrize("mode", ["cad", "1f1b"])
def test_pp2_dp2_equals_one_process(pp2_dp2, mode):
    one, results = pp2_dp2["one"], pp2_dp2[mode]
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    assert rel(losses, one["losses"]) < 1e-5, (losses, one["losses"])
    params = merged_params(results)
    assert sorted(params) == sorted(one["params"])
    worst = max(rel(params[k], one["params"][k]) for k in params)
    assert worst < 1e-5, worst
    other = merged_params(pp2_dp2["1f1b" if mode == "cad" else "cad"])
    assert max(rel(params[k], other[k]) for k in params) < 1e-5


@pytest.mark.xdist_group("torch_pipeline")
def test_idle_stages_serve_what_the_plan_gives_them(pp2_dp2):
    P = 2
    warm_cool = set(range(P - 1)) | set(range(2 * MICRO_BATCHES + P - 1, 2 * MICRO_BATCHES + 2 * (P - 1)))
    for res in pp2_dp2["cad"]:
        for step in res["ticks"]:
            assert len(step) == 2 * MICRO_BATCHES + 2 * (P - 1)
            for t in step:
                assert t["served_rows"] == t["planned_rows"], t
                if t["micro_batch"] is None:
                    assert t["local_rows"] == 0
                    if t["tick"] in warm_cool:
                        assert t["served_rows"] > 0, (res["stage"], t)


@pytest.mark.xdist_group("torch_pipeline")
def test_prefetch_plans_the_next_tick_beside_this_one(pp2_dp2):
    """With the planner's prefetch, tick t + 1 is planned on its thread: the same step."""
    results = ok(run_ranks(pipeline_worker, 4, 2, "cad", 1, True, timeout=300))
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    want = next(r["losses"] for r in pp2_dp2["cad"] if r["losses"] is not None)
    assert losses == want[:1]
    for res, ref in zip(results, pp2_dp2["cad"]):
        assert [t["planned_rows"] for t in res["ticks"][0]] == [t["planned_rows"] for t in ref["ticks"][0]]


@pytest.mark.xdist_group("torch_tensor_parallel")
def test_tp2_dp2_equals_one_process_and_moves_half_the_bytes():
    from pipeline_cases import one_process_grads, tp_worker
    one = one_process_grads(replicas=2)
    tp2 = ok(run_ranks(tp_worker, 4, 2, timeout=300))
    tp1 = ok(run_ranks(tp_worker, 2, 1, timeout=300))
    for res in tp2 + tp1:
        assert rel(res["loss"], one["loss"]) < 1e-5, (res["loss"], one["loss"])
        worst = max(rel(res["grads"][k], one["grads"][k]) for k in one["grads"])
        assert worst < 1e-5, worst
    # Each TP rank's exchanges carry its own head group: half the bytes of the same plan at TP 1.
    for res in tp2:
        same = next(r for r in tp1 if r["replica"] == res["replica"])
        assert res["hash"] == same["hash"]
        assert same["sent_bytes"] > 0 and 2 * res["sent_bytes"] == same["sent_bytes"], (res, same)


@pytest.mark.xdist_group("torch_3d")
def test_pp2_tp2_dp2_equals_one_process():
    steps = soak(1, 3)   # 8 processes on the suite's 2 cores: one AdamW step; 3 under scripts/test.sh --long
    one = one_process(steps, replicas=2)
    results = ok(run_ranks(pipeline_worker, 8, 2, "cad", steps, False, 2, timeout=600))
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    assert rel(losses, one["losses"]) < 1e-5, (losses, one["losses"])
    params = merged_params(results)
    assert max(rel(params[k], one["params"][k]) for k in one["params"]) < 1e-5
    for res in results:
        for step in res["ticks"]:
            assert all(t["served_rows"] == t["planned_rows"] for t in step)


@pytest.mark.parametrize("fault", ["skip", "table"])
def test_a_rank_that_skips_a_tick_or_walks_another_table_fails_every_rank(fault):
    results = ok(run_ranks(pipeline_worker, 4, 2, "cad", 1, False, 1, fault, timeout=120, group_timeout=30))
    messages = {r["error"] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("InputError: ScheduleCADLockstep: the ranks are at different ticks"), message
    assert "rank 1 (stage 0) at tick" in message
    assert max(r["seconds"] for r in results) < 10


def test_tp_ranks_that_plan_different_documents_fail_every_rank():
    from pipeline_cases import tp_mismatch_worker
    results = ok(run_ranks(tp_mismatch_worker, 2, timeout=120, group_timeout=30))
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages, messages
    assert "the TP ranks of a replica made different plans" in messages.pop()
    assert max(r["seconds"] for r in results) < 10
