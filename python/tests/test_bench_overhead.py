"""The binding-overhead benchmark runs and writes a sensible report (a smoke test, not a timing
check: the numbers themselves are the benchmark's business)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "python" / "bench" / "bench_plan_overhead.py"
DATA = Path(os.environ.get("DISTCA_SHARED_DATA") or REPO.parent / "shared" / "data")
BATCH = DATA / "reference" / "batch_wlbllm_r512.json"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help():
    done = run("--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--repeats", "--batch", "--policy", "--json"):
        assert flag in done.stdout


@pytest.mark.skipif(not BATCH.is_file(), reason=f"no {BATCH} (set DISTCA_SHARED_DATA)")
def test_one_batch_one_policy(tmp_path):
    out = tmp_path / "bench.json"
    done = run("--repeats", "1", "--warmup", "0", "--policy", "minbytes", "--batch", "wlbllm", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "wlbllm_r512" in done.stdout and "minbytes" in done.stdout
    report = json.loads(out.read_text())
    assert report["repeats"] == 1 and report["factor"] == 1.2 and report["slack_ms"] == 1.0
    assert set(report["summary"]) == {"native", "plan"}
    (result,) = report["results"]
    assert result["batch"] == "wlbllm_r512" and result["policy"] == "minbytes"
    assert result["path"] == str(BATCH) and result["ranks"] == 512 and result["tasks"] > 0
    for key in ("python_ms", "native_ms", "plan_ms", "overhead_ms"):
        assert len(result[key]) == 1
    for key in ("median_python_ms", "median_native_ms", "median_plan_ms", "median_overhead_ms",
                "median_overhead_vs_plan_ms"):
        assert isinstance(result[key], float)
    for key in ("native_criterion", "plan_criterion"):
        c = result[key]
        assert {"per_call_met", "per_call_total", "all_calls_met", "median_met", "median_bound_ms"} <= set(c)
        assert c["per_call_total"] == 1
    python_ms, native_ms, plan_ms = result["python_ms"][0], result["native_ms"][0], result["plan_ms"][0]
    # The C++ work is inside the Python call, and the planner is inside the C++ work.
    assert 0 < plan_ms <= native_ms <= python_ms
    assert result["overhead_ms"][0] == pytest.approx(python_ms - native_ms)
    assert result["native_criterion"]["median_met"] == (python_ms <= 1.2 * native_ms + 1)
    assert result["plan_criterion"]["median_met"] == (python_ms <= 1.2 * plan_ms + 1)


def test_unknown_batch_is_refused(tmp_path):
    done = run("--repeats", "1", "--batch", "no_such_batch")
    assert done.returncode != 0
    assert "no batch 'no_such_batch'" in done.stderr
