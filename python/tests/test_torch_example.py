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
TOLERANCE = 1e-4
NUM = r"([0-9.]+(?:e[-+]?[0-9]+)?)"
SUCCESS = re.compile(rf"torch_cad_attention: ok: (\d+) cases, max relative error O {NUM}, dQ {NUM}, "
                     rf"dK {NUM}, dV {NUM} \(tolerance {NUM}\)")
CASE = re.compile(rf"^(.*?)\s+(none|distca|minmax|minbytes)\s+merged entries\s+(\d+)\s+relative error "
                  rf"O {NUM}, dQ {NUM}, dK {NUM}, dV {NUM}$", re.M)


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
    # Static rendezvous on a free port (--standalone would always take port 29400). --redirects/
    # --tee 2: torch 1.13's launcher cannot parse their default 0 under Python 3.11.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--rdzv_backend", "static", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "--redirects", "2", "--tee", "2", "--log_dir", str(tmp_path / "logs"), str(EXAMPLE)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past 120 s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    output = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, output

    found = SUCCESS.search(run.stdout)
    assert found, output
    cases, *errors, tolerance = found.groups()
    assert int(cases) == 8, output
    assert float(tolerance) == TOLERANCE, output
    for name, value in zip(("O", "dQ", "dK", "dV"), errors):
        assert float(value) <= TOLERANCE, f"{name}: relative error {value}\n{output}"

    # One line per (batch, policy): both batches, every policy, each within tolerance, and the
    # LSE merge of key-split rows exercised by at least one plan.
    rows = CASE.findall(run.stdout)
    assert len(rows) == 8 and {r[1] for r in rows} == {"none", "distca", "minmax", "minbytes"}, output
    assert len({r[0] for r in rows}) == 2, output
    assert all(float(x) <= TOLERANCE for r in rows for x in r[3:]), output
    assert any(int(r[2]) > 0 for r in rows), output
