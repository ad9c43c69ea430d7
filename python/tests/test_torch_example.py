"""Runs examples/torch_cad_attention.py (one CAD attention layer driven by distca's per-rank
metadata, forward and backward, against whole-document attention) on 2 gloo processes."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torch_cad_attention.py"
TOLERANCE = 1e-5
NUM = r"([0-9.]+(?:e[-+]?[0-9]+)?)"
LINE = re.compile(rf"torch_cad_attention: rank (\d) ok: (\d+) rows, (\d+) tasks in the plan, (\d+) key-split entries "
                  rf"merged here, plan {NUM} ms \+ layout {NUM} ms, relative error O {NUM}, dQ {NUM}, dK {NUM}, "
                  rf"dV {NUM} \(tolerance {NUM}\)")


def _need_torch_gloo():
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 (any import failure means no torch here)
        pytest.skip(f"import torch failed: {type(e).__name__}: {e}")
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip(f"torch.distributed.is_gloo_available() is False (torch {torch.__version__})")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_cad_attention_example(tmp_path):
    _need_torch_gloo()
    # Static rendezvous on a free port (--standalone would always take port 29400).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(EXAMPLE)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past 120 s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    output = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, output
    lines = LINE.findall(run.stdout)
    assert sorted(int(r[0]) for r in lines) == [0, 1], output
    for rank, rows, tasks, merged, plan_ms, layout_ms, *errors, tolerance in lines:
        assert int(rows) == 1024 and float(tolerance) == TOLERANCE, output
        assert all(float(e) <= TOLERANCE for e in errors), output
    # The document spanning both ranks has rows whose keys were split between the servers.
    assert sum(int(r[3]) for r in lines) > 0, output
