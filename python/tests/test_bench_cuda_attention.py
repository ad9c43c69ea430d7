"""python/bench/bench_cuda_attention.py without a GPU: --help, bad arguments refused (exit 2), no CUDA
device a clear message and exit 1; its pieces on CPU tensors: the fused shards' task lists cover a
document's causal pairs exactly once, the distca and sdpa-flash runners equal float32 attention
(whole and sharded; the GPU run times them), a backend torch refuses is reported, not crashed on,
and the ratios pick the fastest PyTorch backend per shape."""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_cases import BENCH, run_bench  # noqa: E402

spec = importlib.util.spec_from_file_location("bench_cuda_attention", BENCH / "bench_cuda_attention.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_cuda_attention"] = bench
spec.loader.exec_module(bench)


def run(*args: str):
    return run_bench("bench_cuda_attention.py", *args, timeout=120)


def test_help():
    done = run("--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--tokens", "--shard-doc", "--shards", "--heads", "--kv-heads", "--head-dim", "--dtype", "--repeats",
                 "--warmup", "--backends", "--json", "FLOPs count causal"):
        assert flag in done.stdout, flag


@pytest.mark.parametrize("args,message", [
    (("--heads", "3", "--kv-heads", "2"), "multiple of --kv-heads"),
    (("--shards", "64,x"), "--shards: a comma-separated list"),
    (("--tokens", "0"), "--tokens: positive integers"),
    (("--head-dim", "96"), "--head-dim"),
    (("--backends", "varlen"), "distca included"),
    (("--backends", "distca,flashy"), "flashy"),
    (("--json", "/no/such/folder/x.json"), "--json"),
    (("--repeats", "0"), "--repeats must be at least 1"),
])
def test_bad_arguments_are_refused(args, message):
    done = run(*args)
    assert done.returncode == 2 and message in done.stderr and done.stdout == "", done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a CUDA device")
def test_no_cuda_device_is_a_clear_error(tmp_path):
    out = tmp_path / "bench.json"
    done = run("--json", str(out))
    assert done.returncode == 1 and "no CUDA device" in done.stderr and done.stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("tokens,shard", [(1, None), (1000, None), (1000, 64), (1000, 128), (1000, 999), (1024, 256),
                                          (997, 1024)])
def test_fused_shards_cover_the_causal_triangle_once(tokens, shard):
    tasks = bench.shard_tasks(tokens, shard)
    assert bench.causal_pairs(tasks) == tokens * (tokens + 1) // 2
    assert tasks[0, 0] == 0 and tasks[-1, 0] + tasks[-1, 1] == tokens
    assert np.all(tasks[1:, 0] == tasks[:-1, 0] + tasks[:-1, 1]) and np.all(tasks[:, 2] == 0)   # one shared K/V
    assert np.all(tasks[:, 3] == tasks[:, 0] + tasks[:, 1]) and np.all(tasks[:, 4] == 1)
    if shard and shard < tokens:
        assert len(tasks) == -(-tokens // shard) and tasks[:, 1].max() == shard


@pytest.mark.parametrize("shard", [None, 64])
def test_runners_equal_float32_attention_on_cpu(shard):
    n, hq, hkv, d = 300, 8, 2, 64
    gen = torch.Generator().manual_seed(1)
    q, do = (torch.randn(n, hq, d, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(n, hkv, d, generator=gen).bfloat16() for _ in range(2))
    tasks = bench.shard_tasks(n, shard)
    want = bench.reference(torch, q, k, v, do, tasks, d ** -0.5)
    for name in ("distca", "sdpa-flash"):
        forward, backward, outputs = bench.make_runner(name, torch, q, k, v, do, tasks, d ** -0.5)
        got = outputs()
        assert [x.shape for x in got] == [q.shape, q.shape, k.shape, k.shape], name
        errors = [bench.max_rel(g, w) for g, w in zip(got, want)]
        assert max(errors) <= bench.TOLERANCE, (name, errors)
        forward()
        backward()   # the timed closures run again on the retained state
    with pytest.raises(bench.Unavailable, match="sdpa-cudnn"):   # no cuDNN attention on CPU
        bench.make_runner("sdpa-cudnn", torch, q, k, v, do, tasks, d ** -0.5)


def test_summaries_and_ratios():
    s = bench.summarize([2.0, 1.0, 4.0], 8e12)
    assert s["seconds"] == 2.0 and s["tflops"] == 4.0 and s["seconds_spread"] == [1.0, 4.0]
    assert s["tflops_spread"] == [2.0, 8.0] and s["repeats"] == 3

    def row(backend, fwd, bwd, shard=None):
        return {"backend": backend, "layout": "whole" if shard is None else "shards", "tokens": 4096, "shard": shard,
                "fwd": {"tflops": fwd}, "bwd": {"tflops": bwd}}
    rows = [row("distca", 300, 200), row("varlen", 400, 100), row("sdpa-flash", 350, 150),
            row("distca", 100, 80, 64), row("varlen", 50, 100, 64)]
    r = bench.ratios(rows)
    assert r[0] == {"layout": "whole", "tokens": 4096, "shard": None, "fwd_fastest_pytorch": "varlen",
                    "fwd_ratio": 0.75, "bwd_fastest_pytorch": "sdpa-flash", "bwd_ratio": 200 / 150}
    assert r[1]["fwd_ratio"] == 2.0 and r[1]["bwd_ratio"] == 0.8
    assert bench.ratios([row("distca", 1, 1)])[0]["fwd_ratio"] is None   # nothing to compare with
