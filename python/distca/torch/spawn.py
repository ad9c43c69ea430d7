"""Runs a function on N local processes joined by a gloo group: what the tests, the benchmarks and
the GPU check use to stand up a small "cluster" on one machine without torchrun.

    results = run_ranks(fn, 2, arg1, arg2, timeout=300)   # fn(rank, world, arg1, arg2) on 2 processes

Each process (started by a fork server, so fn must be importable by module path) joins a gloo group over a
FileStore in a temporary folder, runs fn with one torch thread, and reports fn's JSON-able return
value or its exception with the traceback; the parent returns [{"result": ..., "error": ...}] by
rank. Processes still running at the timeout are killed and TimeoutError raised.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store: str, out_dir: str, fn: Callable, args: tuple,
            group_timeout: Optional[float] = None) -> None:
    torch.set_num_threads(1)
    extra = {} if group_timeout is None else {"timeout": timedelta(seconds=group_timeout)}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, **extra)
    try:
        result, error = fn(rank, world, *args), None
    except BaseException as e:  # noqa: BLE001 (reported to the parent with its traceback)
        result, error = None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"result": result, "error": error}, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a peer that already failed)
        pass
    # The result is on disk: end here, without the interpreter's teardown, where an occasional
    # "terminate called without an active exception" (SIGABRT, once in several hundred spawned
    # ranks on the 2-core CI machine, not reproduced in 40 reruns) failed a rank whose result was
    # already written.
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The ranks are forked from multiprocessing's fork server, which imports these once (PyTorch's import
# alone costs about 2 s of CPU a process here) instead of once a rank as "spawn" does; the server
# touches no device and starts no threads, so its children start as clean as spawned ones.
# torch._dynamo too: PyTorch imports it on a rank's first optimizer step (torch.optim's steps are
# wrapped by torch._disable_dynamo) or DistributedDataParallel, another 2.2 s of CPU a rank (with
# sympy), which was a fifth of the Python tests' CPU time. Its import queries no device and starts
# no thread (checked with torch 2.15).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "distca", "distca.torch"]


def _start_method() -> str:
    import multiprocessing
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server first starts
    return "forkserver"


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600,
              group_timeout: Optional[float] = None) -> list:
    """fn(rank, world, *args) on `world` spawned gloo processes -> each rank's {"result", "error"}.
    group_timeout: the default group's collective timeout in seconds (PyTorch's default: 30 min)."""
    with tempfile.TemporaryDirectory(prefix="distca-ranks-") as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, fn, args, group_timeout),
                                 nprocs=world,
                                 join=False, start_method=_start_method())
        deadline = time.time() + timeout
        while not ctx.join(timeout=1):
            if time.time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks ran past {timeout:.0f} s")
        out = []
        for rank in range(world):
            path = Path(tmp) / f"rank{rank}.json"
            out.append(json.loads(path.read_text()) if path.is_file()
                       else {"result": None, "error": f"rank {rank} wrote no result"})
    return out
