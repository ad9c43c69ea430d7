"""The trainer's --trace (distca.torch.trace): a Chrome trace-event file with every rank's spans,
whose step spans are the step records' and whose phases add up to them; exchanges hidden behind
the server kernels under ping-pong and not without; the last --trace-steps steps kept."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from test_torch_train import _train  # noqa: E402

from distca.torch import trace_report  # noqa: E402

DEMO = ["--preset", "demo", "--context", "1024", "--steps", "4", "--trace-steps", "2"]


def _spans(doc: dict) -> list:
    events = doc["traceEvents"]
    for ev in events:
        assert ev["ph"] in ("X", "M") and isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and isinstance(ev["ts"], float) and ev["name"], ev
    return [ev for ev in events if ev["ph"] == "X"]


@pytest.mark.parametrize("pingpong", ["on", "off"])
def test_trace_spans_are_the_steps_and_the_exchanges_hide_under_pingpong(tmp_path, pingpong):
    path, report = tmp_path / "t.json", tmp_path / "r.json"
    flags = ["--compare"] if pingpong == "on" else ["--attention", "cad"]
    out = _train(2, DEMO + flags + ["--pingpong", pingpong, "--trace", str(path), "--json", str(report)], timeout=300)
    assert all(r["code"] == 0 for r in out), out[0]["stdout"]
    doc = json.loads(path.read_text())        # loads as JSON: trace events, a process a rank
    assert doc["otherData"]["format"] == "distca-trace"
    spans = _spans(doc)
    names = {ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    records = {(r["step"], r["backend"]): r for r in json.loads(report.read_text())["steps"]}
    backends = {b for _, b in records}
    steps = [ev for ev in spans if ev["name"] == "step"]
    # The last 2 steps of each backend, on each rank (--trace-steps 2 of 4).
    assert sorted((ev["pid"], ev["args"]["step"]) for ev in steps) == sorted(
        (rank, f"{s} {b}") for rank in (0, 1) for s in (3, 4) for b in backends)
    for ev in steps:
        step, backend = ev["args"]["step"].split(" ")
        want = records[int(step), backend]["per_rank"]["step_seconds"][ev["pid"]]
        assert ev["dur"] / 1e6 == pytest.approx(want, rel=0.02), (ev, want)
        parts = [p for p in spans if p["pid"] == ev["pid"] and p["args"]["step"] == ev["args"]["step"]
                 and p["name"] in trace_report.PHASES]
        assert len(parts) == 4
        assert sum(p["dur"] for p in parts) == pytest.approx(ev["dur"], rel=0.02)
        for p in parts:   # each phase inside its step
            assert ev["ts"] - 1 <= p["ts"] and p["ts"] + p["dur"] <= ev["ts"] + ev["dur"] + 1
    summary = trace_report.summarize(doc)
    by = {(r["rank"], r["backend"]): r for r in summary["ranks"]}
    for (rank, backend), r in by.items():
        assert r["steps"] == 2 and r["exchange_seconds"] > 0 and r["kernel_seconds"] > 0
        if backend == "cad" and pingpong == "on":
            # A nano-batch's exchanges in flight while the other one's kernels run.
            assert r["exchange_hidden_share"] > 0.05, r
        else:
            assert r["exchange_hidden_share"] == 0.0, r
    nanos = {ev["args"].get("nano") for ev in spans if ev["cat"] == "exchange" and "cad" in ev["args"]["step"]}
    assert nanos == ({0, 1} if pingpong == "on" else {0})
    # The picture of one step: a rectangle per span of that step.
    import xml.etree.ElementTree as ET
    picture = tmp_path / "step.svg"
    assert trace_report.main([str(path), "--svg", str(picture), "--step", "4 cad"]) == 0
    rects = [e for e in ET.parse(picture).getroot() if e.tag.endswith("rect") and e.find("{*}title") is not None]
    assert len(rects) == sum(1 for ev in spans if ev["args"]["step"] == "4 cad")


def test_trace_report_sums_the_cxx_trainers_trace(tmp_path, capsys):
    """distca train --trace (the C++ trainer): its spans name the step record's parts; the report's
    own times per part add up to the records' parts, and the exchanges hide under compute with
    ping-pong (CAD's default) and not without (colocated's)."""
    import os
    import subprocess
    from pathlib import Path
    cli = Path(os.environ.get("DISTCA_BIN") or Path(__file__).resolve().parents[2] / "build" / "src" / "tools" / "distca")
    if not cli.is_file():
        pytest.skip(f"no distca binary at {cli} (set DISTCA_BIN)")
    path, report = tmp_path / "t.json", tmp_path / "r.json"
    done = subprocess.run([str(cli), "train", "--preset", "tiny", "--layers", "3", "--context", "1024", "--workload",
                           "skewed", "--compare", "--steps", "4", "--ranks", "2", "--trace-steps", "2", "--trace",
                           str(path), "--json", str(report)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(path.read_text())
    assert doc["otherData"]["format"] == "distca-trace" and doc["otherData"]["source"] == "distca train"
    _spans(doc)
    records = json.loads(report.read_text())["steps"]
    summary = trace_report.summarize(doc)
    assert {(r["rank"], r["backend"]) for r in summary["ranks"]} == {(k, b) for k in (0, 1) for b in ("colocated", "cad")}
    for r in summary["ranks"]:
        kept = [x for x in records if x["backend"] == r["backend"] and x["step"] in (3, 4)]
        mine = [x["ranks"][r["rank"]] for x in kept]
        step = sum(m["step_seconds"] for m in mine)
        assert r["steps"] == 2 and r["step_seconds"] == pytest.approx(step, rel=0.02)
        for part in ("linear", "attention", "comm", "wait", "optimizer"):
            assert r["parts"].get(part, 0.0) == pytest.approx(sum(m[f"{part}_seconds"] for m in mine), abs=0.02 * step), part
        if r["backend"] == "cad":
            assert r["exchange_hidden_share"] > 0.2, r
        else:
            assert r["exchange_hidden_share"] == 0.0, r
    assert trace_report.main([str(path)]) == 0
    assert "unspanned" in capsys.readouterr().out
    picture = tmp_path / "step.svg"
    assert trace_report.main([str(path), "--svg", str(picture), "--step", "4 cad"]) == 0
    assert picture.read_text().startswith("<svg")


def test_trace_report_refuses_what_is_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    assert trace_report.main([str(bad)]) == 2
    assert "not a distca trace" in capsys.readouterr().err
    assert trace_report.main([str(tmp_path / "missing.json")]) == 2


def test_the_trace_flags_are_checked_before_the_first_step(tmp_path, capsys):
    from test_torch_train_outputs import _refused
    _refused(["--preset", "tiny", "--trace", str(tmp_path)], capsys, contains="is a folder")
    _refused(["--preset", "tiny", "--trace", str(tmp_path / "a.json"), "--json", str(tmp_path / "a.json")], capsys,
             contains="name the same file")
    _refused(["--preset", "tiny", "--trace-steps", "0"], capsys, contains="--trace-steps must be 1..10000")


def check_pipeline_trace(doc: dict, report: dict, ticks: int, tp: int = 1) -> None:
    """A --pp run's trace: each kept step's span is its record's step time (2 %), the pipeline and
    the gradient sync with the optimizer add up to it, and every CAD step has a span per tick of
    the lockstep table on every rank (planning and agreement apart)."""
    spans = _spans(doc)
    records = {(r["step"], r["backend"]): r for r in report["steps"]}
    steps = [ev for ev in spans if ev["name"] == "step"]
    assert steps
    # The P2P transfers (the lockstep schedule's) and, with TP, its all-reduces on the exchange track.
    comm = {ev["name"].split(" ")[0] + " " + ev["name"].split(" ")[1] for ev in spans if ev["cat"] == "exchange"}
    assert {"p2p receive", "p2p sends"} <= comm, comm
    assert ("tp all-reduce" in comm) == (tp > 1), comm
    for ev in steps:
        step, backend = ev["args"]["step"].split(" ")
        assert ev["dur"] / 1e6 == pytest.approx(records[int(step), backend]["per_rank"]["step_seconds"][ev["pid"]],
                                                rel=0.02)
        mine = [p for p in spans if p["pid"] == ev["pid"] and p["args"]["step"] == ev["args"]["step"]]
        parts = [p for p in mine if p["name"] in trace_report.PIPELINE_PHASES]
        assert len(parts) == 2 and sum(p["dur"] for p in parts) == pytest.approx(ev["dur"], rel=0.02)
        if backend == "cad":
            work = [p for p in mine if p["name"].startswith("tick ") and not p["name"].endswith(("planning", "agreement"))]
            assert sorted(p["args"]["tick"] for p in work) == list(range(ticks))
