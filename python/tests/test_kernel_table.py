"""The measured kernel table behind `auto` on CUDA (distca.torch.kernel_table) and AutoKernel: the
kinds of task list, the choice from a bench report, loading and refusing tables, the command line,
and AutoKernel running each list on its kind's kernel (on CPU, with CPU kernels standing in)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from distca.torch import kernel_table as kt  # noqa: E402
from distca.torch.kernels.backends import AutoKernel, describe_auto  # noqa: E402
from distca.torch.kernels.native import DistcaKernel  # noqa: E402
from distca.torch.kernels.pytorch import ReferenceKernel, SdpaKernel  # noqa: E402
from distca.torch.kernels.server import causal_shards  # noqa: E402


def row(backend, layout, tokens, shard, fwd, bwd, tasks=1):
    return {"backend": backend, "layout": layout, "tokens": tokens, "shard": shard, "tasks": tasks,
            "fwd": {"seconds": fwd}, "bwd": {"seconds": bwd}}


def report(rows):
    return {"format": "distca-bench-cuda-attention", "version": 2, "device": "NVIDIA Test GPU", "capability": [9, 0],
            "dtype": "bfloat16", "torch": "2.11", "date": "2026-11-27", "rows": rows}


def test_kinds_follow_the_mean_query_rows_of_the_tasks_that_compute():
    whole = np.array([[0, 16384, 0, 16384, 1]])
    shards = np.array([[i * 128, 128, 0, (i + 1) * 128, 1] for i in range(64)])
    assert kt.classify(whole) == "long"
    assert kt.classify(shards) == "shards"
    # Rows with no query or no key do not count; an empty list is `long` (nothing to choose).
    assert kt.classify(np.concatenate([whole, [[16384, 5, 0, 0, 0]] * 100])) == "long"
    assert kt.classify(np.zeros((0, 5), np.int64)) == "long"
    assert kt.classify(np.array([[0, kt.LONG_ROWS, 0, kt.LONG_ROWS, 1]])) == "long"
    assert kt.classify(np.array([[0, kt.LONG_ROWS - 1, 0, kt.LONG_ROWS, 1]])) == "shards"


def test_the_table_names_per_kind_the_least_mean_relative_time():
    rows = [
        # long: cudnn fastest on both whole documents, distca on the 1024-row shards; cudnn wins overall.
        row("distca", "whole", 16384, None, 4.0, 9.0), row("cudnn", "whole", 16384, None, 2.0, 4.0),
        row("varlen", "whole", 16384, None, 3.0, 5.0),
        row("distca", "whole", 32768, None, 16.0, 36.0), row("cudnn", "whole", 32768, None, 8.0, 16.0),
        row("varlen", "whole", 32768, None, 12.0, 20.0),
        row("distca", "shards", 16384, 1024, 1.0, 2.0), row("cudnn", "shards", 16384, 1024, 1.2, 2.4),
        row("varlen", "shards", 16384, 1024, 2.0, 3.0),
        # shards: varlen did not run there (not eligible), distca beats cudnn.
        row("distca", "shards", 16384, 128, 1.0, 2.0), row("cudnn", "shards", 16384, 128, 2.0, 3.0),
        # PyTorch-only rows and the equal-work baseline are not candidates.
        row("sdpa-cudnn", "whole", 16384, None, 0.1, 0.1), row("sdpa-cudnn", "equal-work", 9000, None, 0.1, 0.1),
    ]
    table = kt.table_from_bench(report(rows))
    assert table["format"] == kt.FORMAT and table["device"] == "NVIDIA Test GPU"
    assert table["kinds"]["long"]["fastest"] == "cudnn"
    assert table["kinds"]["long"]["scores"]["cudnn"] == pytest.approx((1 + 1 + 3.6 / 3.0) / 3)
    assert table["kinds"]["shards"]["fastest"] == "distca"
    assert "varlen" not in table["kinds"]["shards"]["scores"]
    # The plan case's list is kinded by its own mean rows per task.
    plan = kt.table_from_bench(report([row("cudnn", "plan", 32768, None, 1.0, 1.0, tasks=512),
                                       row("distca", "plan", 32768, None, 2.0, 2.0, tasks=512)]))
    assert plan["kinds"]["shards"]["fastest"] == "cudnn" and "long" not in plan["kinds"]


def test_varlen_is_scored_on_the_layouts_it_can_run_beside_the_task_list_only_ones():
    # varlen cannot take a real server's list (plan) or out-of-order shards (reversed); it stays a
    # candidate, scored on the shapes it ran, and wins where it is fastest there.
    rows = [row("distca", "whole", 16384, None, 4.0, 9.0), row("cudnn", "whole", 16384, None, 2.0, 8.0),
            row("varlen", "whole", 16384, None, 3.0, 5.0),
            row("distca", "plan", 30000, None, 4.0, 9.0, tasks=4), row("cudnn", "plan", 30000, None, 2.0, 7.0, tasks=4),
            row("distca", "shards", 16384, 128, 1.0, 2.0), row("cudnn", "shards", 16384, 128, 0.5, 1.0),
            row("varlen", "shards", 16384, 128, 0.8, 1.6),
            row("distca", "reversed", 16384, 128, 1.0, 2.0), row("cudnn", "reversed", 16384, 128, 0.5, 9.0)]
    table = kt.table_from_bench(report(rows))
    assert table["kinds"]["long"]["scores"]["varlen"] == pytest.approx(1.0)
    assert table["kinds"]["long"]["fastest"] == "varlen"
    assert table["kinds"]["long"]["scores"]["cudnn"] == pytest.approx((10 / 8 + 1) / 2)
    # shards: cudnn wins in order (merged) but loses on reversed; distca is least on average.
    assert table["kinds"]["shards"]["scores"]["varlen"] == pytest.approx(2.4 / 1.5)
    assert table["kinds"]["shards"]["fastest"] == "distca"
    # A kernel missing a layout it can run is not a candidate.
    missing = kt.table_from_bench(report([r for r in rows if not (r["backend"] == "cudnn" and r["layout"] == "whole")]))
    assert "cudnn" not in missing["kinds"]["long"]["scores"]


def test_hopper_is_a_candidate_and_a_kernel_that_failed_its_check_never_is():
    rows = [row("distca", "whole", 16384, None, 4.0, 9.0), row("cudnn", "whole", 16384, None, 2.0, 4.0),
            row("hopper", "whole", 16384, None, 1.5, 3.5),
            row("distca", "plan", 30000, None, 4.0, 9.0, tasks=64), row("cudnn", "plan", 30000, None, 2.0, 7.0, tasks=64),
            row("hopper", "plan", 30000, None, 1.0, 2.0, tasks=64)]
    table = kt.table_from_bench(report(rows))
    assert table["kinds"]["long"]["fastest"] == "hopper" and table["kinds"]["shards"]["fastest"] == "hopper"
    assert table["failed_checks"] == []
    checked = report(rows)
    checked["checks"] = [{"backend": "hopper", "shard": 128, "ok": False}, {"backend": "cudnn", "shard": 128, "ok": True}]
    table = kt.table_from_bench(checked)
    assert table["failed_checks"] == ["hopper"]
    assert table["kinds"]["long"]["fastest"] == "cudnn" and "hopper" not in table["kinds"]["long"]["scores"]
    assert table["kinds"]["shards"]["fastest"] == "cudnn"


def test_reports_without_candidates_or_of_another_kind_are_refused():
    with pytest.raises(ValueError, match="not a bench_cuda_attention.py report"):
        kt.table_from_bench({"format": "something else"})
    with pytest.raises(ValueError, match="nothing to choose from"):
        kt.table_from_bench(report([row("sdpa-cudnn", "whole", 4096, None, 1.0, 1.0)]))


def test_find_table_reads_the_env_file_and_refuses_bad_ones(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTCA_KERNEL_TABLE", raising=False)
    assert kt.find_table("No Such GPU 3000") == (None, None)
    good = tmp_path / "t.json"
    good.write_text(json.dumps(kt.table_from_bench(report([row("cudnn", "whole", 8192, None, 1, 1)]))))
    monkeypatch.setenv("DISTCA_KERNEL_TABLE", str(good))
    path, table = kt.find_table("anything")
    assert path == str(good) and table["kinds"]["long"]["fastest"] == "cudnn"
    monkeypatch.setenv("DISTCA_KERNEL_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no such file"):
        kt.find_table("anything")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": kt.FORMAT, "version": 1, "kinds": {"long": {"fastest": "magic"}}}))
    monkeypatch.setenv("DISTCA_KERNEL_TABLE", str(bad))
    with pytest.raises(ValueError, match="names 'magic'"):
        kt.find_table("anything")
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="DISTCA_KERNEL_TABLE=.*: malformed JSON"):
        kt.find_table("anything")
    assert kt.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_the_command_writes_a_table_and_never_overwrites_other_files(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(report([row("cudnn", "whole", 8192, None, 1, 1), row("distca", "whole", 8192, None, 2, 2)])))
    out = tmp_path / "table.json"
    assert kt.main([str(bench), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["kinds"]["long"]["fastest"] == "cudnn"
    assert "long: cudnn" in capsys.readouterr().out
    assert kt.main([str(bench), "--out", str(out)]) == 0   # its own table: replaced
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert kt.main([str(bench), "--out", str(notes)]) == 2   # bad input (docs/cli.md's exit codes)
    assert notes.read_text() == '{"mine": 1}'
    assert "not overwritten" in capsys.readouterr().err
    assert kt.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_auto_kernel_runs_each_kind_on_its_kernel():
    device = torch.device("cpu")
    calls = []

    class Tracing(ReferenceKernel):
        def __init__(self, label):
            self.label = label

        def forward(self, q, k, v, tasks, scale):
            calls.append(self.label)
            return super().forward(q, k, v, tasks, scale)

    auto = AutoKernel({"long": Tracing("long"), "shards": Tracing("shards")}, SdpaKernel(), "test")
    for shard, kind in ((0, "long"), (64, "shards")):
        tasks = causal_shards(1024, shard, device)
        n_q, n_k = tasks.num_q, tasks.num_k
        g = torch.Generator().manual_seed(shard)
        q = torch.randn(n_q, 4, 32, generator=g)
        k, v = (torch.randn(n_k, 2, 32, generator=g) for _ in range(2))
        o, lse = auto.forward(q, k, v, tasks, 32 ** -0.5)
        want_o, want_lse = ReferenceKernel().forward(q, k, v, tasks, 32 ** -0.5)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
        assert calls[-1] == kind and tasks.cache["kernel_kind"] == kind
    # A kind the table lacks goes to the default.
    assert AutoKernel({}, SdpaKernel(), "t").pick(causal_shards(64, 0, device)).name == "sdpa"


def test_describe_auto_says_what_runs_without_a_table():
    from distca.torch.kernels.backends import get_backend
    cpu = torch.device("cpu")
    chosen = get_backend("auto", cpu, torch.float32, 64).name
    text = describe_auto(cpu, torch.float32, 64)
    assert text.startswith(f"auto: {chosen} (") and "reference" in text, text
    assert chosen in (DistcaKernel.name, "sdpa")
