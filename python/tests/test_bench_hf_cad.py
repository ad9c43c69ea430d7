"""The Hugging Face CAD benchmark runs at a tiny size and writes a sensible report (a smoke test, not
a timing check: the timings are the benchmark's business, and this machine is noisy)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch_cases import positive, run_bench  # noqa: E402


def test_tiny_run_reports_every_variant(tmp_path):
    out = tmp_path / "bench.json"
    done = run_bench("bench_hf_cad.py", "--tokens", "256", "--steps", "1", "--warmup", "0", "--layers", "1",
                     "--hidden", "64", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["format"] == "distca-bench-hf-cad"
    assert set(r["median_step_s"]) == {"hf_sdpa", "colocated", "cad"} and all(map(positive, r["median_step_s"].values()))
    assert r["speedup_over_hf_sdpa"] == pytest.approx(r["median_step_s"]["hf_sdpa"] / r["median_step_s"]["cad"])
    assert r["speedup_over_colocated"] == pytest.approx(r["median_step_s"]["colocated"] / r["median_step_s"]["cad"])
    assert r["loss_max_relative_difference"] <= 1e-5
    assert all(rank["plans"] == rank["forwards"] == 1 for rank in r["ranks"])
    assert "speedup of CAD (same run)" in done.stdout


def test_existing_json_is_refused(tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("{}")
    done = run_bench("bench_hf_cad.py", "--json", str(out), timeout=60)
    assert done.returncode == 2 and "exists" in done.stderr and out.read_text() == "{}"
