"""scripts/bench-link-torch.sh's flag checks, which run before any host is made (so these need no
root and make nothing): --help prints the header, a bad flag is one line on stderr and exit 2; and
its Python side, python/bench/bench_link_torch.py, refuses bad flags with exit 2 too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench-link-torch.sh"
BENCH = ROOT / "python" / "bench" / "bench_link_torch.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_help_prints_the_header_and_exits_0():
    run = _run("--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("distca.torch's ping-pong over a real (shaped) network link")
    for flag in ("--rounds", "--steps", "--layers", "--tokens", "--workload", "--rate-mbit", "--json"):
        assert flag in run.stdout, flag
    assert "set -euo" not in run.stdout and not run.stderr


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds must be 1..99 (got '0')"),
    (["--rounds", "100"], "--rounds must be 1..99"),
    (["--steps", "x"], "--steps must be 1..99 (got 'x')"),
    (["--layers", "65"], "--layers must be 1..64 (got '65')"),
    (["--tokens", "100"], "--tokens must be a multiple of 16 in 256..65536"),
    (["--tokens", "4100"], "--tokens must be a multiple of 16 in 256..65536"),
    (["--tokens", "0300"], "--tokens must be a multiple of 16 in 256..65536"),
    (["--workload", "packed"], "--workload must be two-long, skewed, prolong or wlbllm (got 'packed')"),
    (["--rate-mbit", "0"], "--rate-mbit must be auto or whole Mbit/s 1..100000 (got '0')"),
    (["--rate-mbit=1.5"], "--rate-mbit must be auto or whole Mbit/s"),
    (["--rate-mbit", "200000"], "--rate-mbit must be auto or whole Mbit/s"),
    (["--json", "/nonexistent-folder/x.json"], "/nonexistent-folder is not a writable folder"),
    (["--json", "/"], "is a folder, not a file"),
    (["--steps"], "--steps needs a value"),
    (["--bogus"], "unknown option '--bogus'"),
    (["extra"], "unknown option 'extra'"),
])
def test_a_bad_flag_is_one_line_and_exit_2_before_any_host(args, message):
    run = _run(*args)
    assert run.returncode == 2, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench-link-torch.sh: ") and message in lines[0], run.stderr
    assert not run.stdout


@pytest.mark.parametrize("args", [["--steps", "0"], ["--tokens", "100"], ["--heads", "3", "--kv-heads", "2"],
                                  ["--workload", "packed"]])
def test_the_benchmark_refuses_bad_flags_with_exit_2(args):
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2, (run.returncode, run.stderr[-500:])
    assert "error:" in run.stderr
