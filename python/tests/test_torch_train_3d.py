"""The distca.torch trainer in three dimensions (--pp, --tp): CAD's lockstep schedule and
colocated Schedule1F1B train the same loss curve, tensor parallelism trains what one rank does,
the report's parts add up, and what cannot run is refused in one line with exit status 2."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from test_torch_train import _losses, _max_rel, _refusals, _train  # noqa: E402
from test_torch_train_memory import check_report as check_memory  # noqa: E402
from test_torch_trace import check_pipeline_trace  # noqa: E402

TINY = ["--preset", "tiny", "--steps", "3", "--kv-heads", "2", "--lr", "3e-3"]


@pytest.mark.parametrize("world, flags", [(2, ["--pp", "2"]), (4, ["--pp", "2", "--tp", "2"])])
def test_pipeline_compare_trains_one_curve_and_reports_parts_that_add_up(tmp_path, world, flags):
    report, trace = tmp_path / "t.json", tmp_path / "trace.json"
    out = _train(world, TINY + flags + ["--compare", "--json", str(report), "--trace", str(trace)], timeout=300)
    assert all(r["code"] == 0 for r in out), out[0]["stdout"]
    text = out[0]["stdout"]
    assert "rank 0: tp 0, stage 0, replica 0" in text and "bubble" in text
    doc = json.loads(report.read_text())
    assert doc["config"]["rank_map"]["pp"] == 2
    assert _max_rel(_losses(doc, "cad"), _losses(doc, "colocated")) < 1e-5
    for r in doc["steps"]:
        p, per = r["pipeline"], r["per_rank"]
        for w in range(world):
            assert per["forward_seconds"][w] + per["backward_seconds"][w] == pytest.approx(per["compute_seconds"][w])
            assert per["forward_seconds"][w] > 0 and per["backward_seconds"][w] > 0
            parts = per["plan_seconds"][w] + per["compute_seconds"][w] + per["serve_seconds"][w] + per["wait_seconds"][w]
            assert parts <= per["step_seconds"][w] + 1e-9
            assert parts + per["optimizer_seconds"][w] == pytest.approx(per["step_seconds"][w], rel=1e-6, abs=1e-6)
        assert 0 <= p["bubble"] < 1 and len(p["stages"]) == 2
        if r["backend"] == "cad":
            assert sum(s["served_idle_rows"] for s in p["stages"]) > 0
            assert {t["micro_batch"] for t in r["ticks"]} >= {None, 0}
        else:
            assert all(s["served_idle_rows"] == 0 for s in p["stages"])
    check_memory(doc)
    micro = doc["config"]["micro_batches"]
    check_pipeline_trace(json.loads(trace.read_text()), doc, 2 * micro + 2 * (2 - 1), tp=doc["config"]["rank_map"]["tp"])


def test_pipeline_with_documents_across_micro_batches(tmp_path):
    """--workload packed under --pp: documents cut at the micro-batch boundaries, the two
    backends on one curve."""
    report = tmp_path / "p.json"
    out = _train(2, TINY + ["--pp", "2", "--compare", "--workload", "packed", "--json", str(report)], timeout=300)
    assert all(r["code"] == 0 for r in out), out[0]["stdout"]
    doc = json.loads(report.read_text())
    assert _max_rel(_losses(doc, "cad"), _losses(doc, "colocated")) < 1e-5
    assert any(r["documents_spanning_ranks"] > 0 for r in doc["steps"])   # there were documents to cut


def test_tensor_parallel_trains_what_one_rank_does(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert _train(1, TINY + ["--json", str(one)])[0]["code"] == 0
    assert all(r["code"] == 0 for r in _train(2, TINY + ["--tp", "2", "--json", str(two)]))
    a, b = (json.loads(p.read_text()) for p in (one, two))
    assert _max_rel(_losses(b, "cad"), _losses(a, "cad")) < 1e-5


@pytest.mark.parametrize("flags", [["--pp", "2", "--compare"], ["--tp", "2"]])
def test_resume_under_pp_or_tp_repeats_the_curve(tmp_path, flags):
    """Steps 3..4 after resuming from step 2 equal a straight run's bit for bit: each rank of the
    replica saved and loaded under its own place; a resume under another rank map is refused."""
    common = TINY[:2] + TINY[4:] + flags
    straight, resumed, ck = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ck"
    assert [r["code"] for r in _train(2, common + ["--steps", "4", "--json", str(straight)])] == [0, 0]
    assert [r["code"] for r in _train(2, common + ["--steps", "2", "--checkpoint", str(ck)])] == [0, 0]
    head = json.loads((ck / "distca_train.json").read_text())
    assert head["rank_map"] == {"tp": 2 if "--tp" in flags else 1, "pp": 2 if "--pp" in flags else 1, "dp": 1}
    places = {e["name"].split("/")[1] for e in head["tensors"]["entries"]}
    assert places == ({"stage0.tp0", "stage1.tp0"} if "--pp" in flags else {"stage0.tp0", "stage0.tp1"})
    results = _train(2, common + ["--steps", "4", "--resume", str(ck), "--json", str(resumed)])
    assert [r["code"] for r in results] == [0, 0], results[0]["stdout"]
    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    for backend in {r["backend"] for r in a["steps"]}:
        want, got = _losses(a, backend)[2:], _losses(b, backend)
        assert len(got) == 2 and got == want, (backend, want, got)      # bit for bit (CPU, deterministic)
    other = ["--tp", "2", "--compare"] if "--pp" in flags else ["--pp", "2"]
    bad = _refusals(2, [[TINY[:2] + TINY[4:] + other + ["--steps", "4", "--resume", str(ck)]] * 2])[0]
    assert [r["code"] for r in bad] == [2, 2]
    assert 'field "rank_map"' in bad[0]["stdout"] and "resume with the same flags, ranks and data" in bad[0]["stdout"]


def test_what_cannot_run_is_refused_in_one_line():
    runs = [["--preset", "tiny", "--pp", "3"], ["--preset", "tiny", "--tp", "2"],
            ["--preset", "tiny", "--micro-batches", "4"],
            ["--preset", "tiny", "--pp", "2", "--backward", "stateful"],
            ["--preset", "tiny", "--pp", "2", "--compare", "--micro-batches", "1"],
            ["--preset", "tiny", "--pp", "2", "--kv-heads", "2", "--tp", "2"]]
    want = ["--pp 3: the model's 2 layers do not split into 3 stages", "--tp 2: each TP rank holds key/value heads",
            "--micro-batches applies with --pp > 1", "--pp with --backward stateful",
            "--micro-batches 1 < --pp 2", "--pp 2 x --tp 2 = 4 ranks a replica does not divide the world's 2 ranks"]
    results = _refusals(2, [[r, r] for r in runs])
    for run, expected, ranks in zip(runs, want, results):
        for rank in ranks:
            assert rank["code"] == 2, (run, rank)
        lines = [line for line in ranks[0]["stdout"].splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], (run, ranks[0]["stdout"])
