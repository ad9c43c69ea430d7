"""reports/ holds results only: what a run printed and a README per run, never code that nothing
builds or tests (a tried change lives in git, cited by hash; a probe worth keeping lives in dev/,
tested here). And the one probe kept, dev/busy_cores/busy_cores.py, works on a tiny run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPORTS = REPO / "reports"
BUSY_CORES = REPO / "dev" / "busy_cores" / "busy_cores.py"
CODE_SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu", ".cuh", ".py", ".sh", ".patch", ".diff"}


def code_files(root: Path) -> list[str]:
    """Files under root that are code: by suffix, by a #! line, or by an executable bit."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            shebang = f.read(2) == b"#!"
        if path.suffix.lower() in CODE_SUFFIXES or shebang or os.access(path, os.X_OK):
            found.append(str(path.relative_to(root)))
    return found


def test_no_file_under_reports_is_code():
    found = [f"reports/{f}" for f in code_files(REPORTS)]
    assert not found, ("reports/ holds results only (reports/README.md): move a probe worth keeping "
                       "to dev/ with a test, and cite anything else by the commit that holds it: "
                       + ", ".join(found))


def test_the_check_finds_code_by_suffix_shebang_and_mode(tmp_path):
    (tmp_path / "probe.cc").write_text("int main() {}\n")
    (tmp_path / "tried.patch").write_text("diff --git a/x b/x\n")
    (tmp_path / "run").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "tool").write_text("echo hi\n")
    (tmp_path / "tool").chmod(0o755)
    (tmp_path / "run.log").write_text("test.sh: all passed in 1 s\n")
    (tmp_path / "README.md").write_text("# a run\n")
    assert code_files(tmp_path) == ["probe.cc", "run", "tool", "tried.patch"], code_files(tmp_path)


def test_the_reports_readme_states_the_rule():
    text = (REPORTS / "README.md").read_text()
    assert re.search(r"never code", text), "reports/README.md must say that a report holds no code"


def busy_cores(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUSY_CORES), *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_busy_cores_by_part_on_a_run_worked_by_hand(tmp_path):
    # 2 cores; second 100 half busy, 101 all busy, 102 idle, 103 three quarters busy.
    (tmp_path / "cpu.txt").write_text("# cores 2\n100 200 100\n101 200 0\n102 200 200\n103 200 50\n")
    (tmp_path / "run.log").write_text("100 test.sh: install-deps took 0 s\n102 test.sh: build took 2 s\n"
                                      "102 a line that ends nothing\n104 test.sh: ctest took 2 s\n")
    p = busy_cores("by-part", str(tmp_path / "cpu.txt"), str(tmp_path / "run.log"), "--window", "2")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "    0-    0s  busy 0.00 cores, idle core-s      0  test.sh: install-deps took 0 s"
    assert lines[1] == "    0-    2s  busy 1.50 cores, idle core-s      1  test.sh: build took 2 s"
    assert lines[2] == "    2-    4s  busy 0.75 cores, idle core-s      2  test.sh: ctest took 2 s"
    assert lines[3] == "    0s 1.50 |     2s 0.75"
    assert len(lines) == 4
    # --cores overrides the header: the same fractions on 4 cores.
    p = busy_cores("by-part", str(tmp_path / "cpu.txt"), str(tmp_path / "run.log"), "--cores", "4")
    assert "busy 3.00 cores, idle core-s      2  test.sh: build took 2 s" in p.stdout, p.stdout


def test_busy_cores_samples_this_machine_and_stamps_lines(tmp_path):
    p = busy_cores("sample", "--count", "2", "--interval", "0.05")
    assert p.returncode == 0, p.stderr
    header, *samples = p.stdout.splitlines()
    assert header == f"# cores {os.cpu_count()}"
    assert len(samples) == 2
    for line in samples:
        epoch, total, idle = (int(w) for w in line.split())
        assert 0 <= idle <= total and epoch > 1_600_000_000
    p = busy_cores("stamp", stdin="test.sh: build took 1 s\nsecond line\n")
    assert p.returncode == 0, p.stderr
    assert [l.split(" ", 1)[1] for l in p.stdout.splitlines()] == ["test.sh: build took 1 s", "second line"]
    assert all(l.split(" ", 1)[0].isdigit() for l in p.stdout.splitlines())


@pytest.mark.parametrize("cpu, log, args, message", [
    ("100 200 100\n", "100 x\n", ["--marks", "nothing"], "no line matches --marks"),
    ("100 two 100\n", "100 test.sh: build took 1 s\n", [], "cpu.txt:1: expected 'epoch jiffies idle_jiffies'"),
    ("", "100 test.sh: build took 1 s\n", [], "no samples"),
    ("100 200 100\n", "test.sh: build took 1 s\n", [], "must start with its epoch second"),
    ("100 200 100\n", "100 test.sh: build took 1 s\n", ["--window", "0"], "--window must be >= 1"),
])
def test_busy_cores_refuses_bad_input_in_one_line(tmp_path, cpu, log, args, message):
    (tmp_path / "cpu.txt").write_text(cpu)
    (tmp_path / "run.log").write_text(log)
    p = busy_cores("by-part", str(tmp_path / "cpu.txt"), str(tmp_path / "run.log"), *args)
    assert p.returncode == 2 and message in p.stderr, (p.returncode, p.stderr)


def test_busy_cores_names_a_missing_file():
    p = busy_cores("by-part", "/nonexistent/cpu.txt", "/nonexistent/run.log")
    assert p.returncode == 2 and "/nonexistent/cpu.txt" in p.stderr, p.stderr
