"""The GPU multi-rank check's dry run (python/tests/gpu/check_torch_multirank.py --device cpu): the
same path, 2 gloo processes with CPU tensors, key splits and ping-pong, against whole-document
attention; and StepPlanner's host_staging refusals."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from distca.torch.spawn import run_ranks  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "gpu" / "check_torch_multirank.py"


def test_the_dry_run_matches_whole_document_attention(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--worlds", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 ranks, distca:" in run.stdout and "check_torch_multirank: ok" in run.stdout
    import json
    rows = json.loads(out.read_text())["worlds"]["2"]["rows"]
    assert {r["backend"] for r in rows} == {"sdpa", "distca"}
    assert all(r["ok"] and r["pingpong"] for r in rows)
    assert max(r["merged_entries_all_ranks"] for r in rows) > 0


def test_bad_worlds_are_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--worlds", "1"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "between 2 and 8" in run.stderr


def _staging_refusals(rank, world):
    from distca.torch import StepPlanner
    model = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    messages = []
    for kwargs in ({"host_staging": True}, {"host_staging": "yes"}):
        try:
            StepPlanner(model=model, **kwargs)
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    return messages


def test_host_staging_is_only_for_cuda_tensors_over_gloo():
    out = run_ranks(_staging_refusals, 1, timeout=120)
    assert out[0]["error"] is None, out[0]["error"]
    first, second = out[0]["result"]
    assert "host_staging is for CUDA tensors over a gloo group; this is gloo with cpu tensors" in first
    assert "host_staging must be a bool" in second
