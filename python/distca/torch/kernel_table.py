"""The measured kernel table behind `auto` on CUDA: which server kernel ran a kind of task list
fastest on a device, forward plus backward, as python/bench/bench_cuda_attention.py measured it.

A server's task list is of one of two kinds (`classify`): `long` (few long tasks: whole documents
and long shards, a mean of at least LONG_ROWS query rows per task) or `shards` (many short query
shards, typically sharing their documents' K/V prefixes). For each kind the table names the
fastest of distca.torch's task-list kernels (distca, cudnn, hopper, varlen) over the bench's shapes
of that kind: the one whose forward + backward time, relative to the fastest on each shape and
averaged over the shapes it can run, is least. A kernel must have run every shape of the kind it
can run to be chosen, and must have passed the bench's correctness checks (a kernel with a failed
check is never chosen, however fast); varlen cannot take the task-list-only layouts (`plan`, a
real server's list, and `reversed`, shards whose query rows are not in order), so it is scored on
the others.

Tables ship in distca/torch/kernel_tables/<device>.json (the device's name as torch reports it,
lower-case, non-alphanumerics as '-'), or come from DISTCA_KERNEL_TABLE (a file). Without one,
`auto` keeps its default order and says so (`describe_auto`).

    python -m distca.torch.kernel_table BENCH_JSON --out TABLE_JSON   # the table from a bench report
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

LONG_ROWS = 512          # mean query rows per task at and above which a list is `long`
KINDS = ("long", "shards")
# The bench's backends that are distca.torch backends of the same name (the others time PyTorch's
# kernels on one document's shards, which no server task list is).
TABLE_BACKENDS = ("distca", "cudnn", "hopper", "varlen")
TASK_LIST_ONLY = ("plan", "reversed")   # layouts only the task-list kernels (distca, cudnn, hopper) take
FORMAT = "distca-kernel-table"
TABLES = Path(__file__).resolve().parent / "kernel_tables"


def classify(task_array: np.ndarray) -> str:
    """`long` or `shards` for a task list of (q_offset, q_len, kv_offset, kv_len, is_causal) rows."""
    rows = np.asarray(task_array)
    working = rows[(rows[:, 1] > 0) & (rows[:, 3] > 0)] if len(rows) else rows
    if len(working) == 0:
        return "long"
    return "long" if float(working[:, 1].mean()) >= LONG_ROWS else "shards"


def _row_kind(row: dict) -> str:
    if row["layout"] == "whole":
        return "long"
    if row["layout"] in ("shards", "reversed"):
        return "long" if int(row["shard"]) >= LONG_ROWS else "shards"
    tasks = max(int(row.get("tasks", 1)), 1)
    return "long" if int(row["tokens"]) / tasks >= LONG_ROWS else "shards"


def table_from_bench(report: dict) -> dict:
    """The table from a bench_cuda_attention.py report (its "rows"): per kind, the fastest backend,
    with each candidate's score (its summed relative time) and the shapes it was scored on."""
    if not isinstance(report, dict) or report.get("format") != "distca-bench-cuda-attention":
        raise ValueError("not a bench_cuda_attention.py report (format distca-bench-cuda-attention)")
    failed = sorted({c.get("backend") for c in report.get("checks", []) if not c.get("ok", False)})
    rows = [r for r in report.get("rows", []) if r.get("backend") in TABLE_BACKENDS and r.get("layout") != "equal-work"
            and r.get("backend") not in failed and r.get("fwd") and r.get("bwd")]
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        shapes: dict[tuple, dict[str, float]] = {}
        for r in rows:
            if _row_kind(r) == kind:
                key = (r["layout"], r["tokens"], r["shard"])
                shapes.setdefault(key, {})[r["backend"]] = r["fwd"]["seconds"] + r["bwd"]["seconds"]
        if not shapes:
            continue
        scores: dict[str, float] = {}
        for backend in TABLE_BACKENDS:
            runnable = [times for key, times in shapes.items() if backend != "varlen" or key[0] not in TASK_LIST_ONLY]
            if runnable and all(backend in times for times in runnable):
                scores[backend] = sum(times[backend] / min(times.values()) for times in runnable) / len(runnable)
        if scores:
            kinds[kind] = {"fastest": min(scores, key=lambda b: scores[b]), "scores": scores,
                           "shapes": [list(k) for k in shapes]}
    if not kinds:
        raise ValueError("the report has no timed rows of distca, cudnn, hopper or varlen that passed their checks: "
                         "nothing to choose from")
    return {"format": FORMAT, "version": 1, "device": report.get("device"), "capability": report.get("capability"),
            "dtype": report.get("dtype"), "torch": report.get("torch"), "date": report.get("date"),
            "long_rows": LONG_ROWS, "failed_checks": failed, "kinds": kinds}


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> dict:
    del mtime   # part of the cache key only: an edited file is read again
    table = json.loads(Path(path).read_text())
    if table.get("format") != FORMAT or not isinstance(table.get("kinds"), dict):
        raise ValueError(f"{path} is not a distca kernel table (format {FORMAT})")
    for kind, entry in table["kinds"].items():
        if kind not in KINDS or entry.get("fastest") not in TABLE_BACKENDS:
            raise ValueError(f"{path}: kind {kind!r} names {entry.get('fastest')!r}; kinds are {KINDS}, "
                             f"backends {TABLE_BACKENDS}")
    return table


def find_table(device_name: str) -> tuple[Optional[str], Optional[dict]]:
    """(path, table) for a device: DISTCA_KERNEL_TABLE where set (an unreadable file raises
    ValueError), else the shipped table of that device, else (None, None)."""
    env = os.environ.get("DISTCA_KERNEL_TABLE")
    path = Path(env) if env else TABLES / f"{device_slug(device_name)}.json"
    if not path.is_file():
        if env:
            raise ValueError(f"DISTCA_KERNEL_TABLE={env}: no such file")
        return None, None
    try:
        return str(path), _load(str(path), path.stat().st_mtime)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"kernel table {path}: {e}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distca.torch.kernel_table",
                                     description="The kernel table `auto` uses on CUDA, from a bench_cuda_attention.py report.")
    parser.add_argument("bench", help="the report (bench_cuda_attention.py --json)")
    parser.add_argument("--out", required=True, help="the table to write (refused if it exists and is not a table)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(Path(args.bench).read_text())
        table = table_from_bench(report)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        print(f"kernel_table: {args.bench}: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    if out.exists():
        try:
            if out.is_dir() or json.loads(out.read_text()).get("format") != FORMAT:
                raise ValueError
        except (OSError, ValueError, AttributeError):
            print(f"kernel_table: {out} exists and is not a kernel table: not overwritten", file=sys.stderr)
            return 1
    try:
        out.write_text(json.dumps(table, indent=1) + "\n")
    except OSError as e:
        print(f"kernel_table: cannot write {out}: {e}", file=sys.stderr)
        return 1
    for kind, entry in table["kinds"].items():
        print(f"{kind}: {entry['fastest']} ({', '.join(f'{b} {s:.2f}' for b, s in entry['scores'].items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
