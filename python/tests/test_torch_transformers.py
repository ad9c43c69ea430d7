"""distca.torch.adapters.transformers on CPU (gloo): Hugging Face Llama and Qwen3 (GQA) built from a
config, trained 3 AdamW steps under DDP with CAD attention on 2 ranks (one long document on rank 0,
short ones on rank 1; and documents of every length 1..18), equal HF's sdpa run document by
document, in both packed forms (cu_seq_lens_q/k, and position_ids alone), with and without gradient
checkpointing, one plan per forward; FSDP2; evaluation and generate() without CAD; the refusals, the
same line on every rank; save_pretrained; the Trainer example under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from distca.torch.spawn import run_ranks  # noqa: E402
import transformers_cases as cases  # noqa: E402


TOLERANCE = 1e-5
ROOT = Path(__file__).resolve().parents[2]
# Every pair of (form, gradient checkpointing, batch) on Llama, and both forms, both checkpointing
# settings and both batches on Qwen3: 6 runs of 3 steps rather than the 16 of the whole product
# (each costs the same; the whole product, 16 runs, measured 1.4e-6 at worst: reports/cpu/2026-12-02-hf-transformers).
TRAIN_CASES = [("llama", "cu", False, "skewed"), ("llama", "cu", True, "every_length"),
               ("llama", "positions", False, "every_length"), ("llama", "positions", True, "skewed"),
               ("qwen3", "cu", True, "skewed"), ("qwen3", "positions", False, "every_length")]


def _results(runs):
    for r in runs:
        assert r["error"] is None, r["error"]
    return [r["result"] for r in runs]


@pytest.fixture(scope="module")
def trained():
    return _results(run_ranks(cases.train_worker, 2, TRAIN_CASES, timeout=600, group_timeout=120))


def test_import_is_lazy_and_finds_the_real_transformers():
    code = ("import sys, distca.torch, distca.torch.adapters.transformers\n"
            "assert 'transformers' not in sys.modules, 'imported transformers eagerly'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    import distca.torch.adapters.transformers as adapter
    real = adapter._transformers()[0]
    assert real.__name__ == "transformers" and "distca" not in real.__file__


# The fixture starts the ranks once: its tests share one pytest-xdist worker (--dist loadgroup); the
# module's other tests start processes of their own and go to any worker.
@pytest.mark.xdist_group("torch_transformers")
@pytest.mark.parametrize("index", range(len(TRAIN_CASES)), ids=["-".join(map(str, c)) for c in TRAIN_CASES])
def test_trained_equals_hf_sdpa_document_by_document(trained, index):
    """The loss of every step on both ranks, every parameter's gradient after DDP's average, and the
    parameters after 3 AdamW steps: max|a - b| / max|b| per tensor <= 1e-5."""
    for rank, results in enumerate(trained):
        r = results[index]
        assert r["case"] == list(TRAIN_CASES[index])
        assert r["loss"] <= TOLERANCE and r["grad"] <= TOLERANCE and r["param"] <= TOLERANCE, (rank, r)
        assert r["plans"] == cases.STEPS and r["forwards"] == cases.STEPS, r     # exactly one plan per forward
        assert r["calls"] == r["layers"], r                                      # every layer used it
    # the plans moved attention rows between the ranks (CAD balanced, not each rank alone)
    assert sum(results[index]["moved"] for results in trained) > 0


def test_fsdp2_runs_and_matches():
    results = _results(run_ranks(cases.fsdp2_worker, 2, timeout=300, group_timeout=120))
    for r in results:
        assert r["loss"] <= TOLERANCE and r["grad"] <= TOLERANCE and r["param"] <= TOLERANCE, r
        assert r["plans"] == r["forwards"] == 2, r


def test_bad_input_gives_one_line_on_every_rank():
    """Bad input on one rank (or on both), or ranks that ran different numbers of forwards: every rank
    raises, nothing hangs (the ranks' collectives time out after 120 s; the test after 300 s)."""
    got = _results(run_ranks(cases.refusals_worker, 2, timeout=300, group_timeout=120))
    words = {"padding": "attention mask has zeros", "dropout": "attention dropout 0.1",
             "window": "longer than the model's sliding window (32)", "rows": "disagree with cu_seq_lens_q",
             "cu_vs_positions": "position_ids restart at packed row 15", "counts": "finished planning"}
    for what, word in words.items():
        for rank in (0, 1):
            text = got[rank][what]
            assert text.startswith("InputError: ") and word in text and "\n" not in text, (what, rank, text)
        if what != "counts":
            assert got[0][what] == got[1][what], what
    assert "rank 1 after 1 plan" in got[0]["counts"] and "rank 0 in StepPlanner.plan of plan 2" in got[1]["counts"]
    for ok in ("window_ok", "eval_one_rank"):   # within the window; an evaluation on one rank makes no collective
        assert got[0][ok] == got[1][ok] == "no error", ok


def test_outside_training_refusals_and_save_pretrained(tmp_path):
    r = _results(run_ranks(cases.one_process_worker, 1, str(tmp_path / "model"), timeout=300))[0]
    assert r["eval_vs_documents"] <= TOLERANCE, r
    assert r["hf_sdpa_with_cache_vs_documents"] > 0.1, r      # HF's own packed evaluation with a cache is not
    assert r["generate_equal"], r
    assert r["counts"] == [0, 5, 0], r                        # 1 evaluation + 4 generate() forwards, no plan
    e = r["errors"]
    assert e["applied_twice"].startswith("ValueError") and e["not_a_model"].startswith("TypeError")
    assert "PlainLlamaForCausalLM" in e["no_interface"]
    assert "attn_logit_softcapping" in e["softcapping"] and "mixes sliding-window" in e["mixed_sliding_layers"]
    assert "model.layers.1.self_attn" in e["non_causal"] and "'fastest'" in e["bad_planner_option"]
    saved = (tmp_path / "model" / "config.json").read_text()
    assert "distca" not in saved
    code = ("import sys, transformers\nm = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "assert 'distca' not in sys.modules\nprint(m.config._attn_implementation)")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr


def _torchrun(args, tmp_path, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(29600 + os.getpid() % 300))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           env["MASTER_PORT"], str(ROOT / "examples" / "hf_trainer_cad.py")] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def test_trainer_example_matches_hf_sdpa(tmp_path):
    """The Trainer example, 2 processes under torchrun at a small size: it ends with status 0 and
    CAD's final loss is within 1e-5 of the same Trainer run with sdpa and use_cache=False."""
    out = tmp_path / "run.json"
    run = _torchrun(["--steps", "3", "--tokens-per-rank", "384", "--hidden", "64", "--gradient-checkpointing",
                     "--json", str(out)], tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["format"] == "distca-hf-trainer" and report["ranks"] == 2
    assert report["final_loss_relative_difference"] <= TOLERANCE, report
    cad, sdpa = report["runs"]["cad"], report["runs"]["sdpa"]
    assert cad["plans"] == cad["forwards"] == 3 and len(cad["losses"]) == len(sdpa["losses"]) == 3
    assert all(abs(c - s) <= TOLERANCE * abs(s) for c, s in zip(cad["losses"], sdpa["losses"]))
    assert " cad step 3/3  loss " in run.stdout and "CAD plan: attention imbalance" in run.stdout
    assert "final loss: cad " in run.stdout


def test_trainer_example_refuses_bad_arguments(tmp_path):
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer_cad.py"), "--steps", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--steps must be positive" in bad.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer_cad.py"), "--lengths",
                              str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no document-length sample" in missing.stderr and "Traceback" not in missing.stderr


def _torchrun_script(script, args, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(29300 + os.getpid() % 300)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           str(Path(__file__).parent / script)] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_script_ending_without_finish_exits_zero():
    """A finished torchrun job exits 0: the atexit handler agrees on the counts and lets the groups go."""
    run = _torchrun_script("transformers_exit_case.py", ["2", "2"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 0: done" in run.stdout and "rank 1: done" in run.stdout


def test_a_rank_with_fewer_forwards_fails_every_rank_not_a_hang():
    run = _torchrun_script("transformers_exit_case.py", ["3", "2"])
    assert run.returncode != 0
    # each rank's line (the two ranks write to one stream, so only the lines' text is compared)
    assert "rank 0: distca CAD forward 3: finished planning (rank 1 after 2 plans)" in run.stderr, run.stderr[-3000:]
    assert "rank 1: distca CAD finish after 2 forwards: finished planning" in run.stderr, run.stderr[-3000:]
