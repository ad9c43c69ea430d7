"""Shared by test_torch_torchtitan.py and the ranks it spawns: a tiny TorchTitan Llama3 (2 layers,
dim 64, 4 / 2 heads of 16, fp32), skewed packed batches, and the training runs compared.

TorchTitan's own language-model attention is FlexAttention or VarlenAttention. On CPU,
flex_attention runs forward only ("FlexAttention does not support backward on CPU") and varlen_attn
needs CUDA, so the training references here are (a) TorchTitan's ScaledDotProductAttention module
(one document per batch row, plain causal) and (b) TorchTitan's own block-causal BlockMask (its
mask_mod from model.get_attention_masks, evaluated at every (query, key) pair) applied by SDPA,
which is checked against TorchTitan's compiled FlexAttention forward.
"""
from __future__ import annotations

import copy
import dataclasses
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 4, 2, 2, 256
HEAD_DIM = DIM // HEADS
SEQ = 384                     # tokens per batch row (one row per rank in the 2-rank run)
STEPS = 3
LR = 3e-3
# What the planner prices: attention heavy enough, next to a task's fixed cost, that minbytes moves
# part of the long document's attention to the other rank (torch_cases.COST_MODEL).
COST_MODEL = {"layers": 1, "hidden": 4096, "heads": 512, "kv_heads": 64, "head_dim": 512, "ffn_hidden": 4096}


def build_model(attn: str = "flex", seed: int = 0):
    """A tiny TorchTitan Llama3Model built from its own configs, init_states under a fixed seed."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    lin = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm = {"weight": nn.init.ones_}
    inner = ScaledDotProductAttention.Config() if attn == "sdpa" else get_attention_config(attn)
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        attention=make_gqa_config(
            dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, wqkv_param_init=lin, wo_param_init=lin,
            inner_attention=dataclasses.replace(inner), fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=2048, theta=500000, scaling="llama")),
        feed_forward=make_ffn_config(dim=DIM, hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
                                     w1_param_init=lin, w2w3_param_init=lin))
        for _ in range(LAYERS)]
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=lin),
        layers=layers)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model.float()


class DenseBlockMaskAttention(nn.Module):
    """TorchTitan's own BlockMask applied by SDPA: the mask_mod TorchTitan's get_attention_masks
    built (causal AND packed-document), evaluated densely; differentiable on CPU."""

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        b, s = q.shape[:2]
        ar = torch.arange(s)
        mask = attention_masks.mask_mod(torch.arange(b).view(b, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                                        ar.view(1, 1, s, 1), ar.view(1, 1, 1, s))
        mask = mask.expand(b, 1, s, s)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


class DocumentMask:
    """What DenseBlockMaskAttention reads of a BlockMask: its mask_mod."""

    def __init__(self, mask_mod):
        self.mask_mod = mask_mod


def document_mask(positions) -> DocumentMask:
    """TorchTitan's block-causal mask_mod for these positions, composed as its
    Decoder._create_flex_attention_mask_for_document does, without compiling create_block_mask
    (seconds per batch shape on CPU)."""
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.common.attention import (get_causal_mask_mod,
                                                    get_efficient_causal_mask_mod_for_packed_document)
    return DocumentMask(and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions)))


def use_dense_reference(model) -> None:
    """TorchTitan's block-causal mask, applied densely by SDPA, in every layer of `model`."""
    for layer in model.layers.values():
        layer.attention.inner_attention = DenseBlockMaskAttention()
    model.get_attention_masks = document_mask


def skewed_rows(step: int, num_rows: int = 2, seq: int = SEQ):
    """`num_rows` rows of `seq` tokens: row 0 one long document (two on odd steps), the others many
    short ones; [(tokens [1, seq], labels [1, seq], positions [1, seq])], the same on every rank."""
    rng = np.random.default_rng(1000 + step)
    rows = []
    for r in range(num_rows):
        if r == 0:
            lengths = [seq] if step % 2 == 0 else [seq - 40 - 8 * step, 40 + 8 * step]
        else:
            lengths, left = [], seq
            while left:
                n = int(min(left, rng.integers(8, 64)))
                lengths.append(n)
                left -= n
        positions = torch.cat([torch.arange(n) for n in lengths]).view(1, seq)
        tokens = torch.from_numpy(rng.integers(0, VOCAB, (1, seq + 1))).long()
        rows.append((tokens[:, :-1], tokens[:, 1:].clone(), positions))
    return rows


def stack(rows, device="cpu"):
    """Rows -> one batch (tokens [B, seq], labels, positions) on `device`."""
    return tuple(torch.cat([r[i] for r in rows]).to(device) for i in range(3))


def global_batch(step: int, num_rows: int = 2, device="cpu"):
    return stack(skewed_rows(step, num_rows), device)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())])


def max_rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def train(model, batches, masks_fn, *, total_tokens=None, group=None):
    """AdamW steps over batches (tokens, labels, positions); loss = summed CE / total_tokens,
    gradients summed over `group` (data parallel by hand) when given. Returns the global losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    losses = []
    for tokens, labels, positions in batches:
        masks = masks_fn(model, tokens, positions)
        logits = model(tokens, positions=positions, attention_masks=masks)
        denom = total_tokens or labels.numel()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / denom
        loss.backward()
        total = loss.detach().clone()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(total, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
    return losses


def own_masks(model, tokens, positions):
    return None if positions is None else model.get_attention_masks(positions)


def rows_served_remotely(masks) -> int:
    """Query rows this rank sent to another rank's attention server in the step's plan."""
    layout = masks.layout
    return sum(sum(s for j, s in enumerate(p.q_send_splits) if j != layout.rank) for p in layout.parts)


# ---------------------------------------------------------------------------------------------
# Spawned workers (run_ranks)


def one_process_worker(rank, world):
    """world 1: CAD vs TorchTitan's own attention, single process."""
    from distca.torch.adapters.torchtitan import apply_cad

    out = {}
    # (1) TorchTitan's ScaledDotProductAttention (one document per row, no positions: RoPE at the
    # sequence index, plain causal), trained 3 steps, against the same model with CAD.
    ref = build_model("sdpa")
    cad_model = copy.deepcopy(ref)
    cad = apply_cad(cad_model, policy="none")
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (2, 193), generator=gen)
        batches.append((t[:, :-1], t[:, 1:].clone(), None))
    want = train(ref, batches, own_masks)
    got = train(cad_model, batches, lambda m, t, p: cad.plan(shape=tuple(t.shape)))
    out["sdpa"] = {"want": want, "got": got, "params": max_rel(flat_params(cad_model), flat_params(ref)),
                   "plans": cad.num_plans, "calls": [a.calls for a in cad.inner_attentions]}

    # (2) TorchTitan's FlexAttention with its block-causal document mask (compiled flex, forward
    # only: no CPU backward) against the dense evaluation of the same mask and against CAD.
    flex = build_model("flex")
    tokens, labels, positions = global_batch(0)
    with torch.no_grad():
        flex_logits = flex(tokens, positions=positions, attention_masks=flex.get_attention_masks(positions))
        dense = copy.deepcopy(flex)
        use_dense_reference(dense)
        dense_logits = dense(tokens, positions=positions, attention_masks=dense.get_attention_masks(positions))
        cad_flex = copy.deepcopy(flex)
        c = apply_cad(cad_flex, policy="minbytes", cost_model=COST_MODEL)
        cad_logits = cad_flex(tokens, positions=positions, attention_masks=cad_flex.get_attention_masks(positions))
        # control: the same weights with causal attention over whole rows (no document mask)
        from torchtitan.models.common.attention import ScaledDotProductAttention
        rows = copy.deepcopy(flex)
        for layer in rows.layers.values():
            layer.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        rows_logits = rows(tokens, positions=positions)
    out["flex_forward"] = {"dense_vs_flex": max_rel(dense_logits, flex_logits),
                           "cad_vs_flex": max_rel(cad_logits, flex_logits),
                           "no_document_mask_vs_flex": max_rel(rows_logits, flex_logits), "docs": c.last.num_documents}

    # (3) Packed documents, trained: TorchTitan's block-causal mask (dense) vs CAD, the 2-rank test's
    # global batch in one process.
    out["packed"] = compare(rank, world)

    out["errors"] = bad_configurations(flex)
    return out


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def bad_configurations(flex):
    """Each misuse -> its error message (None: no error)."""
    from distca.torch import StepPlanner
    from distca.torch.adapters.torchtitan import CADInnerAttention, apply_cad

    errors = {}
    model = copy.deepcopy(flex)
    tokens, _, positions = global_batch(0)
    errors["not_a_decoder"] = _error(lambda: apply_cad(nn.Linear(4, 4), policy="none"))
    wrong = StepPlanner(model={"heads": 8, "kv_heads": 2, "head_dim": 8}, policy="none")
    errors["planner_shape"] = _error(lambda: apply_cad(model, wrong))
    errors["planner_and_kwargs"] = _error(lambda: apply_cad(model, wrong, policy="none"))
    cad = apply_cad(model, policy="none")
    errors["applied_twice"] = _error(lambda: apply_cad(model, policy="none"))
    # TorchTitan's own BlockMask (made before apply_cad) handed to the CAD layers
    own = flex.get_attention_masks(positions)
    errors["own_block_mask"] = _error(lambda: model(tokens, positions=positions, attention_masks=own))
    errors["no_masks"] = _error(lambda: model(tokens, positions=positions))
    masks = model.get_attention_masks(positions)
    errors["shape_mismatch"] = _error(lambda: model(tokens[:1], positions=positions[:1], attention_masks=masks))
    errors["positions_1d"] = _error(lambda: model.get_attention_masks(positions[0]))
    errors["positions_float"] = _error(lambda: model.get_attention_masks(positions.float()))
    inner = CADInnerAttention()
    q = torch.zeros(2, SEQ, HEADS, HEAD_DIM)
    kv = torch.zeros(2, SEQ, KV_HEADS, HEAD_DIM)
    errors["out_transform"] = _error(lambda: inner(q, kv, kv, attention_masks=masks, out_transform=lambda o, lse: o))
    errors["non_causal"] = _error(lambda: inner(q, kv, kv, attention_masks=masks, is_causal=False))
    errors["mla_value_dim"] = _error(lambda: inner(q, kv, kv[..., :8], attention_masks=masks))
    errors["sliding_window_model"] = _error(lambda: apply_cad(_custom_masks_model(flex), policy="none"))
    # a good call still works after the rejected ones, and remove() restores TorchTitan's attention
    with torch.no_grad():
        model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    cad.remove()
    errors["removed_is_flex"] = type(model.layers["0"].attention.inner_attention).__name__
    errors["removed_masks"] = type(model.get_attention_masks(positions)).__name__
    return errors


def _custom_masks_model(flex):
    """A Llama3 whose class makes its own masks (as gpt_oss' sliding windows)."""
    model = copy.deepcopy(flex)

    class WindowedLlama3(type(flex)):
        def get_attention_masks(self, positions):
            return super().get_attention_masks(positions)

    model.__class__ = WindowedLlama3
    return model


def compare(rank, world, device="cpu", reference="dense", steps=STEPS):
    """The packed-document training comparison, data parallel by hand over the default group: the
    global batch has max(2, world) skewed rows (rank r takes rows r, r + world, ...), CAD moving
    attention between the ranks; against the single-process run of the whole global batch with
    TorchTitan's own attention: `dense` (its block-causal mask_mod applied by SDPA: CPU), `flex`
    (its compiled FlexAttention: CUDA, which has flex's backward) or `varlen` (CUDA, bf16)."""
    from distca.torch.adapters.torchtitan import apply_cad

    num_rows = max(2, world)
    base = build_model("varlen" if reference == "varlen" else "flex").to(device)
    ref = copy.deepcopy(base)
    if reference == "dense":
        use_dense_reference(ref)
    want = train(ref, [global_batch(s, num_rows, device) for s in range(steps)], own_masks)
    cad_model = copy.deepcopy(base)
    cad = apply_cad(cad_model, policy="minbytes", cost_model=COST_MODEL)
    moved, plans_before, same_positions = [], [], []

    def masks_fn(model, tokens, positions):
        plans_before.append(cad.num_plans)
        masks = model.get_attention_masks(positions=positions)   # as TorchTitan's Trainer.post_dataloading_process
        moved.append(rows_served_remotely(masks))
        # TorchTitan's RoPE positions (per document, from its dataloader) are CAD's document positions
        same_positions.append(bool(torch.equal(masks.layout.positions.cpu(), positions.reshape(-1).cpu())))
        return masks

    batches = [stack(skewed_rows(s, num_rows)[rank::world], device) for s in range(steps)]
    group = dist.group.WORLD if world > 1 else None
    got = train(cad_model, batches, masks_fn, total_tokens=num_rows * SEQ, group=group)
    return {"want": want, "got": got, "params": max_rel(flat_params(cad_model), flat_params(ref)),
            "moved": moved, "plans": cad.num_plans, "plans_before": plans_before, "same_positions": same_positions,
            "calls": [a.calls for a in cad.inner_attentions], "docs": cad.last.num_documents}


def two_rank_worker(rank, world):
    return compare(rank, world)


# ---------------------------------------------------------------------------------------------
# The GPU recipe (not run by the tests): CAD against TorchTitan's own FlexAttention (CUDA has its
# backward) or VarlenAttention (CUDA only, bf16), trained, on one GPU or under torchrun:
#   python python/tests/torchtitan_cases.py --reference flex            # 1 GPU, 1-rank NCCL group
#   python python/tests/torchtitan_cases.py --reference varlen
#   torchrun --nproc-per-node 2 python/tests/torchtitan_cases.py --reference flex   # 2 GPUs
# (--device cpu --reference dense runs the CPU comparison the same way, gloo.)

TOLERANCES = {"dense": 1e-5, "flex": 1e-4, "varlen": 2e-2}   # varlen computes in bf16


def main(argv=None) -> int:
    import argparse
    import json
    import os

    parser = argparse.ArgumentParser(description="CAD in TorchTitan's attention slot vs TorchTitan's own attention")
    parser.add_argument("--reference", choices=sorted(TOLERANCES), default="flex")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--json", help="write rank 0's result here")
    args = parser.parse_args(argv)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        r = compare(rank, world, device, args.reference, args.steps)
    finally:
        dist.destroy_process_group()
    r["loss_max_rel_diff"] = max(abs(g - w) / abs(w) for g, w in zip(r["got"], r["want"]))
    r.update(reference=args.reference, world=world, device=str(device), tolerance=TOLERANCES[args.reference])
    ok = r["loss_max_rel_diff"] <= r["tolerance"] and r["plans"] == args.steps
    r["ok"] = ok
    print(f"rank {rank}: {json.dumps(r)}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())


def pipeline_worker(rank, world):
    """PP 2 on 2 ranks: the TorchTitan model split into two stages as pipeline_llm does
    (torchtitan's _split_module: embedding and layer 0, then layer 1, the norm and the LM head),
    CAD in each stage, run by ScheduleCADLockstep over 4 micro-batches (one row each) for 3
    AdamW steps; each rank also trains the whole model alone over the same rows (TorchTitan's
    block-causal mask applied densely). Returns the losses, and each stage's parameters' largest
    relative difference from the one-process model's (as one vector)."""
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.distributed.pipeline_parallel import _split_module

    from distca.torch import StepPlanner
    from distca.torch.adapters.torchtitan import LockstepMasks, apply_cad, lockstep_documents
    from distca.torch.parallel import ScheduleCADLockstep

    micro_batches = 4
    whole = build_model("flex")
    out = {}
    names = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]][rank]
    module = _split_module(whole, names)
    reference = copy.deepcopy(whole)
    use_dense_reference(reference)
    out["want"] = train(reference, [global_batch(s, micro_batches) for s in range(STEPS)], own_masks)
    planner = StepPlanner(model={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}, cost_model=COST_MODEL,
                          backward="stateless", policy="minbytes", granularity=16, tolerance=0.0)
    apply_cad(module, planner=planner)
    ex_in = torch.zeros(1, SEQ, dtype=torch.long) if rank == 0 else torch.zeros(1, SEQ, DIM, requires_grad=True)
    ex_out = torch.zeros(1, SEQ, DIM if rank == 0 else VOCAB, requires_grad=True)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(ex_in,), output_args=(ex_out,))
    total = {"n": 1}

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / total["n"]

    schedule = ScheduleCADLockstep(stage, micro_batches, planner, layers_per_stage=1, loss_fn=loss_fn,
                                   scale_grads=False, documents=lockstep_documents)
    masks = LockstepMasks(schedule, 1, SEQ)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    got, served = [], 0
    for step in range(STEPS):
        rows = skewed_rows(step, micro_batches)
        total["n"] = sum(labels.numel() for _, labels, _ in rows)
        losses: list = []
        schedule.step(arg_mbs=[(tokens,) if rank == 0 else () for tokens, _, _ in rows],
                      kwarg_mbs=[{"positions": positions, "attention_masks": masks} for _, _, positions in rows],
                      target_mbs=[labels for _, labels, _ in rows], losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.tensor([sum(float(x.detach()) for x in losses) if rank == 1 else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        got.append(float(loss))
        served += sum(t.served_rows for t in schedule.records if t.micro_batch is None)
    planner.finish()
    mine = dict(module.named_parameters())
    ref_params = dict(reference.named_parameters())
    # As the other runs here compare them: the stage's parameters as one vector (flat_params).
    flat = lambda params: torch.cat([params[k].detach().reshape(-1) for k in sorted(mine)])  # noqa: E731
    out.update(got=got, served_idle_rows=served, num_params=len(mine), params=max_rel(flat(mine), flat(ref_params)))
    return out


def tp_worker(rank, world):
    """TP 2 x DP 2 on 4 ranks: the model sharded by tensor_parallel (DTensor on a CPU mesh), CAD
    over each TP index's data-parallel group, each replica one row of the skewed global batch, 3
    AdamW steps; each rank also trains the whole model alone over both rows (TorchTitan's
    block-causal mask applied densely). Returns the losses, the full (gathered) parameters' largest
    relative difference from the one-process model's (as one vector), the planner's attention
    shape, the rows CAD moved, and the error of a TP rank that plans other documents."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from distca.torch.adapters.torchtitan import apply_cad, tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    replica, dp_group, tp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group(), mesh["tp"].get_group()
    whole = build_model("flex")
    reference = copy.deepcopy(whole)
    use_dense_reference(reference)
    out = {"want": train(reference, [global_batch(s) for s in range(STEPS)], own_masks)}
    model = tensor_parallel(copy.deepcopy(whole), mesh["tp"])
    cad = apply_cad(model, group=dp_group, tp_group=tp_group, policy="minbytes", cost_model=COST_MODEL,
                    granularity=16)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    got, moved = [], 0
    for step in range(STEPS):
        tokens, labels, positions = skewed_rows(step)[replica]
        masks = model.get_attention_masks(positions)
        moved += rows_served_remotely(masks)
        logits = model(tokens, positions=positions, attention_masks=masks)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (2 * SEQ)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=dp_group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        got.append(float(total))
    full = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for k, p in model.named_parameters()}
    sharded = sorted(k for k, p in model.named_parameters() if isinstance(p, DTensor))
    ref_params = dict(reference.named_parameters())
    flat = lambda params: torch.cat([params[k].detach().reshape(-1) for k in sorted(full)])  # noqa: E731
    m = cad.planner.model
    out.update(got=got, params=max_rel(flat(full), flat(ref_params)), moved=moved, sharded=sharded,
               shape=[m.num_q_heads, m.num_kv_heads, m.head_dim], plans=cad.num_plans,
               calls=[a.calls for a in cad.inner_attentions])
    # A TP rank of replica 0 planning other documents than its TP peer: one error on every rank.
    _, _, positions = skewed_rows(0)[replica]
    if rank == 1:
        positions = skewed_rows(1)[1][2]
    out["tp_mismatch"] = _error(lambda: model.get_attention_masks(positions))
    cad.planner.finish()
    return out
