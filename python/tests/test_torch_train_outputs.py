"""The distca.torch trainer's files (issue 50): outputs that destroy nothing that is not their own,
checkpoints that cannot run code, one line and exit 2 for every bad flag and data line, data read
with memory bounded by the file's size, and a report checked before the first step.

The cases that train run one or two gloo ranks of the tiny preset for one or two steps; the
others fail before any process group exists and run in this process."""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distca.torch.train import checkpoint  # noqa: E402
from distca.torch.spawn import run_ranks  # noqa: E402
from distca.torch.train.data import DataError, read_jsonl  # noqa: E402
from distca.torch.train.trainer import main  # noqa: E402

TINY = ["--preset", "tiny", "--steps", "1", "--workload", "packed"]


def train_worker(rank, world, argv, cwd):
    from distca.torch.train.trainer import main as train_main
    os.chdir(cwd)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = train_main(argv)
    return {"code": code, "stdout": out.getvalue()}


def _train(world, argv, cwd, timeout=120):
    results = run_ranks(train_worker, world, list(argv), str(cwd), timeout=timeout)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
    return [r["result"] for r in results]


def _refused(argv, capsys, *, contains):
    """main(argv) in this process: exit 2 with one line containing `contains`, no step run."""
    assert main(argv) == 2
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distca.torch.train: error: "), out
    assert contains in lines[0], out
    return lines[0]


def _tree(path: Path) -> dict:
    """Every file and folder under `path` with its bytes (files) and inode: what must not change."""
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(path))] = (st.st_ino, p.read_bytes() if p.is_file() else None)
    return out


# ---------------------------------------------------------------------------------------------
# 1. Outputs never destroy


def test_checkpoint_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    """Notes and sub-folders, the folder holding --data, the working folder and those above it."""
    mine = tmp_path / "runs"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "sub" / "x.bin").write_bytes(b"\0" * 10)
    before = _tree(tmp_path)
    _refused(TINY + ["--checkpoint", str(mine)], capsys, contains="a folder this trainer did not make is there")
    data = tmp_path / "data"
    data.mkdir()
    (data / "d.jsonl").write_text('{"text": "hello there"}\n')
    _refused(["--preset", "tiny", "--steps", "1", "--data", str(data / "d.jsonl"), "--checkpoint", str(data)], capsys,
             contains="holds the --data input")
    for folder in (".", "..", "/"):
        _refused(TINY + ["--checkpoint", folder], capsys, contains="the working folder or one above it")
    # A checkpoint of this trainer that someone added a file to is no longer only ours.
    fake = tmp_path / "ck"
    fake.mkdir()
    (fake / checkpoint.META).write_text(json.dumps({"format": checkpoint.FORMAT, "version": 2}))
    (fake / "README").write_text("keep me")
    _refused(TINY + ["--checkpoint", str(fake)], capsys, contains="did not make")
    assert {k: v for k, v in _tree(tmp_path).items() if k.startswith("runs")} == before


def test_checkpoint_around_or_inside_the_resumed_one_is_refused(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / checkpoint.META).write_text("{}")
    _refused(TINY + ["--steps", "2", "--resume", str(ck), "--checkpoint", str(ck / "inner")], capsys,
             contains="lies inside the --resume folder")
    _refused(TINY + ["--steps", "2", "--resume", str(ck), "--checkpoint", str(tmp_path)], capsys,
             contains="holds the --resume input")


def test_a_save_touches_only_its_own_folders(tmp_path):
    """Folders of the user's named like a save's scratch (X.partial, X.old) survive every save; the
    checkpoint resumed from (X.partial here) is never moved; X itself is replaced only while it is
    this trainer's."""
    ck = tmp_path / "ck"
    for name in ("ck.partial", "ck.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    keep = _tree(tmp_path)
    out = _train(1, TINY + ["--steps", "2", "--save-every", "1", "--checkpoint", str(ck)], tmp_path)
    assert [r["code"] for r in out] == [0], out
    assert sorted(os.listdir(ck)) == sorted(checkpoint.OWN_FILES)
    after = _tree(tmp_path)
    assert {k: after.get(k) for k in keep} == keep
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.old", "ck.partial"]       # no scratch left behind
    # Resume from a folder named like the scratch into the checkpoint's own name.
    os.rename(ck, tmp_path / "resume.partial")
    resume = tmp_path / "resume.partial"
    head = _tree(resume)
    out = _train(1, TINY + ["--steps", "3", "--resume", str(resume), "--checkpoint", str(tmp_path / "resume")],
                 tmp_path)
    assert [r["code"] for r in out] == [0], out
    assert _tree(resume) == head
    assert (tmp_path / "resume" / checkpoint.META).is_file()
    # Continuing in place (as `distca train --resume F --checkpoint F`): replaced by the newer one.
    out = _train(1, TINY + ["--steps", "4", "--resume", str(tmp_path / "resume"), "--checkpoint",
                            str(tmp_path / "resume")], tmp_path)
    assert [r["code"] for r in out] == [0], out
    assert checkpoint.read_header(str(tmp_path / "resume"))["steps_done"] == 4


def test_an_unwritable_report_or_checkpoint_is_refused_before_the_first_step(tmp_path, capsys):
    """A folder no file can be made in (/proc here, as root too): refused up front, not after training."""
    _refused(TINY + ["--json", "/proc/distca-report.json"], capsys, contains="cannot write in the folder /proc")
    _refused(TINY + ["--checkpoint", "/proc/distca-ck"], capsys, contains="cannot write in the folder /proc")
    (tmp_path / "ck").mkdir()
    _refused(TINY + ["--checkpoint", str(tmp_path / "ck"), "--json", str(tmp_path / "ck" / "r.json")], capsys,
             contains="inside it")


# ---------------------------------------------------------------------------------------------
# 4. No code from files


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted_v1(folder: Path, marker: Path) -> None:
    """A version-1 (torch.distributed.checkpoint) checkpoint whose .metadata pickle runs a command."""
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    from distca.torch.train.model import PRESET_CONTEXT, PRESETS
    # Every field as this run's, so a reader that trusts the header goes on to the pickle.
    head = {"format": checkpoint.FORMAT, "version": 1, "steps_done": 1, "backends": ["cad"], "ranks": 2,
            "context": PRESET_CONTEXT["tiny"], "model": PRESETS["tiny"].to_dict(), "workload": "packed", "seed": 1}
    (folder / checkpoint.META).write_text(json.dumps(head))


def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    marker = tmp_path / "owned"
    bad = tmp_path / "bad"
    _crafted_v1(bad, marker)
    out = _train(2, TINY + ["--steps", "3", "--resume", str(bad)], tmp_path)
    assert [r["code"] for r in out] == [2, 2], out
    assert "version 1" in out[0]["stdout"] and len(out[0]["stdout"].strip().splitlines()) == 1, out
    assert not marker.exists()
    # The data file replaced by a pickle: its size and SHA-256 give it away before any byte is used.
    good = tmp_path / "good"
    assert [r["code"] for r in _train(1, TINY + ["--checkpoint", str(good)], tmp_path)] == [0]
    size = (good / checkpoint.DATA).stat().st_size
    payload = pickle.dumps(_Payload(marker))
    (good / checkpoint.DATA).write_bytes(payload + b"\0" * (size - len(payload)))
    out = _train(1, TINY + ["--steps", "2", "--resume", str(good)], tmp_path)
    assert [r["code"] for r in out] == [2] and "SHA-256" in out[0]["stdout"], out
    assert not marker.exists()


def _saved(tmp_path: Path) -> tuple:
    folder = tmp_path / "ck"
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(7, dtype=torch.int64),
               "c": torch.ones(4, dtype=torch.bfloat16)}
    checkpoint.save(str(folder), {"steps_done": 1}, tensors)
    return folder, tensors


def test_the_tensor_format_round_trips_and_checks_every_field(tmp_path):
    folder, tensors = _saved(tmp_path)
    got = checkpoint.load(str(folder), checkpoint.read_header(str(folder)))
    assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) and got[k].dtype == tensors[k].dtype
                                            for k in tensors)
    head = json.loads((folder / checkpoint.META).read_text())
    entries = head["tensors"]["entries"]
    for change, message in (
            (lambda e: e[0].update(dtype="object"), "is not one of"),
            (lambda e: e[0].update(shape=[2, 3000]), "lie past the data"),
            (lambda e: e[0].update(offset=-1), "offset must be an integer"),
            (lambda e: e[1].update(name="a"), "not used before"),
            (lambda e: e[0].update(extra=1), "exactly name, dtype, shape and offset"),
            (lambda e: e[0].update(shape=[True]), "shape must be a list")):
        bad = json.loads(json.dumps(head))
        change(bad["tensors"]["entries"])
        (folder / checkpoint.META).write_text(json.dumps(bad))
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.load(str(folder), checkpoint.read_header(str(folder)))
    assert entries  # the header was a real table
    (folder / checkpoint.META).write_text("[" * 100_000)
    with pytest.raises(checkpoint.CheckpointError, match="not JSON"):
        checkpoint.read_header(str(folder))


# ---------------------------------------------------------------------------------------------
# 5. One line, exit 2


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed must be 0.."),
    (["--timeout", "inf"], "--timeout must be"),
    (["--timeout", "1e30"], "--timeout must be"),
    (["--timeout", "1e-6"], "--timeout must be"),
    (["--timeout", "nan"], "--timeout must be"),
    (["--bucket-mb", "inf"], "--bucket-mb must be"),
    (["--bucket-mb", "nan"], "--bucket-mb must be"),
    (["--json", ""], "--json needs a file name"),
    (["--checkpoint", ""], "--checkpoint needs a folder name"),
    (["--grad-return", "fp16"], "argument --grad-return: invalid choice: 'fp16'"),
    (["--attention", "colocated", "--grad-return", "bf16"], "--grad-return would be ignored with --attention colocated"),
])
def test_bad_numbers_and_names_one_line_exit_2(argv, message, capsys):
    _refused(TINY + argv, capsys, contains=message)


@pytest.mark.parametrize("text, message", [
    ('{"text": "ok go"}\n' + "[" * 100_000 + "\n", ":2: nested too deeply"),
    ('{"text": "ok go"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", ":2: nested too deeply"),
    ('{"text": "a"}\n{"text": "b"}\n', "every document is one byte long"),
    ('{"text": "ok"}\n{"text": "\\ud800"}\n', None),                  # a lone surrogate: bytes as given
], ids=["nested-line", "nested-text", "one-byte-documents", "lone-surrogate"])
def test_bad_data_is_one_line_naming_file_and_line(tmp_path, text, message):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    if message is None:
        assert len(read_jsonl(str(path))) == 2
        return
    with pytest.raises(DataError) as raised:
        read_jsonl(str(path))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_step_with_no_targets_is_refused_naming_the_line(tmp_path):
    from distca.torch.train.data import JsonlData
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "abcdefgh"}\n' + '{"text": "x"}\n' * 64)
    data = JsonlData(str(path), read_jsonl(str(path)), 1, 16)
    data.step(0)                                   # 8 bytes of text + 8 one-byte documents: targets
    with pytest.raises(DataError, match=r"d.jsonl:\d+: step 2 holds only one-byte documents"):
        data.step(1)


def test_bad_data_ends_both_ranks_with_exit_2(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine text"}\n' + "[" * 100_000 + "\n")
    out = _train(2, ["--preset", "tiny", "--steps", "1", "--data", str(path)], tmp_path)
    assert [r["code"] for r in out] == [2, 2], out
    assert out[0]["stdout"].strip() == f"distca.torch.train: error: {path}:2: nested too deeply to be a document"


def test_data_that_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(["--preset", "tiny", "--steps", "1", "--data", str(fifo)], capsys, contains="not a regular file")
    _refused(["--preset", "tiny", "--steps", "1", "--data", str(tmp_path)], capsys, contains="is a folder")
    _refused(["--preset", "tiny", "--steps", "1", "--data", str(tmp_path / "none")], capsys,
             contains="no such data file")


# ---------------------------------------------------------------------------------------------
# 6. Bounded, visible work


def test_data_memory_is_the_files_size_plus_16_bytes_a_document(tmp_path):
    """100 000 short documents (the case where per-document objects cost more than the text):
    the documents held take at most the file's size plus 16 bytes each, the peak while reading
    at most 1.5x that (the reader of before held each document as its own array: 3.7x here)."""
    path = tmp_path / "many.jsonl"
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for n in rng.integers(8, 64, size=100_000):
            f.write(json.dumps({"text": "ab" * int(n // 2)}) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        docs = read_jsonl(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(docs) == 100_000
    assert docs.nbytes <= size + 16 * len(docs), (docs.nbytes, size)
    assert peak <= 1.5 * (size + 16 * len(docs)), (peak, size)


def test_reading_data_reports_progress(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "some text"}\n' * 5)
    import distca.torch.train.data as data
    monkeypatch.setattr(data, "PROGRESS_SECONDS", 0.0)
    lines: list = []
    read_jsonl(str(path), progress=lines.append)
    assert len(lines) == 5 and lines[-1].startswith(f"reading {path}: 0 of 0 MiB, 5 documents"), lines


def test_ctrl_c_leaves_a_whole_checkpoint_and_one_line(tmp_path):
    """SIGINT while training (a world of one under plain python): exit 130, one line naming the
    checkpoint's step, no traceback; the checkpoint resumes; no scratch folder is left behind."""
    import signal
    import subprocess
    import sys
    import time
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-X", "faulthandler", "-m", "distca.torch.train", "--preset", "tiny", "--steps", "100000", "--save-every", "2",
           "--checkpoint", str(ck), "--log-every", "1000"]
    # SIGINT at its default in the child: a suite started in the background (`.ci/run &`) inherits
    # it ignored, and Python then installs no KeyboardInterrupt handler.
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not (ck / checkpoint.META).is_file() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)      # faulthandler prints every thread's stack
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"still running 60 s after SIGINT\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    last = out.strip().splitlines()[-1]
    assert last.startswith("distca.torch.train: interrupted; ") and "saved whole" in last, out
    assert "Traceback" not in err, err
    step = int(last.split("checkpoint of step ")[1].split(",")[0])
    assert checkpoint.read_header(str(ck))["steps_done"] == step
    assert sorted(os.listdir(tmp_path)) == ["ck"] or all(name == "ck" or ".distca-" in name
                                                          for name in os.listdir(tmp_path))
    out = _train(1, ["--preset", "tiny", "--steps", str(step + 1), "--resume", str(ck), "--checkpoint", str(ck)],
                 tmp_path)
    assert [r["code"] for r in out] == [0], out
    assert sorted(os.listdir(tmp_path)) == ["ck"]          # a stale scratch folder of ours is cleaned


def test_grad_return_flag_reaches_the_config():
    from distca.torch.train.config import parse_args
    assert parse_args(TINY + ["--grad-return", "bf16"]).grad_return == "bf16"
    assert parse_args(TINY).grad_return == "fp32"
