"""The package's annotations and the native module's stubs type-check (what editors complete
from): mypy over the package and over a client that uses the documented API."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CLIENT = textwrap.dedent('''
    import numpy as np
    import distca

    plan: distca.Plan = distca.plan([[4096, 512], [1024] * 4], policy="minbytes", model="llama-8b")
    meta: distca.RankLayout = plan.for_rank(0)
    cu: np.ndarray = meta.causal.cu_seqlens_q
    rows: int = meta.causal_q_rows
    send, recv = meta.splits("fwd_dispatch")["q"]
    total: int = sum(send) + sum(recv)
    imbalance: float = plan.load["imbalance"]
    report: dict = distca.simulate(gpus=16, tp=8)
    ranks: int = plan.batch.num_ranks
''')


def test_package_and_a_client_type_check(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (scripts/install-deps.sh installs python3-mypy)")
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    run = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-incremental",
                          "--cache-dir", str(tmp_path / "cache"), str(ROOT / "python" / "distca"), str(client)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
