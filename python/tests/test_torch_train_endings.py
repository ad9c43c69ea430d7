"""How the distca.torch trainer ends when something goes wrong (issue 72's rows 3-6, 12 and 13):
every ending is one line naming the rank, with the exit status `--help` promises (0 done, 2 bad
input, 1 the run failed, 130 interrupted), and nothing is left behind.

The ranks are forked gloo processes of the tiny preset (the fork server of distca.torch.spawn, so
no rank pays PyTorch's import), each rank's output in a file of its own and its pid at hand, so a
test can stop (SIGSTOP) or interrupt (SIGINT) one rank at a chosen step. Row 3 needs a real
interpreter exit, so it runs two plain Python processes; row 5's rank that is alone with its bad
flags (torchrun's case, before any process group) runs one."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from distca.torch.train import checkpoint  # noqa: E402

PROG = "distca.torch.train"
TINY = ["--preset", "tiny", "--workload", "packed"]
TIMEOUT = 2          # --timeout of the runs that stall a rank: seconds


def _need_gloo():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip(f"torch.distributed.is_gloo_available() is False (torch {torch.__version__})")


# ---------------------------------------------------------------------------------------------
# Ranks whose processes a test can signal


def _rank_main(rank, world, store, out_dir, fn, args, group_timeout):
    """One rank: its stdout and stderr (the file descriptors: C++ too) into rankN.out, Ctrl-C
    raising KeyboardInterrupt (a suite started in the background inherits SIGINT ignored), a gloo
    group over a FileStore, fn's result or traceback into rankN.json, then out without the
    interpreter's teardown (as distca.torch.spawn's ranks)."""
    out = open(os.path.join(out_dir, f"rank{rank}.out"), "w", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=group_timeout))
    try:
        result, error = fn(rank, world, *args), None
    except BaseException as e:  # noqa: BLE001 (reported to the test with its traceback)
        result, error = None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"result": result, "error": error}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Ranks:
    """`world` forked ranks running fn(rank, world, *args); pids for signals, each rank's output."""

    def __init__(self, fn, world, *args, group_timeout=30):
        from distca.torch.spawn import _start_method
        self._tmp = tempfile.TemporaryDirectory(prefix="distca-endings-")
        self.dir = Path(self._tmp.name)
        self.world = world
        self._ctx = mp.start_processes(_rank_main, args=(world, str(self.dir / "store"), str(self.dir), fn, args,
                                                         group_timeout),
                                       nprocs=world, join=False, start_method=_start_method())
        self.pids = [p.pid for p in self._ctx.processes]

    def output(self, rank) -> str:
        path = self.dir / f"rank{rank}.out"
        return path.read_text(errors="replace") if path.is_file() else ""

    def wait_for(self, rank, text, timeout=60):
        """Until rank `rank` has printed `text` (fails the test if it ends or takes too long)."""
        deadline = time.time() + timeout
        while text not in self.output(rank):
            if time.time() > deadline or not self._ctx.processes[rank].is_alive():
                self.kill()
                pytest.fail(f"rank {rank} did not print {text!r}:\n{self.output(rank)[-3000:]}")
            time.sleep(0.05)

    def results(self, timeout=60, ranks=None) -> list:
        """Each rank's {"result", "error", "output"} once the ranks in `ranks` (all) have ended."""
        ranks = range(self.world) if ranks is None else ranks
        deadline = time.time() + timeout
        while any(self._ctx.processes[r].is_alive() for r in ranks):
            if time.time() > deadline:
                outputs = "\n".join(f"rank {r}:\n{self.output(r)[-3000:]}" for r in range(self.world))
                self.kill()
                pytest.fail(f"the ranks ran past {timeout} s:\n{outputs}")
            time.sleep(0.05)
        out = []
        for r in range(self.world):
            path = self.dir / f"rank{r}.json"
            done = json.loads(path.read_text()) if path.is_file() else {"result": None, "error": "no result"}
            out.append(dict(done, output=self.output(r)))
        return out

    def kill(self):
        for p in self._ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        self._tmp.cleanup()


def train_worker(rank, world, argv):
    """main(argv), its output where the rank's goes (the test reads it as it comes)."""
    from distca.torch.train.trainer import main
    return {"code": main(argv)}


def runs_worker(rank, world, runs):
    """Several runs in turn, each refused before training (so the group stays usable): run i
    with runs[i]["argv"][rank], in the folder runs[i]["cwd"][rank], with runs[i]["env"][rank]
    added to the environment; each run's exit status and what it printed."""
    from distca.torch.train.trainer import main
    out = []
    for run in runs:
        os.chdir(run["cwd"][rank])
        env = run.get("env", [{}] * world)[rank]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                code = main(list(run["argv"][rank]))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out.append({"code": code, "stdout": printed.getvalue()})
    return out


def _one_line(text):
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _no_traceback(results):
    for r, res in enumerate(results):
        assert res["error"] is None, f"rank {r}: {res['error']}"
        assert "Traceback" not in res["output"] and "terminate called" not in res["output"], \
            f"rank {r}:\n{res['output']}"


def test_help_states_every_exit_status(capsys):
    from distca.torch.train.trainer import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    ending = out[out.index("exit status"):]
    for status, what in (("0", "done"), ("2", "bad input"), ("1", "the run failed"), ("130", "interrupted")):
        assert f"  {status:<4} {what}" in ending, ending
    assert "timed out (--timeout; the line names the rank" in ending, ending


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


# ---------------------------------------------------------------------------------------------
# Row 4: a rank stopped mid-run


def test_row4_a_stalled_rank_is_named_in_one_line_exit_1():
    """SIGSTOP rank 1 once step 5 has been printed: rank 0's collective times out after --timeout and it ends
    with one line naming the step's phase, the timeout and rank 1, exit 1; no traceback."""
    _need_gloo()
    argv = TINY + ["--steps", "100000", "--timeout", str(TIMEOUT)]
    with Ranks(train_worker, 2, argv, group_timeout=TIMEOUT) as ranks:
        ranks.wait_for(0, "step    5/")
        os.kill(ranks.pids[1], signal.SIGSTOP)
        stopped = time.time()
        res = ranks.results(timeout=30, ranks=[0])
        took = time.time() - stopped
    _no_traceback(res[:1])
    assert res[0]["result"] == {"code": 1}, res[0]
    last = res[0]["output"].strip().splitlines()[-1]
    assert last.startswith(f"{PROG}: error: rank 0: a collective in step "), res[0]["output"]
    assert f"timed out after {TIMEOUT} s (--timeout), waiting for rank 1: no sign of life" in last, last
    # The stop lands after rank 0 printed step 5's line, but the ranks run on while that line
    # crosses the pipe to this process, so the step is 5 or later; rank 1 is named in the step
    # rank 0 waits in, or one apart (it stopped before entering it, or a collective ahead).
    step = int(last.split("in step ")[1].split("'")[0])
    assert step >= 5, last
    theirs = int(last.split("rank 1 last in step ")[1].split("'")[0])
    assert abs(theirs - step) <= 1, last
    assert "error" not in res[0]["output"].strip().splitlines()[-2], res[0]["output"]   # the one line
    assert took < TIMEOUT + 10, took


# ---------------------------------------------------------------------------------------------
# Row 5: what only one rank finds, before the first step


def test_row5_an_error_only_one_rank_finds_names_that_rank(tmp_path):
    """--data missing on rank 1's machine, DISTCA_CPU_ISA=bogus there, --steps 0 there: every
    rank exits 2 at once and rank 0 prints one line naming rank 1 and its error (ranks in one
    process group). Under torchrun, before any group exists, rank 1 alone prints its line with
    its rank after 3 s (where rank 0 failed the same way torchrun has ended it by then)."""
    _need_gloo()
    alone = subprocess.Popen([sys.executable, "-m", "distca.torch.train", *TINY, "--steps", "0"], cwd=tmp_path,
                             env=dict(os.environ, RANK="1", WORLD_SIZE="2", OMP_NUM_THREADS="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    here, there = tmp_path / "rank0", tmp_path / "rank1"
    here.mkdir()
    there.mkdir()
    (here / "d.jsonl").write_text('{"text": "the same documents on every rank"}\n' * 8)
    data = TINY[:2] + ["--data", "d.jsonl", "--steps", "2"]
    folders = [str(here), str(there)]
    runs = [{"argv": [data, data], "cwd": folders},
            {"argv": [TINY + ["--steps", "2"]] * 2, "cwd": folders, "env": [{}, {"DISTCA_CPU_ISA": "bogus"}]},
            {"argv": [TINY + ["--steps", "2"], TINY + ["--steps", "0"]], "cwd": folders}]
    with Ranks(runs_worker, 2, runs, group_timeout=20) as ranks:
        res = ranks.results(timeout=60)
    _no_traceback(res)
    missing, isa, steps = zip(*(r["result"] for r in res))
    for run, message in ((missing, "rank 1: --data d.jsonl: no such data file"),
                         (isa, "rank 1: --kernel auto: DISTCA_CPU_ISA=bogus: no 'bogus' build"),
                         (steps, "rank 1: --steps must be 1..100000000, got 0")):
        assert [r["code"] for r in run] == [2, 2], run
        assert _one_line(run[0]["stdout"]).startswith(f"{PROG}: error: {message}"), run
        assert run[1]["stdout"] == "", run
    out, err = alone.communicate(timeout=60)
    assert alone.returncode == 2, (out, err)
    assert _one_line(out) == f"{PROG}: error: rank 1: --steps must be 1..100000000, got 0", (out, err)
    assert err == "", err


# ---------------------------------------------------------------------------------------------
# Row 6: the data, named by its content


def test_row6b_ranks_that_read_different_data_are_refused_before_training(tmp_path):
    """--data d.jsonl names other bytes on each rank (another machine's copy, or the file rewritten
    while the ranks read it): one line with both fingerprints, exit 2 on every rank, no step."""
    _need_gloo()
    folders = []
    for r, text in enumerate(("first version of the documents", "second version, rewritten")):
        folder = tmp_path / f"rank{r}"
        folder.mkdir()
        (folder / "d.jsonl").write_text(json.dumps({"text": text}) + "\n")
        folders.append(str(folder))
    argv = TINY[:2] + ["--data", "d.jsonl", "--steps", "2"]
    with Ranks(runs_worker, 2, [{"argv": [argv, argv], "cwd": folders}], group_timeout=20) as ranks:
        res = ranks.results(timeout=60)
    _no_traceback(res)
    run = [r["result"][0] for r in res]
    assert [r["code"] for r in run] == [2, 2], run
    line = _one_line(run[0]["stdout"])
    assert line.startswith(f"{PROG}: error: --data d.jsonl: the ranks read different data (rank 0: 1 document, "
                           f"30 bytes, sha256 "), line
    assert "rank 1: 1 document, 25 bytes, sha256 " in line and "step" not in line, line
    assert run[1]["stdout"] == ""


def resume_worker(rank, world, folder, data, ck):
    """Train 3 steps with a checkpoint; rank 0 reverses the data file's lines; resume."""
    from distca.torch.train.trainer import main
    os.chdir(folder)
    out = []
    for argv in (["--steps", "3", "--checkpoint", ck], ["--steps", "5", "--resume", ck]):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out.append({"code": main(TINY[:2] + ["--data", data] + argv), "stdout": printed.getvalue()})
        dist.barrier()
        if rank == 0 and len(out) == 1:
            lines = Path(data).read_text().splitlines()
            Path(data).write_text("\n".join(reversed(lines)) + "\n")
        dist.barrier()
    return out


def test_row6a_resume_on_rewritten_data_is_refused(tmp_path):
    """The same path, the same bytes in another order: the checkpoint's data fingerprint differs
    and the resume is refused on every rank in one line, exit 2."""
    _need_gloo()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "abc " * (5 + i)}) + "\n" for i in range(40)))
    with Ranks(resume_worker, 2, str(tmp_path), str(data), str(tmp_path / "ck"), group_timeout=30) as ranks:
        res = ranks.results(timeout=90)
    _no_traceback(res)
    trained, resumed = zip(*(r["result"] for r in res))
    assert [r["code"] for r in trained] == [0, 0], trained[0]["stdout"]
    assert [r["code"] for r in resumed] == [2, 2], resumed
    head = json.loads((tmp_path / "ck" / checkpoint.META).read_text())
    assert head["version"] == checkpoint.VERSION == 3 and head["data"].startswith("40 documents, "), head["data"]
    line = _one_line(resumed[0]["stdout"])
    assert line.startswith(f'{PROG}: error: {tmp_path / "ck" / checkpoint.META}: field "data" is "40 documents, '), line
    assert "this run has \"40 documents, " in line and "resume with the same flags, ranks and data" in line, line
    assert resumed[1]["stdout"] == ""


def test_row6_the_fingerprint_is_the_content_not_the_path(tmp_path):
    from distca.torch.train.data import read_jsonl
    texts = {"a.jsonl": ["abc", "de"], "moved.jsonl": ["abc", "de"], "cut.jsonl": ["ab", "cde"],
             "reversed.jsonl": ["de", "abc"]}
    prints = {}
    for name, docs in texts.items():
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        prints[name] = read_jsonl(str(tmp_path / name)).fingerprint()
    assert prints["a.jsonl"] == prints["moved.jsonl"]
    assert prints["a.jsonl"].startswith("2 documents, 5 bytes, sha256 ")
    assert len({prints[n] for n in ("a.jsonl", "cut.jsonl", "reversed.jsonl")}) == 3, prints


def test_row6_an_older_checkpoint_is_refused_saying_why(tmp_path):
    folder = tmp_path / "ck"
    checkpoint.save(str(folder), {"steps_done": 1}, {"a": torch.zeros(2)})
    head = json.loads((folder / checkpoint.META).read_text())
    for version, why in ((2, "version 2 named the --data file by its path"),
                         (1, "pickled metadata could run code on load")):
        (folder / checkpoint.META).write_text(json.dumps(dict(head, version=version)))
        with pytest.raises(checkpoint.CheckpointError) as raised:
            checkpoint.read_header(str(folder))
        message = str(raised.value)
        assert f"version {version}; this trainer reads version 3 (" in message and why in message, message
        assert "\n" not in message and message.endswith("retrain, or resume with the distca that wrote it")


# ---------------------------------------------------------------------------------------------
# Row 12: a save on a full disk


def full_disk_worker(rank, world, folder, ck, limit):
    """A checkpoint of step 1; then, with no file allowed past `limit` bytes (a full disk to the
    writer: EFBIG, SIGXFSZ ignored), a resumed run whose save fails."""
    import resource
    from distca.torch.train.trainer import main
    os.chdir(folder)
    out = []
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for argv in (["--steps", "1", "--checkpoint", ck], ["--steps", "2", "--resume", ck, "--checkpoint", ck]):
        if out:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out.append({"code": main(TINY + argv), "stdout": printed.getvalue()})
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return out


def test_row12_a_save_on_a_full_disk_leaves_the_old_checkpoint_and_no_scratch(tmp_path):
    _need_gloo()
    ck = tmp_path / "ck"
    with Ranks(full_disk_worker, 1, str(tmp_path), str(ck), 256 << 10, group_timeout=30) as ranks:
        res = ranks.results(timeout=90)
    _no_traceback(res)
    first, failed = res[0]["result"]
    assert first["code"] == 0, first["stdout"]
    assert (ck / checkpoint.DATA).stat().st_size > 256 << 10          # the limit cuts the new state.bin short
    assert failed["code"] == 1, failed
    line = failed["stdout"].strip().splitlines()[-1]
    assert line.startswith(f"{PROG}: error: --checkpoint {ck}: the save after step 2 failed ("), failed["stdout"]
    assert "error" not in "".join(failed["stdout"].strip().splitlines()[:-1])
    assert checkpoint.read_header(str(ck))["steps_done"] == 1
    checkpoint.load(str(ck), checkpoint.read_header(str(ck)))          # whole: its size and SHA-256 check
    assert sorted(os.listdir(tmp_path)) == ["ck"], os.listdir(tmp_path)   # no scratch folder left


# ---------------------------------------------------------------------------------------------
# Row 13: Ctrl-C


def stop_in_backward_worker(rank, world, argv, step):
    """main(argv); rank 0 stops itself (SIGSTOP) as step `step`'s backward begins: a hook on its
    loss, so its peer, past the forward, waits for it inside the backward's exchanges."""
    import distca.torch.train.trainer as train
    if rank == 0:
        real, calls = train.packed_cross_entropy, [0]

        def stopping(logits, targets):
            loss = real(logits, targets)
            calls[0] += 1
            if calls[0] == step:
                loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGSTOP))
            return loss
        train.packed_cross_entropy = stopping
    return {"code": train.main(argv)}


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_row13_ctrl_c_while_a_rank_waits_on_its_peer_is_one_line():
    """torchrun passes Ctrl-C on to every rank, rank 0 first. Made deterministic: rank 0 stops as
    step 4's backward begins, so rank 1 waits for it inside its backward when both get SIGINT;
    rank 0 goes on, prints its "interrupted" line and leaves; rank 1's collective then fails
    inside autograd's engine before its own KeyboardInterrupt is raised (before: that error, then
    the KeyboardInterrupt, a 30-line traceback). Both exit 130; rank 1 prints nothing."""
    _need_gloo()
    with Ranks(stop_in_backward_worker, 2, TINY + ["--steps", "100000"], 4, group_timeout=30) as ranks:
        deadline = time.time() + 60
        while not _stopped(ranks.pids[0]):
            assert time.time() < deadline, ranks.output(0)
            time.sleep(0.05)
        time.sleep(0.5)                      # rank 1 reaches the backward's exchange and waits there
        for pid in ranks.pids:
            os.kill(pid, signal.SIGINT)
        os.kill(ranks.pids[0], signal.SIGCONT)
        res = ranks.results(timeout=30)
    _no_traceback(res)
    assert [r["result"] for r in res] == [{"code": 130}, {"code": 130}], res
    assert res[0]["output"].strip().splitlines()[-1] == f"{PROG}: interrupted", res[0]["output"]
    assert "step    3/" in res[0]["output"] and "step    4/" not in res[0]["output"], res[0]["output"]
    assert res[1]["output"].strip() == "", res[1]["output"]
