"""How distca.torch ends when something goes wrong (issue 72's row 3): a script whose
StepPlanner outlives dist.destroy_process_group() exits 0. It needs a real interpreter exit, so
it runs two plain Python processes."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402


def _need_gloo():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip(f"torch.distributed.is_gloo_available() is False (torch {torch.__version__})")


# ---------------------------------------------------------------------------------------------
# Row 3: a script's planner outliving dist.destroy_process_group()

EXIT_CHECK = textwrap.dedent('''
    import atexit, os, sys
    def threads():
        return len(os.listdir("/proc/self/task"))
    started = threads()
    def check():                       # registered first, so it runs after distca's own at-exit work
        if threads() != started:
            print(f"at exit: {threads()} threads, {started} at start: a gloo group is still alive", flush=True)
            os._exit(3)
    atexit.register(check)
    import torch
    import torch.distributed as dist
    from distca.torch import StepPlanner, cad_attention

    dist.init_process_group("gloo")    # as docs/torch.md's snippet: the planner at module level
    rank = dist.get_rank()
    planner = StepPlanner(model={"heads": 2, "kv_heads": 1, "head_dim": 16}, policy="minbytes", tolerance=0.05)
    layout = planner.plan([0, 48] if rank == 0 else [0, 8, 16])
    q = torch.randn(layout.num_local_rows, 2, 16, requires_grad=True)
    k, v = (torch.randn(layout.num_local_rows, 1, 16, requires_grad=True) for _ in range(2))
    cad_attention(q, k, v, layout).sum().backward()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
''')


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_row3_planner_outliving_destroyed_group_exits_0(tmp_path):
    """The planner and its layout are alive at exit (module level), their group destroyed: the
    process exits 0. Deterministic where the abort is not (about 6 runs in 10 under torchrun): a
    gloo group something still holds keeps its worker threads, which the check, run after every
    other at-exit handler, counts; those threads are what aborts the interpreter's teardown."""
    _need_gloo()
    script = tmp_path / "module_level.py"
    script.write_text(EXIT_CHECK)
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the script ran past 120 s")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out}"
        assert f"rank {r} done" in out and "terminate called" not in out, out
