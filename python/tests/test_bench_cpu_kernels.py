"""The CPU kernels benchmark (python/bench/bench_cpu_kernels.py) runs and writes a sensible report:
every backend on every shape, positive finite GFLOP/s with their spread, the correctness checks
passed, distca/sdpa ratios (a smoke test, not a timing check: this machine is noisy)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
from torch_cases import positive, run_bench  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "build" / "src" / "tools" / "distca"


def run(*args: str, timeout: float = 300):
    return run_bench("bench_cpu_kernels.py", *args, timeout=timeout)


def test_help():
    done = run("--help", timeout=60)
    assert done.returncode == 0, done.stderr
    for flag in ("--quick", "--json", "--repeats", "--threads", "--head-dims", "--tokens", "--cli", "--no-cli"):
        assert flag in done.stdout


@pytest.mark.parametrize("args,message", [(("--json", "/no/such/folder/x.json"), "--json"),
                                          (("--head-dims", "48"), "--head-dims"),
                                          (("--heads", "3", "--kv-heads", "2"), "multiple")])
def test_bad_arguments_are_refused(args, message):
    done = run("--quick", *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""


def test_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    cli = [] if CLI.is_file() else ["--no-cli"]
    done = run("--quick", "--threads", "1,2", "--json", str(out), *cli)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "distca over sdpa: forward" in done.stdout
    report = json.loads(out.read_text())
    assert report["format"] == "distca-bench-cpu-kernels" and report["quick"] is True
    assert "causal (query, key) pairs x 4 D Hq" in report["flop_convention"]
    backends = {"reference", "sdpa", "distca", "distca-shared"} | (set() if cli else {"cli"})
    shapes = {(r["head_dim"], r["tokens"], r["layout"], r["threads"]) for r in report["rows"]}
    assert len(shapes) == len(report["head_dims"]) * len(report["tokens"]) * 2 * 2
    for shape in shapes:
        assert {r["backend"] for r in report["rows"]
                if (r["head_dim"], r["tokens"], r["layout"], r["threads"]) == shape} == backends, shape
    for r in report["rows"]:
        for p in ("fwd", "bwd"):
            assert positive(r[f"{p}_gflops"]) and positive(r[f"{p}_seconds"]), r
            if r["backend"] != "cli":
                low, high = r[f"{p}_gflops_spread"]
                assert low <= r[f"{p}_gflops"] * (1 + 1e-9) and r[f"{p}_gflops"] <= high * (1 + 1e-9), r
    assert report["checks"] and all(c["max_rel_error"] <= 1e-4 for c in report["checks"])
    assert len(report["ratios"]) == len(shapes)
    for r in report["ratios"]:
        assert positive(r["distca_over_sdpa_fwd"]) and positive(r["distca_over_sdpa_bwd"])
