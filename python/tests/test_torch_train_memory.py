"""The trainer's memory figures (distca.torch.train.memory): the saved-tensor counter against
graphs whose saved bytes are known, and the parts of a rank's figure adding up."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from distca.torch.train import memory  # noqa: E402


def test_saved_bytes_counts_each_storage_once_and_lets_go_with_the_graph():
    w = torch.nn.Parameter(torch.randn(1000))
    x = torch.randn(1000, requires_grad=True)
    counter = memory.SavedBytes(exclude=[w])
    with counter.hooks():
        y = torch.tanh(x)               # saves its output: a new 4,000-byte storage
        a = (x * w).sum()               # saves x (4,000 bytes) and w (a parameter: not counted)
        b = (x[:10] * x[500:510]).sum()   # two views of x: its storage again, not counted twice
        loss = y.sum() + a + b
    assert counter.live == 8000 and counter.peak == 8000
    loss.backward()
    del loss, y, a, b
    assert counter.live == 0 and counter.peak == 8000
    counter.reset_peak()
    assert counter.peak == 0
    with torch.no_grad(), counter.hooks():
        torch.tanh(x)
    assert counter.peak == 0                   # nothing saved without a graph


def test_states_are_parameters_gradients_and_adamw_moments():
    model = torch.nn.Linear(10, 20)            # 220 parameters
    opt = torch.optim.AdamW(model.parameters())
    assert memory.states_bytes(model, opt) == 2 * 220 * 4     # before the first step: no moments
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    assert memory.states_bytes(model, opt) == 4 * 220 * 4


def test_a_step_record_adds_up_and_names_the_fullest_rank():
    per_rank = {"memory_states_bytes": [100, 100], "memory_saved_bytes": [50, 90], "memory_exchange_bytes": [0, 10],
                "memory_other_bytes": [0, 0]}
    per_rank["memory_bytes"] = [sum(per_rank[f"memory_{k}_bytes"][r] for k in memory.MEMORY_PARTS) for r in range(2)]
    rec = memory.record(per_rank)
    assert rec["fullest_rank"] == 1 and rec["max_bytes"] == 200 and rec["mean_bytes"] == 175
    assert rec["max_over_mean"] == pytest.approx(200 / 175)
    assert sum(rec["fullest_parts"].values()) == rec["max_bytes"]
    mine = memory.step_memory(100, 90, 10, torch.device("cpu"))
    assert mine["memory_bytes"] == 200 and mine["memory_other_bytes"] == 0


def check_report(doc: dict) -> None:
    """Every step's memory in a trainer's JSON: each rank's parts add up to its figure, which its
    process's peak RSS holds; the record's max and max/mean are those of the ranks' figures; the
    summary's fullest rank is the largest step figure."""
    for r in doc["steps"]:
        per, m = r["per_rank"], r["memory"]
        totals = per["memory_bytes"]
        for w, total in enumerate(totals):
            assert sum(per[f"memory_{k}_bytes"][w] for k in memory.MEMORY_PARTS) == total
            assert 0 < total <= per["rss_peak_bytes"][w], (w, total, per["rss_peak_bytes"][w])
            assert per["memory_saved_bytes"][w] > 0
        assert m["max_bytes"] == max(totals) and m["max_over_mean"] == pytest.approx(max(totals) / (sum(totals) / len(totals)))
    for name, b in doc["summary"]["backends"].items():
        assert b["memory_max_bytes"] == max(r["memory"]["max_bytes"] for r in doc["steps"] if r["backend"] == name)


@pytest.mark.parametrize("pingpong", [False, True])
def test_server_rows_are_the_gathers_each_rank_runs(pingpong):
    """The rows the state budget counts for every rank (from the plan, alike on every rank) are
    the Q and K/V rows each rank's own layout gathers for its kernels."""
    import distca
    from distca.torch import rank_layout
    from torch_cases import COST_MODEL
    batch = distca.pack([3000, 40, 200, 900, 17, 1500, 2200], 4, 2048, overflow="cut")
    plan = distca.plan(batch, model=COST_MODEL, tolerance=0.05, granularity=32)
    rows = batch.to_dict()["pieces"]
    for rank in range(4):
        layout = rank_layout(plan, batch, rows, rank, "cpu", pingpong=pingpong)
        q_rows, kv_rows, own = layout.server_rows
        assert q_rows[rank] == sum(len(p.q_gather) for p in layout.parts)
        assert kv_rows[rank] == sum(len(p.kv_gather) for p in layout.parts)
        assert own[rank] == layout.num_local_rows
    assert (q_rows > own).any()       # the plan moved work: some server computes more rows than it owns


def test_the_state_budget_keeps_as_many_calls_as_fit_on_the_fullest_rank():
    import distca
    from distca.torch import ModelShape, rank_layout
    from torch_cases import COST_MODEL
    batch = distca.pack([4000, 30, 30, 30, 30, 30, 30, 30, 30, 30], 2, 2048, overflow="cut")
    plan = distca.plan(batch, model=COST_MODEL, tolerance=0.05, granularity=32)
    layout = rank_layout(plan, batch, batch.to_dict()["pieces"], 0, "cpu", pingpong=False)
    layout.model = ModelShape(4, 2, 8)
    q_rows, kv_rows, own = layout.server_rows
    extra = int(((q_rows * 32 + kv_rows * 32 - own * 64) * 4).max())
    assert extra > 0 and layout.extra_state_bytes(torch.float32) == extra
    assert layout.extra_state_bytes(torch.bfloat16) == extra // 2
    for budget, kept in ((None, 5), (0, 0), (extra - 1, 0), (extra, 1), (3 * extra + 5, 3)):
        layout.state_budget, layout.kept_calls, layout.stateless_calls = budget, 0, 0
        assert [layout.keeps_state(torch.float32) for _ in range(5)] == [True] * kept + [False] * (5 - kept)
        assert (layout.kept_calls, layout.stateless_calls) == (kept, 5 - kept)
    layout.backward, layout.kept_calls = "stateless", 0
    assert not layout.keeps_state(torch.float32) and layout.kept_calls == 0


def budget_worker(rank, world, num_batches, seed):
    """Random batches, 3 layers through one layout: the bytes the autograd graph actually saves
    (saved-tensor hooks) with the state budget, against the same layers stateless; per batch the
    budget is half of what every layer stateful would take on the fullest rank."""
    import numpy as np
    import torch.distributed as dist
    from distca.torch import StepPlanner, cad_attention
    from torch_cases import COST_MODEL, MODEL, doc_data, local_rows, random_batch
    layers, out = 3, []
    planners = {b: StepPlanner(model=MODEL, cost_model=COST_MODEL, policy="minbytes", granularity=16, backward=b,
                               state_budget=None, backend="sdpa") for b in ("stateful", "stateless")}
    rng = np.random.default_rng(seed)
    for b in range(num_batches):
        lengths, ranks = random_batch(rng, world, b % 2 == 1)
        data = doc_data(lengths, seed * 1000 + b)
        pieces = [(doc, begin, end, n) for doc, begin, end, n in ranks[rank]]
        layouts = {k: p.plan(pieces=pieces) for k, p in planners.items()}
        extra = layouts["stateful"].extra_state_bytes(torch.float32)
        budgets = {"unlimited": None, "half": layers * extra // 2, "zero": 0}
        saved = {}
        for name, budget in (("stateless", None),) + tuple(budgets.items()):
            layout = layouts["stateless" if name == "stateless" else "stateful"]
            layout.state_budget, layout.kept_calls, layout.stateless_calls = budget, 0, 0
            counter = memory.SavedBytes()
            q, k, v = (local_rows([d[i] for d in data], pieces).requires_grad_() for i in range(3))
            with counter.hooks():   # each layer its own Q/K/V (a copy), as in a model
                o = sum(cad_attention(q * 1.0, k * 1.0, v * 1.0, layout) for _ in range(layers))
            saved[name] = counter.peak
            o.backward(torch.ones_like(o))
        out.append({"extra": extra, "budgets": budgets, "saved": saved})
    for p in planners.values():
        p.finish()
    return out


def test_the_state_budget_bounds_what_the_servers_actually_keep():
    from distca.torch.spawn import run_ranks
    results = run_ranks(budget_worker, 2, 12, 5, timeout=300)
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    over = 0
    for batches in zip(*(r["result"] for r in results)):
        for rank_batch in batches:
            s, budgets = rank_batch["saved"], rank_batch["budgets"]
            for name in ("half", "zero"):
                assert s[name] - s["stateless"] <= budgets[name], (name, rank_batch)
        fullest = max(batches, key=lambda x: x["saved"]["unlimited"] - x["saved"]["stateless"])
        over += fullest["saved"]["unlimited"] - fullest["saved"]["stateless"] > fullest["budgets"]["half"]
    assert over >= 3, over     # without a budget the fullest rank keeps more than half of it: the bound bites


@pytest.mark.parametrize("argv, message", [
    (["--state-budget", "-1"], "must be unlimited or MiB from 0, got '-1'"),
    (["--state-budget", "nan"], "must be unlimited or MiB from 0, got 'nan'"),
    (["--state-budget", "1", "--backward", "stateless"], "--state-budget would be ignored with --backward stateless"),
    (["--state-budget", "1", "--pp", "2"], "--state-budget would be ignored with --pp"),
    (["--state-budget", "1", "--attention", "colocated"], "would be ignored with --attention colocated"),
])
def test_bad_state_budgets_are_one_line_exit_2(argv, message, capsys):
    from test_torch_train_outputs import _refused
    _refused(["--preset", "tiny"] + argv, capsys, contains=message)


def test_step_planner_refuses_a_bad_state_budget():
    from distca.torch.spawn import run_ranks
    (res,) = run_ranks(_planner_budget_worker, 1, timeout=120)
    assert res["error"] is None, res["error"]
    assert all(m is not None and "state_budget must be a non-negative integer" in m for m in res["result"])


def _planner_budget_worker(rank, world):
    from distca.torch import StepPlanner
    out = []
    for bad in (-1, 1.5, True, "x"):
        try:
            StepPlanner(model={"heads": 2, "kv_heads": 1, "head_dim": 8}, state_budget=bad)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out
