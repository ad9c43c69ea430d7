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

Both files are inputs under the project's rules (docs/cli.md; distca.inputs): at most
DISTCA_MAX_INPUT_MB, nesting at most 64 levels, UTF-8, their format and version checked, every
field checked before it is used (a time must be a positive finite number of seconds); a bad one is
one ValueError naming the file (DISTCA_KERNEL_TABLE's too). The command writes its table atomically
(a new file renamed over the old), never over the report it reads, and only over a kernel table;
bad input is one line and exit status 2, a failed write exit status 1.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .. import _distca, knobs
from ..arguments import excerpt
from ..inputs import InputFileError, read_json

LONG_ROWS = 512          # mean query rows per task at and above which a list is `long`
KINDS = ("long", "shards")
# The bench's backends that are distca.torch backends of the same name (the others time PyTorch's
# kernels on one document's shards, which no server task list is).
TABLE_BACKENDS = ("distca", "cudnn", "hopper", "varlen")
TASK_LIST_ONLY = ("plan", "reversed")   # layouts only the task-list kernels (distca, cudnn, hopper) take
FORMAT = "distca-kernel-table"
VERSION = 1
BENCH_FORMAT = "distca-bench-cuda-attention"
BENCH_VERSIONS = (1, 2)   # the report versions whose rows this reads (2 added keys beside the rows, 90a96a5)
LAYOUTS = ("whole", "shards", "reversed", "plan", "equal-work")   # bench_cuda_attention.py's
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
        return "long" if row["shard"] >= LONG_ROWS else "shards"
    return "long" if row["tokens"] / row.get("tasks", 1) >= LONG_ROWS else "shards"


def _is_count(value: Any, lo: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def _is_seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _got(item: dict, key: str) -> str:
    return excerpt(item[key]) if key in item else "nothing"


def _check_row(row: dict, where: str) -> None:
    """A candidate row of the report (a table backend's, not the equal-work baseline's): every
    field the choice reads, or ValueError naming the row and the field."""
    layout = row.get("layout")
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {', '.join(LAYOUTS)}, got {_got(row, 'layout')}")
    if not _is_count(row.get("tokens"), 1):
        raise ValueError(f"{where}: tokens must be a positive integer, got {_got(row, 'tokens')}")
    shard = row.get("shard")
    if (shard is not None or layout in ("shards", "reversed")) and not _is_count(shard, 1):
        raise ValueError(f"{where}: shard must be a positive integer{'' if layout in ('shards', 'reversed') else ' or null'}"
                         f" for layout {layout}, got {_got(row, 'shard')}")
    if "tasks" in row and not _is_count(row["tasks"], 1):
        raise ValueError(f"{where}: tasks must be a positive integer, got {_got(row, 'tasks')}")
    for p in ("fwd", "bwd"):
        timing = row.get(p)
        if not isinstance(timing, dict) or "seconds" not in timing:
            raise ValueError(f"{where}: no {p} time (an object with \"seconds\"), got {_got(row, p)}")
        if not _is_seconds(timing["seconds"]):
            raise ValueError(f"{where}: {p} seconds must be a positive finite number, got {_got(timing, 'seconds')}")


def _list_of_objects(report: dict, key: str) -> list:
    value = report.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list, got {excerpt(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"{key}[{i}] must be an object, got {excerpt(item)}")
        if not isinstance(item.get("backend"), str):
            raise ValueError(f"{key}[{i}] must name its backend (a string), got {_got(item, 'backend')}")
    return value


def table_from_bench(report: Any) -> dict:
    """The table from a bench_cuda_attention.py report (its "rows"): per kind, the fastest backend,
    with each candidate's score (its summed relative time) and the shapes it was scored on.
    ValueError naming the field for a report of another format or version, or a row the choice
    reads with a field missing or out of range (a time not positive and finite)."""
    if not isinstance(report, dict) or report.get("format") != BENCH_FORMAT:
        raise ValueError(f"not a bench_cuda_attention.py report (format {BENCH_FORMAT})")
    if report.get("version") not in BENCH_VERSIONS:
        raise ValueError(f"a bench_cuda_attention.py report of version {excerpt(report.get('version'))}; this "
                         f"distca reads versions {', '.join(map(str, BENCH_VERSIONS))} (rerun "
                         f"python/bench/bench_cuda_attention.py --json with this distca)")
    checks = _list_of_objects(report, "checks")
    for i, c in enumerate(checks):
        if not isinstance(c.get("ok", False), bool):
            raise ValueError(f"checks[{i}]: ok must be true or false, got {excerpt(c['ok'])}")
    failed = sorted({c["backend"] for c in checks if not c.get("ok", False)})
    rows = []
    for i, r in enumerate(_list_of_objects(report, "rows")):
        if r["backend"] not in TABLE_BACKENDS or r.get("layout") == "equal-work":
            continue
        _check_row(r, f"rows[{i}] ({r['backend']})")
        if r["backend"] not in failed:
            rows.append(r)
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        shapes: dict[tuple, dict[str, float]] = {}
        for r in rows:
            if _row_kind(r) == kind:
                key = (r["layout"], r["tokens"], r.get("shard"))
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
    return {"format": FORMAT, "version": VERSION, "device": report.get("device"),
            "capability": report.get("capability"), "dtype": report.get("dtype"), "torch": report.get("torch"),
            "date": report.get("date"), "long_rows": LONG_ROWS, "failed_checks": failed, "kinds": kinds}


def check_table(table: Any) -> dict:
    """A kernel table as `auto` reads it, or ValueError naming what is wrong: the format and
    version, and every kind's entry (a known kind naming a table backend)."""
    regenerate = "regenerate it with python -m distca.torch.kernel_table BENCH_JSON --out TABLE_JSON"
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise ValueError(f"not a distca kernel table (format {FORMAT})")
    if table.get("version") != VERSION:
        raise ValueError(f"a kernel table of version {excerpt(table.get('version'))}; this distca reads version "
                         f"{VERSION} ({regenerate})")
    kinds = table.get("kinds")
    if not isinstance(kinds, dict):
        raise ValueError(f"kinds must be an object of kind -> entry, got {excerpt(kinds)}")
    for kind, entry in kinds.items():
        if kind not in KINDS:
            raise ValueError(f"kind {excerpt(kind)} is not one of {', '.join(KINDS)}")
        if not isinstance(entry, dict) or entry.get("fastest") not in TABLE_BACKENDS:
            fastest = entry.get("fastest") if isinstance(entry, dict) else entry
            raise ValueError(f"kind {kind!r} names {excerpt(fastest)}; an entry is {{\"fastest\": one of "
                             f"{', '.join(TABLE_BACKENDS)}}}")
    return table


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> dict:
    del mtime_ns, size   # part of the cache key only: an edited file is read again
    table = read_json(path)
    try:
        return check_table(table)
    except ValueError as e:
        raise InputFileError(path, str(e)) from None


def load_table(path: str) -> dict:
    """The checked kernel table in the file at `path` (cached while the file is unchanged);
    InputFileError (a ValueError) naming the file."""
    try:
        st = os.stat(path)
    except OSError:
        return _load.__wrapped__(path, 0, 0)   # read_json raises, naming the file
    return _load(path, st.st_mtime_ns, st.st_size)


def find_table(device_name: str) -> tuple[Optional[str], Optional[dict]]:
    """(path, table) for a device: DISTCA_KERNEL_TABLE where set (a file that is missing or not a
    good table is one ValueError naming the variable and the file), else the shipped table of that
    device, else (None, None)."""
    env = knobs.get("DISTCA_KERNEL_TABLE")
    if env:
        try:
            return env, load_table(env)
        except InputFileError as e:
            raise ValueError(f"DISTCA_KERNEL_TABLE={env}: {e.reason}") from None
    path = TABLES / f"{device_slug(device_name)}.json"
    if not path.is_file():
        return None, None
    try:
        return str(path), load_table(str(path))
    except InputFileError as e:
        raise ValueError(f"kernel table {e}") from None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_out(out: str, bench: str) -> Optional[str]:
    """What is wrong with --out before any work (None when it may be written): an empty name, the
    report itself (however spelled), something other than a regular file, a file that is not a
    kernel table, a folder that is not there."""
    if not out:
        return "--out needs a file name"
    if _same_file(out, bench):
        return f"--out {out} names the report it reads ({bench}): not overwritten"
    if os.path.exists(out):
        if not os.path.isfile(out):
            return f"--out {out}: is not a regular file: not overwritten"
        try:
            check_table(read_json(out))
        except ValueError:
            return f"--out {out} exists and is not a kernel table: not overwritten"
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        return f"--out {out}: no such folder"
    if not os.access(folder, os.W_OK):
        return f"--out {out}: cannot write in the folder {folder}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distca.torch.kernel_table",
                                     description="The kernel table `auto` uses on CUDA, from a bench_cuda_attention.py "
                                                 "report. Exit status 2: bad input (one line); 1: the write failed.")
    parser.add_argument("bench", help="the report (bench_cuda_attention.py --json)")
    parser.add_argument("--out", required=True, help="the table to write, atomically (refused if it exists and is "
                                                     "not a table, or is the report)")
    args = parser.parse_args(argv)
    # 1. Bad input, before any work: the output path, then the report.
    problem = _check_out(args.out, args.bench)
    if problem is not None:
        print(f"kernel_table: {problem}", file=sys.stderr)
        return 2
    try:
        report = read_json(args.bench)
        try:
            table = table_from_bench(report)
        except ValueError as e:
            raise InputFileError(args.bench, str(e)) from None
    except ValueError as e:   # InputFileError, or DISTCA_MAX_INPUT_MB's own
        print(f"kernel_table: {e}", file=sys.stderr)
        return 2
    # 2. The table, written to a new file renamed over the old: complete or absent.
    try:
        _distca.write_file_atomic(args.out, json.dumps(table, indent=1) + "\n")
    except ValueError as e:   # the message names the file: "<out>: write failed (File too large)"
        print(f"kernel_table: {e}", file=sys.stderr)
        return 1
    for kind, entry in table["kinds"].items():
        print(f"{kind}: {entry['fastest']} ({', '.join(f'{b} {s:.2f}' for b, s in entry['scores'].items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
