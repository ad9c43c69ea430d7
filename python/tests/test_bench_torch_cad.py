"""The distca.torch end-to-end benchmark runs and writes a sensible report (a smoke test, not a
timing check: the numbers themselves are the benchmark's business, and this machine is noisy)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
from torch_cases import positive, run_bench  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("DISTCA_SHARED_DATA") or REPO.parent / "shared" / "data")
BATCHES = [DATA / "reference" / f"batch_{f}_r{r}.json" for f in ("prolong", "wlbllm") for r in (64, 512)]


def run(*args: str, timeout: float = 300):
    return run_bench("bench_torch_cad.py", *args, timeout=timeout)


def test_help():
    done = run("--help", timeout=60)
    assert done.returncode == 0, done.stderr
    for flag in ("--repeats", "--steps", "--json", "--skip-ranks-part", "--quick"):
        assert flag in done.stdout


@pytest.mark.parametrize("where", ["folder", "missing"])
def test_bad_json_path_is_refused(tmp_path, where):
    path = tmp_path if where == "folder" else tmp_path / "no_such_folder" / "out.json"
    done = run("--quick", "--json", str(path), timeout=60)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "--json" in done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(not all(b.is_file() for b in BATCHES), reason=f"no reference batches in {DATA}")
def test_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    done = run("--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("bench_torch_cad: CAD ") and "x colocated" in last and "512 ranks" in last
    assert "part 2" in done.stderr  # progress lines go to stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "bench_torch_cad" and report["quick"] is True

    # Part 1: every (ranks, batch, policy, pingpong), with positive finite numbers.
    rows = report["ranks_part"]["rows"]
    keys = {(r["ranks"], r["batch"], r["policy"], r["pingpong"]) for r in rows}
    want = {(n, b, p, pp) for n in (8, 64, 512) for b in ("prolong", "wlbllm") for p in ("minbytes", "distca")
            for pp in (False, True)}
    assert keys == want and len(rows) == len(want)
    for r in rows:
        for key in ("median_plan_wall_ms", "median_plan_ms", "median_layout_rank0_ms", "median_layout_max_ms",
                    "median_total_ms", "estimated_attention_s", "ratio_to_estimated_attention", "tasks"):
            assert positive(r[key]), (key, r)
        assert r["median_layout_rank0_ms"] <= r["median_layout_max_ms"]
        assert r["median_plan_ms"] <= r["median_plan_wall_ms"]
        assert 0 in r["layout_ranks"] and r["ranks"] - 1 in r["layout_ranks"]
        assert r["ratio_to_estimated_attention"] == pytest.approx(r["median_total_ms"] / 1e3 / r["estimated_attention_s"])
        assert positive(r["median_split_ms"]) if r["pingpong"] else r["median_split_ms"] is None

    # Part 2: the correctness check ran and passed, on a batch where CAD moved work.
    layer = report["layer_part"]
    c = layer["correctness"]
    assert c["ran"] is True and c["passed"] is True and c["worst"] <= c["tolerance"] == 1e-5
    assert set(c["max_rel"]) == {"cad", "cad_pingpong"}
    assert layer["lengths"][0] == [layer["tokens_per_rank"]] and sum(layer["lengths"][1]) == layer["tokens_per_rank"]
    v = layer["variants"]
    assert set(v) == {"colocated", "cad", "cad_pingpong"}
    assert v["cad"]["server_pairs"] != v["colocated"]["server_pairs"]  # CAD moved attention to rank 1
    for name, rec in v.items():
        assert len(rec["step_s"]) == layer["steps"] == report["steps"]
        for key in ("median_step_s", "min_step_s", "max_step_s", "median_plan_ms", "median_layout_ms",
                    "straggler_wall_s", "straggler_kernel_s", "lower_bound_s"):
            assert positive(rec[key]), (name, key)
        assert all(positive(x) for x in rec["median_rank_wall_s"] + rec["median_rank_kernel_s"])
        assert rec["min_step_s"] <= rec["median_step_s"] <= rec["max_step_s"]
        # A step is the max over ranks of each rank's wall time.
        for step, walls in zip(rec["step_s"], rec["rank_wall_s"]):
            assert step == pytest.approx(max(walls))
    assert layer["speedup"] == pytest.approx(v["colocated"]["median_step_s"] / v["cad"]["median_step_s"])
    assert layer["speedup_pingpong"] == pytest.approx(
        v["colocated"]["median_step_s"] / v["cad_pingpong"]["median_step_s"])
    assert f"CAD {layer['speedup']:.2f}x colocated" in last
