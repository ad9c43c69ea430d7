"""The distca.torch trainer (python -m distca.torch.train) on CPU with gloo: CAD and colocated
attention train to the same loss curve from the same weights (2 ranks with the demo model on
skewed batches, 4 ranks with JSONL documents spanning ranks), a resumed run repeats the straight
run's curve, and bad flags, data or checkpoints end every rank with exit status 2 and one line.
No timing assertions: the speedup is measured by the trainer's own run (see docs/torch.md)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import time
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from distca.torch.spawn import run_ranks  # noqa: E402
from sizes import soak  # noqa: E402
from test_torch_train_memory import check_report as check_memory  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
# Compared steps of the demo model: the loss falls from 5.6 to about 2.7 in 10 (to 1.5 in 20).
DEMO_STEPS = soak(10, 20)


def _need_gloo():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip(f"torch.distributed.is_gloo_available() is False (torch {torch.__version__})")


def train_worker(rank, world, argv):
    """main(argv) on this rank -> (exit status, what rank 0 printed)."""
    from distca.torch.train.trainer import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return {"code": code, "stdout": out.getvalue()}


def _train(world, argv, timeout=240):
    results = run_ranks(train_worker, world, list(argv), timeout=timeout)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
    return [r["result"] for r in results]


def refusals_worker(rank, world, runs):
    """train_worker for several runs in turn in one process (runs[i][rank]: this rank's command line
    of run i), each timed. Only for runs refused before any training: every rank agrees on exit 2
    and the process group is left as it was, so they need not pay a spawn each."""
    out = []
    for argvs in runs:
        start = time.perf_counter()
        out.append(dict(train_worker(rank, world, argvs[rank]), seconds=time.perf_counter() - start))
    return out


def _refusals(world, runs, timeout=120):
    """refusals_worker on `world` ranks -> for each run, every rank's result."""
    results = run_ranks(refusals_worker, world, [list(r) for r in runs], timeout=timeout)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
    return [[r["result"][i] for r in results] for i in range(len(runs))]


def _losses(doc, backend):
    return [r["loss"] for r in doc["steps"] if r["backend"] == backend]


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _reference_loss(data, preset, context=None):
    """The first step's loss in one process, from the initial weights: every document of the step
    end to end, PyTorch's SDPA per document (distca.torch.train.model.document_attention), RoPE at
    positions counted from each document's first row here: independent of the planner's layout."""
    from distca.torch.train.model import PRESETS, Transformer, document_attention, packed_cross_entropy
    lengths = {}
    for pieces in data.pieces:
        for key, begin, end, n in pieces:
            lengths[key] = n
    cu = torch.tensor(np.concatenate([[0], np.cumsum(list(lengths.values()))]), dtype=torch.int64)
    positions = torch.cat([torch.arange(n) for n in lengths.values()])
    model = Transformer(PRESETS[preset])
    with torch.no_grad():
        logits = model(torch.from_numpy(data.tokens), positions, document_attention(cu))
        return float(packed_cross_entropy(logits, torch.from_numpy(data.targets))) / data.num_targets


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc, argv, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "distca.torch.train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s (hung?)\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")


def _jsonl(path, rng, docs=160):
    """Markov-ish byte text, documents of 20..700 bytes, with a blank line and an empty text among them."""
    words = ["the", "cad", "attention", "server", "rank", "token", "layout", "plan", "loss", "falls", "ok,", "and"]
    with open(path, "w") as f:
        for i in range(docs):
            n = int(rng.integers(20, 700))
            text = " ".join(words[int(j)] for j in rng.integers(0, len(words), n // 4 + 1))[:n]
            f.write(json.dumps({"text": text}) + "\n")
            if i == 5:
                f.write("\n" + json.dumps({"text": ""}) + "\n")


def test_demo_model_cad_equals_colocated_2_ranks(tmp_path):
    """The demo model (2 layers, d 256, 4/1 heads of 64) on the demo's skewed batches, at 1024
    tokens per rank (the demo's 6144 takes about 76 s for 20 compared steps here), under torchrun;
    small DDP buckets, so gradient all-reduces fire while cad_attention's backward runs."""
    _need_gloo()
    out = tmp_path / "t.json"
    steps = DEMO_STEPS
    run = _torchrun(2, ["--preset", "demo", "--compare", "--steps", str(steps), "--context", "1024", "--bucket-mb",
                        "1", "--json", str(out)])
    log = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, log
    doc = json.loads(out.read_text())
    col, cad = _losses(doc, "colocated"), _losses(doc, "cad")
    assert len(col) == len(cad) == steps, log
    assert _max_rel(cad, col) <= TOLERANCE, (col, cad)
    assert doc["summary"]["loss_max_rel_diff"] <= TOLERANCE
    assert cad[-1] < cad[0] - 1.0, cad            # the loss falls (5.6 -> about 2.7 in 10 steps here)
    # Colocated: rank 0's one long document makes its attention the straggler; CAD moved work.
    recs = [r for r in doc["steps"] if r["backend"] == "cad"]
    assert all(r["documents_spanning_ranks"] == 0 for r in recs)
    assert all(r["rows_served_remotely"] > 0 for r in recs)          # CAD moved attention work every step
    assert all(r["rows_served_remotely"] == 0 for r in doc["steps"] if r["backend"] == "colocated")
    assert doc["summary"]["speedup"] > 0 and len(doc["summary"]["speedup_per_step"]) == steps - 1
    assert "speedup of CAD over colocated" in run.stdout and f"step {steps:4d}/{steps} cad" in run.stdout, log
    check_memory(doc)
    # The two backends hold the same model and optimizer; CAD's server state is in what it saves.
    for r in doc["steps"]:
        assert r["per_rank"]["memory_states_bytes"][0] == doc["steps"][0]["per_rank"]["memory_states_bytes"][0]
    assert doc["summary"]["memory_cad_over_colocated"] == pytest.approx(
        doc["summary"]["backends"]["cad"]["memory_max_bytes"] / doc["summary"]["backends"]["colocated"]["memory_max_bytes"])
    assert "memory: colocated fullest rank" in run.stdout, log
    from distca.torch.train.data import SyntheticData
    want = _reference_loss(SyntheticData("skewed", 1, 2, 1024).step(0), "demo")
    assert abs(cad[0] - want) / want <= TOLERANCE and abs(col[0] - want) / want <= TOLERANCE, (want, cad[0], col[0])


def test_jsonl_spanning_ranks_cad_equals_colocated_4_ranks(tmp_path):
    """The paper's planner (distca): at 256 tokens per rank minbytes and minmax, pricing on the
    built-in H200 curve, leave most of these steps' short documents where they are."""
    _need_gloo()
    data = tmp_path / "docs.jsonl"
    _jsonl(data, np.random.default_rng(7))
    out = tmp_path / "t.json"
    results = _train(4, ["--preset", "tiny", "--data", str(data), "--compare", "--steps", "8", "--policy",
                         "distca", "--json", str(out), "--bucket-mb", "0.05"])
    assert [r["code"] for r in results] == [0, 0, 0, 0], results[0]["stdout"]
    doc = json.loads(out.read_text())
    col, cad = _losses(doc, "colocated"), _losses(doc, "cad")
    assert len(cad) == 8 and _max_rel(cad, col) <= TOLERANCE, (col, cad)
    assert cad[-1] < cad[0], cad
    spanning = [r["documents_spanning_ranks"] for r in doc["steps"] if r["backend"] == "cad"]
    assert sum(spanning) >= 8, spanning           # documents continue on the next rank in every step
    moved = [r["rows_served_remotely"] for r in doc["steps"] if r["backend"] == "cad"]
    assert sum(moved) > 0, moved                  # the planner moved work (not colocated under another name)
    assert doc["config"]["ranks"] == 4
    from distca.torch.train.data import JsonlData, read_jsonl
    want = _reference_loss(JsonlData(str(data), read_jsonl(str(data)), 4, 256).step(0), "tiny")
    assert abs(cad[0] - want) / want <= TOLERANCE, (want, cad[0])


def test_resume_repeats_the_curve(tmp_path):
    """Steps 4..6 after resuming from step 3 equal a straight run's, both backends (packed
    synthetic documents spanning ranks)."""
    _need_gloo()
    common = ["--preset", "tiny", "--workload", "packed", "--compare", "--seed", "3", "--warmup", "2"]
    straight, resumed, ck = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ck"
    assert [r["code"] for r in _train(2, common + ["--steps", "6", "--json", str(straight)])] == [0, 0]
    assert [r["code"] for r in _train(2, common + ["--steps", "3", "--checkpoint", str(ck)])] == [0, 0]
    assert (ck / "distca_train.json").is_file() and not (tmp_path / "ck.partial").exists()
    results = _train(2, common + ["--steps", "6", "--resume", str(ck), "--json", str(resumed)])
    assert [r["code"] for r in results] == [0, 0], results[0]["stdout"]
    assert "resumed after step 3" in results[0]["stdout"]
    a, b = json.loads(straight.read_text()), json.loads(resumed.read_text())
    for backend in ("colocated", "cad"):
        want, got = _losses(a, backend)[3:], _losses(b, backend)
        assert len(got) == 3 and got == want, (backend, want, got)      # bit for bit (CPU, deterministic)
    assert [r["step"] for r in b["steps"]] == [4, 4, 5, 5, 6, 6]
    # The same checkpoint under other data, or already at the last step: refused on every rank.
    bad, done = _refusals(2, [[common[:-4] + ["--seed", "4", "--warmup", "2", "--steps", "6", "--resume", str(ck)]] * 2,
                              [common + ["--steps", "3", "--resume", str(ck)]] * 2])
    assert [r["code"] for r in bad] == [2, 2]
    assert 'field "seed" is 3, this run has 4' in bad[0]["stdout"], bad[0]["stdout"]
    assert [r["code"] for r in done] == [2, 2] and "give --steps above 3" in done[0]["stdout"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be 1..100000000, got 0"),
    (["--compare", "--attention", "cad"], "--attention is ignored with --compare"),
    (["--attention", "colocated", "--policy", "minmax"], "--policy would be ignored with --attention colocated"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--tolerance", "7"], "tolerance"),
    (["--json", "/no/such/folder/t.json"], "--json /no/such/folder/t.json: the folder /no/such/folder does not exist"),
    (["--data", "x.jsonl", "--seed", "2"], "--workload and --seed would be ignored with --data"),
    (["--skip", "5", "--steps", "5"], "--skip 5 leaves no step of 5 to time"),
    (["--kernel", "varlen"], "--kernel varlen: backend 'varlen' cannot run on cpu"),
])
def test_bad_flags_one_line_exit_2(argv, message, capsys):
    from distca.torch.train.trainer import main
    assert main(argv) == 2
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distca.torch.train: error: ") and message in lines[0], out


def test_outputs_never_overwrite_inputs(tmp_path, capsys):
    """--json or --checkpoint naming the --data file (also through a symlink) or the --resume folder."""
    from distca.torch.train.trainer import main
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "fine"}\n')
    (tmp_path / "link.jsonl").symlink_to(data)
    for argv, message in ((["--data", str(data), "--json", str(tmp_path / "link.jsonl")], "is the --data input"),
                          (["--data", str(data), "--checkpoint", str(data)], "a file is there")):
        assert main(["--preset", "tiny", *argv]) == 2
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and message in out[0], out
    assert data.read_text() == '{"text": "fine"}\n'


def test_bad_data_line_exit_2_every_rank(tmp_path):
    """Under torchrun: each rank prints nothing but rank 0's one line and exits 2; nothing hangs."""
    _need_gloo()
    data, not_json = tmp_path / "bad.jsonl", tmp_path / "not_json.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": 5}\n{"text": "fine"}\n')
    not_json.write_text('{"text": "fine"}\nnot json\n')
    run = _torchrun(2, ["--preset", "tiny", "--data", str(data), "--steps", "2"], timeout=60)
    log = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode != 0, log
    assert run.stdout.strip().splitlines() == [f'distca.torch.train: error: {data}:3: "text" must be a string'], log
    assert "exitcode  : 2" in run.stderr, log         # torchrun's report names the ranks' status
    # In-process ranks: every rank returns 2 (not only the one that printed).
    bad, unreadable = _refusals(2, [[["--preset", "tiny", "--data", str(path), "--steps", "2"]] * 2
                                    for path in (data, not_json)])
    assert [r["code"] for r in bad] == [2, 2]
    assert f"{data}:3:" in bad[0]["stdout"] and bad[1]["stdout"] == ""
    assert [r["code"] for r in unreadable] == [2, 2] and f"{not_json}:2: not JSON" in unreadable[0]["stdout"]


def test_ranks_started_with_different_settings_end_at_once_naming_the_flag(tmp_path):
    """Every rank exits 2 before any work, rank 0 names the first flag that differs, nothing is written."""
    _need_gloo()
    report = tmp_path / "report.json"
    base = ["--preset", "tiny", "--json", str(report)]
    cases = ((["--steps", "3"], "--steps is 2 on rank 0 and 3 on rank 1"),
             (["--steps", "2", "--policy", "minmax"], "--policy is unset on rank 0 and minmax on rank 1"))
    runs = _refusals(2, [[base + ["--steps", "2"], base + rank1] for rank1, _ in cases])
    for (_, expected), out in zip(cases, runs):
        assert [r["code"] for r in out] == [2, 2], out
        assert "the ranks were started with different settings" in out[0]["stdout"], out
        assert expected in out[0]["stdout"], out
        assert all(r["seconds"] < 60 for r in out), out
    assert not report.exists()


def test_json_never_replaces_a_device_or_fifo(tmp_path):
    """--json replaces only a regular file: a FIFO (and a device) is refused before any work."""
    from distca.torch.train.trainer import main
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (str(fifo), "/dev/null"):
        before = os.stat(target)
        assert main(["--preset", "tiny", "--steps", "1", "--json", target]) == 2
        after = os.stat(target)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode), target


def test_help_lists_every_flag(capsys):
    from distca.torch.train.trainer import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--preset", "--attention", "--compare", "--steps", "--device", "--policy", "--json", "--checkpoint",
                 "--resume", "--data", "--workload", "--tie-embeddings", "--context"):
        assert flag in out, flag


def test_packed_targets_and_pieces():
    """The data path alone: documents spanning ranks become pieces of one key; a document's last
    token has no target, and one cut at a step's end still predicts the next token."""
    from distca.torch.train.data import JsonlData, pack_documents
    docs = [np.frombuffer(b"abcdefg", np.uint8), np.frombuffer(b"xyz", np.uint8)]
    data = JsonlData("mem", docs, num_ranks=2, context=3)          # 10 tokens, 6 per step
    s0, s1 = data.step(0), data.step(1)
    assert bytes(s0.tokens.astype(np.uint8)) == b"abcdef"
    assert list(s0.targets) == [ord(c) for c in "bcdefg"]        # f's target g is in the next step
    assert s0.pieces == [[(0, 0, 3, 6)], [(0, 3, 6, 6)]] and s0.spanning_documents() == 1
    assert bytes(s1.tokens.astype(np.uint8)) == b"gxyzab"        # g continues as a new document; wraps
    assert list(s1.targets) == [-1, ord("y"), ord("z"), -1, ord("b"), ord("c")]
    assert s1.pieces == [[(0, 0, 1, 1), (1, 0, 2, 3)], [(1, 2, 3, 3), (2, 0, 2, 2)]]
    assert s1.epoch_started == 1 and s0.epoch_started is None
    one = pack_documents([(np.arange(4), np.array([1, 2, 3, -1]))], 1, 4)
    assert one.num_targets == 3 and one.rank_slice(0, 4)[3].tolist() == [0, 4]
