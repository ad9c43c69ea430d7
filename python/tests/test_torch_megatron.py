"""distca.torch.adapters.megatron_core on CPU (gloo), with megatron-core from PyPI: a tiny Megatron
GPTModel trained a few SGD steps with CAD core attention equals the same model with Megatron's own
DotProductAttention; 2 ranks with skewed documents (CAD splits rank 0's long document between the
ranks) equal 1 rank; the layer alone against distca's reference and Megatron's layer; plans once
per step; bad settings raise. The workers live in megatron_cases.py (see its docstring for the
two CPU shims Megatron Core needs, and for the GPU check)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")   # scripts/install-python.sh installs it (and NumPy >= 1.25 it needs)

import megatron_cases as mc  # noqa: E402
from distca.torch import run_ranks  # noqa: E402

# The module's fixture starts ranks once; its tests share one pytest-xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("torch_megatron")

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    w1 = run_ranks(mc.world1_worker, 1, str(out), timeout=300)
    w2 = run_ranks(mc.gpt_worker, 2, str(out), timeout=300)
    for r in w1 + w2:
        assert r["error"] is None, r["error"]
    return {"w1": w1[0]["result"], "w2": [r["result"] for r in w2], "dir": out}


def _loss_rel(a, b):
    assert len(a["losses"]) == len(b["losses"]) == mc.STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))


def _params_rel(out, a, b):
    pa, pb = torch.load(out / f"{a}.pt"), torch.load(out / f"{b}.pt")
    assert pa.keys() == pb.keys() and len(pa) > 10
    return max(mc.rel(pa[k], pb[k]) for k in pa)


def test_import_needs_no_megatron():
    code = ("import sys, distca.torch, distca.torch.adapters.megatron_core as m; "
            "assert not any(k == 'megatron' or k.startswith('megatron.') for k in sys.modules), 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_gpt_thd_cad_equals_megatron_attention(runs):
    """CAD on each rank's documents packed THD == Megatron's DotProductAttention one document per
    forward (its local attention takes no THD), same init, same data, 3 SGD steps."""
    gpt = runs["w1"]["gpt"]
    assert _loss_rel(gpt["cad_thd"], gpt["ref_per_doc"]) < TOL
    assert _params_rel(runs["dir"], "cad_thd_w1", "ref_per_doc") < TOL
    assert gpt["ref_per_doc"]["param_change"] > 1e-2      # the steps moved the weights


def test_gpt_sbhd_cad_equals_megatron_attention(runs):
    """sbhd [S, B] with a causal mask: CAD (each sequence a document) == DotProductAttention."""
    gpt = runs["w1"]["gpt"]
    assert _loss_rel(gpt["cad_sbhd"], gpt["ref_sbhd"]) < TOL
    assert _params_rel(runs["dir"], "cad_sbhd_w1", "ref_sbhd") < TOL
    assert gpt["ref_sbhd"]["param_change"] > 1e-2
    assert gpt["cad_sbhd"]["num_plans"] == 1             # one shape: planned once, reused every step


def test_two_ranks_equal_one_rank(runs):
    """2 gloo ranks, skewed documents: CAD moves part of rank 0's long document to rank 1, and the
    losses and trained weights equal the 1-rank run and Megatron's attention."""
    w2 = [r["cad_thd"] for r in runs["w2"]]
    gpt = runs["w1"]["gpt"]
    assert w2[0]["losses"] == w2[1]["losses"]
    assert _loss_rel(w2[0], gpt["cad_thd"]) < TOL
    assert _loss_rel(w2[0], gpt["ref_per_doc"]) < TOL
    assert _params_rel(runs["dir"], "cad_thd_w2", "cad_thd_w1") < TOL
    assert _params_rel(runs["dir"], "cad_thd_w2", "ref_per_doc") < TOL
    last = w2[0]["last_step"]
    assert last["plan_hash"] == w2[1]["last_step"]["plan_hash"]
    assert last["q_rows_sent_away"] > 0                   # rank 0's rows served by rank 1
    assert any(t[0] == 0 and t[5] == 1 for t in last["tasks"])   # document 0 (rank 0's) on server 1
    pairs = last["server_pairs"]
    assert max(pairs) / min(pairs) < 1.05                 # balanced (without CAD: 33424 vs 5152 pairs)


def test_plans_once_per_step(runs):
    for r in [runs["w1"]["gpt"]["cad_thd"]] + [x["cad_thd"] for x in runs["w2"]]:
        assert r["num_layers"] == mc.NUM_LAYERS
        assert r["layer_calls"] == [mc.STEPS] * mc.NUM_LAYERS
        assert r["num_plans"] == mc.STEPS                # one per step, not one per layer
    layer = runs["w1"]["layer"]
    assert layer["thd_num_plans"] == 1                   # two calls with the same cu_seqlens
    assert layer["explicit_num_plans"] == 1


def test_layer_against_reference_and_megatron(runs):
    """CADCoreAttention alone: output and dQ, dK, dV against distca's per-document attention and
    against Megatron's DotProductAttention on the same tensors (per document / [S, B])."""
    layer = runs["w1"]["layer"]
    assert layer["thd_out_shape"] == [239, 64]           # [T, Hq * D], as TEDotProductAttention
    assert layer["sbhd_out_shape"] == [48, 3, 64]        # [S, B, Hq * D], as DotProductAttention
    assert max(layer["thd_vs_reference"]) < 1e-6
    assert max(layer["thd_vs_megatron"]) < TOL
    assert max(layer["sbhd_vs_megatron"]) < TOL
    assert max(layer["explicit_vs_reference"]) < 1e-6
    assert "call cad.plan" in layer["explicit_error"]


def test_specs_and_tensor_parallel_shapes(runs):
    layer = runs["w1"]["layer"]
    assert layer["use_cad_copies"] and layer["cad_layer_spec"]
    assert layer["tp2_shape"] == [2, 1, 16, 2, 1]          # 4 heads / 2 query groups over TP 2
    assert "the CADContext was made for 4, 2, 16" in layer["tp2_mismatch"]


@pytest.mark.parametrize("case, words", [
    ("no_context", "cad=CADContext"),
    ("dropout_config", "attention dropout 0.1"),
    ("dropout_arg", "attention dropout 0.2"),
    ("context_parallel", "context_parallel_size 2"),
    ("context_parallel_ctx", "context_parallel_size must be 1"),
    ("no_mask", "no_mask"),
    ("padding_mask", "AttnMaskType.padding "),
    ("cross_attention", "attention_type 'cross'"),
    ("window", "window_size"),
    ("shape_mismatch", "4 key/value heads"),
    ("thd_no_cu", "cu_seqlens_q"),
    ("thd_kv_differs", "cu_seqlens_kv differs"),
    ("thd_rows", "does not end at q's 236 rows"),
    ("bias", "attention_bias"),
    ("bshd", "'bshd'"),
    ("forward_mask_type", "no_mask"),
    ("sbhd_padding_causal", "padding_causal"),
    ("use_cad_no_slot", "no core_attention"),
])
def test_bad_settings_raise(runs, case, words):
    message = runs["w1"]["layer"]["errors"][case]
    assert message.startswith(("ValueError", "InputError")), message
    assert words in message, message


def test_tensor_parallel_2_x_data_parallel_2_equals_megatron_attention():
    """Megatron's tensor-parallel layers on 4 gloo ranks (TP 2 x DP 2): CAD over each TP index's
    data-parallel group trains what Megatron's own attention does, each rank holding 2 of the 4
    query heads and 1 of the 2 key/value heads."""
    results = run_ranks(mc.tp_worker, 4, timeout=300)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
    out = [r["result"] for r in results]
    for r in out:
        assert mc.rel(torch.tensor(r["cad"]), torch.tensor(r["ref"])) < 1e-5, r
        assert r["param_rel"] < 1e-5 and r["num_plans"] == 3 and r["shape"] == [2, 1, 16]
    assert sorted(r["tp_rank"] for r in out) == [0, 0, 1, 1]
    assert sum(r["moved"] for r in out) > 0     # CAD moved attention rows between the replicas


def test_lockstep_pipeline_2_x_data_parallel_2_equals_one_process():
    """Megatron's GPT in 2 pipeline stages x 2 replicas on 4 gloo ranks under LockstepForwardBackward
    (Megatron's forward_backward_func signature): 3 SGD steps over 4 micro-batches a replica, one
    holding a single long document, equal the whole model on one process with Megatron's own
    attention; the idle stages of every warm-up and cool-down tick serve what the tick's plan
    gives them; a rank with another micro-batch count fails with one error on every rank."""
    import megatron_pipeline_cases as mp
    out = Path(tempfile.mkdtemp())
    ref = run_ranks(mp.reference_worker, 1, str(out), timeout=300)
    assert ref[0]["error"] is None, ref[0]["error"]
    results = run_ranks(mp.pipeline_worker, 4, str(out), timeout=300)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
    res = [r["result"] for r in results]
    want = ref[0]["result"]["losses"]
    last = [r for r in res if r["stage"] == 1]
    assert len(last) == 2
    for r in last:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], want)) < TOL, (r["losses"], want)
        assert abs(r["forward_only"] - want[0]) / want[0] < TOL      # forward_only: the first step's loss
    reference = torch.load(out / "pipeline_reference.pt")
    for stage in (0, 1):
        mine = torch.load(out / f"pipeline_stage{stage}_tp0.pt")
        assert len(mine) > 10 and mine.keys() <= reference.keys()
        assert max(mc.rel(mine[k], reference[k]) for k in mine) < TOL
    ticks = 2 * mp.MICRO + 2 * (2 - 1)
    for r in res:
        for step in r["records"]:
            assert len(step) == ticks
            idle = [t for t in step if t["micro_batch"] is None]
            assert len(idle) == 2                    # one warm-up or cool-down tick on each stage
            for t in idle:
                assert t["local_rows"] == 0 and t["served_rows"] > 0 and t["served_rows"] == t["planned_rows"]
        assert r["num_plans"] == (mp.MICRO + 1) + ticks * mp.STEPS     # one plan a tick (forward_only: 5 ticks)
        assert r["mismatch"].startswith("InputError: LockstepForwardBackward: the ranks differ in num_microbatches")
    assert len({r["mismatch"] for r in res}) == 1
