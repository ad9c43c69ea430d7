"""distca.torch.adapters.torchtitan on CPU (gloo): a tiny TorchTitan Llama3 (2 layers, dim 64,
4 / 2 heads) trained 3 AdamW steps with CAD in its attention slot equals the same model with
TorchTitan's own attention, in one process and on 2 ranks with skewed documents (CAD moving
attention rows between them); one plan per step, reused by every layer; bad configurations raise
ValueError. What runs here and what needs a GPU: see torchtitan_cases.py's docstring."""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan.models.llama3")

from distca.torch.spawn import run_ranks  # noqa: E402
import torchtitan_cases as tc  # noqa: E402
from torchtitan_cases import STEPS, one_process_worker, two_rank_worker  # noqa: E402

# The module's fixture starts ranks once; its tests share one pytest-xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("torch_torchtitan")

TOLERANCE = 1e-5


def _rel(got, want):
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def _result(runs):
    for r in runs:
        assert r["error"] is None, r["error"]
    return [r["result"] for r in runs]


@pytest.fixture(scope="module")
def one_process():
    return _result(run_ranks(one_process_worker, 1, timeout=300))[0]


def test_import_is_lazy_and_finds_the_real_torchtitan():
    """The adapter shares its module name with the framework: its import of torchtitan is absolute
    (the real package), and happens only when used."""
    code = ("import sys, distca.torch, distca.torch.adapters.torchtitan\n"
            "assert 'torchtitan' not in sys.modules, 'imported torchtitan eagerly'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    import distca.torch.adapters.torchtitan as adapter
    real, attention, decoder = adapter._torchtitan()
    assert real.__name__ == "torchtitan" and real.__file__ != adapter.__file__
    assert real.__file__.endswith("torchtitan/__init__.py") and "distca" not in real.__file__
    assert hasattr(attention, "FlexAttention") and hasattr(decoder, "Decoder")


def test_sdpa_rows_trained_equal_torchtitan_sdpa(one_process):
    """One document per batch row: TorchTitan's ScaledDotProductAttention (causal, differentiable on
    CPU) vs CAD, 3 steps, the same losses and parameters."""
    r = one_process["sdpa"]
    assert len(r["got"]) == STEPS
    assert _rel(r["got"], r["want"]) <= TOLERANCE, r
    assert r["params"] <= TOLERANCE, r
    assert r["plans"] == STEPS and r["calls"] == [STEPS, STEPS]   # one plan per step, every layer reuses it


def test_packed_documents_forward_equals_torchtitan_flex(one_process):
    """TorchTitan's FlexAttention with its block-causal document mask (compiled flex_attention, forward:
    it has no CPU backward) vs CAD and vs the dense reference the training tests use."""
    r = one_process["flex_forward"]
    assert r["docs"] > 2
    assert r["cad_vs_flex"] <= TOLERANCE, r
    assert r["dense_vs_flex"] <= TOLERANCE, r
    assert r["no_document_mask_vs_flex"] > 1e-3, r       # the document mask matters on this batch


def test_packed_documents_trained_equal_torchtitan_mask(one_process):
    r = one_process["packed"]
    assert _rel(r["got"], r["want"]) <= TOLERANCE, r
    assert r["params"] <= TOLERANCE, r
    assert r["plans"] == STEPS and r["docs"] > 2 and all(r["same_positions"]), r


def test_two_ranks_equal_one_process(one_process):
    """2 gloo ranks, data parallel by hand (gradients summed): rank 0 one long document, rank 1 many
    short ones; CAD serves part of rank 0's attention on rank 1 every step. Losses and parameters
    equal the single-process run of the global batch (TorchTitan's mask, and CAD on 1 process)."""
    ranks = _result(run_ranks(two_rank_worker, 2, timeout=300))
    for rank, r in enumerate(ranks):
        assert _rel(r["got"], r["want"]) <= TOLERANCE, (rank, r)
        assert _rel(r["got"], one_process["packed"]["got"]) <= TOLERANCE, (rank, r)
        assert r["params"] <= TOLERANCE, (rank, r)
        assert r["plans"] == STEPS and r["plans_before"] == list(range(STEPS)), r   # planned once per step
        assert r["calls"] == [STEPS, STEPS], r                                       # ... reused by both layers
        assert all(r["same_positions"]), r            # TorchTitan's RoPE positions are CAD's document positions
    assert all(n > 0 for n in ranks[0]["moved"]), ranks[0]["moved"]              # the long document's rows moved
    assert ranks[0]["got"] == ranks[1]["got"]


def test_bad_configurations_raise(one_process):
    e = one_process["errors"]
    expect = {
        "not_a_decoder": "supports TorchTitan decoders",
        "planner_shape": "is not the model's",
        "planner_and_kwargs": "not both",
        "applied_twice": "already applied",
        "own_block_mask": "got BlockMask",
        "no_masks": "got None",
        "shape_mismatch": "planned for [2, 384]",
        "positions_1d": "must be [B, L]",
        "positions_float": "must hold integers",
        "out_transform": "out_transform",
        "non_causal": "only causal",
        "mla_value_dim": "one head_dim",
        "sliding_window_model": "makes its own attention masks",
    }
    for key, words in expect.items():
        assert e[key] is not None and e[key].startswith("ValueError") and words in e[key], (key, e[key])
    assert e["removed_is_flex"] == "FlexAttention" and e["removed_masks"] == "BlockMask"


def test_pipeline_stages_under_the_lockstep_schedule_equal_one_process():
    """TorchTitan's model split into 2 stages as pipeline_llm does, CAD in each, run by
    ScheduleCADLockstep on 2 gloo ranks: the losses and each stage's weights after 3 AdamW steps
    equal the whole model on one process; the idle stage serves rows."""
    results = run_ranks(tc.pipeline_worker, 2, timeout=300)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
    for r in (x["result"] for x in results):
        assert tc.max_rel(r["got"], r["want"]) <= TOLERANCE, r
        assert r["params"] <= TOLERANCE, r
        assert r["served_idle_rows"] > 0


def test_tensor_parallel_2_x_data_parallel_2_equals_one_process():
    """tensor_parallel (DTensor on a CPU mesh, TorchTitan's dense TP plan) x 2 replicas on 4 gloo
    ranks, CAD over each TP index's replicas: 3 AdamW steps equal the whole model on one process;
    each rank's attention holds 2 of the 4 heads and 1 of the 2 key/value heads; a TP rank that
    plans other documents than its peer fails with one error on every rank."""
    out = _result(run_ranks(tc.tp_worker, 4, timeout=300))
    for r in out:
        assert _rel(r["got"], r["want"]) < TOLERANCE, (r["got"], r["want"])
        assert r["params"] < TOLERANCE, r["params"]
        assert r["shape"] == [tc.HEADS // 2, tc.KV_HEADS // 2, tc.HEAD_DIM]
        assert r["plans"] == STEPS and r["calls"] == [STEPS] * tc.LAYERS
        assert len(r["sharded"]) == 5 * tc.LAYERS      # wqkv, wo, w1, w2, w3 of each layer
        assert r["tp_mismatch"].startswith("InputError") and "TP ranks of a replica made different plans" in \
            r["tp_mismatch"], r["tp_mismatch"]
    assert sum(r["moved"] for r in out) > 0            # CAD moved attention rows between the replicas
