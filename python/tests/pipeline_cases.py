"""Shared by the pipeline tests: ranks that serve with no rows of their own, and a PP x DP run of
the small model under the lockstep CAD schedule or PyTorch's Schedule1F1B, against one process
over the whole batch."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from torch_cases import COST_MODEL, MODEL, doc_data

# The pipeline runs' model: 4 layers, GQA (4 query heads over 2 key/value heads: splits over TP 2).
ARGS = dict(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
TOKENS = 96          # per micro-batch
MICRO_BATCHES = 4
LR, EPS = 3e-3, 1e-4  # AdamW; eps 1e-4 so that a gradient entry near zero does not move its weight by ±lr


def serve_worker(rank: int, world: int, backward: str) -> dict:
    """Ranks 0 and 1 hold documents, rank 2 none: it plans [0] and serves with cad_serve. Returns
    each rank's max error against whole-document attention and the rows rank 2 served."""
    from distca.torch import StepPlanner, cad_attention, cad_serve
    from torch_cases import whole_document
    lengths = {0: [200], 1: [9, 30, 17, 4]}
    planner = StepPlanner(model=MODEL, cost_model=COST_MODEL, backward=backward, state_budget=None, policy="minlink", tolerance=0.0,
                           granularity=32)
    mine = lengths.get(rank, [])
    layout = planner.plan([0] + list(np.cumsum(mine)))
    result = {"served_rows": sum(p.num_q_recv for p in layout.parts), "local_rows": layout.num_local_rows}
    if rank == 2:
        out = cad_serve(layout, torch.float32)
        assert out is not None and tuple(out.shape) == (0, MODEL["heads"], MODEL["head_dim"])
        if backward == "stateless":
            cad_serve(layout, torch.float32, backward=True)
        else:
            out.backward(torch.zeros_like(out))
        planner.finish()
        return result
    docs = doc_data(mine, seed=5 + rank)
    q, k, v, do = (torch.cat([d[i] for d in docs]).contiguous() for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = cad_attention(q, k, v, layout)
    out.backward(do)
    per_doc = [whole_document(*d) for d in docs]
    want = [torch.cat([w[i] for w in per_doc]) for i in range(4)]
    result["errors"] = {name: float((got.detach().double() - ref).abs().max() / ref.abs().max())
                        for name, got, ref in zip(("o", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), want)}
    planner.finish()
    return result


def batches(step: int, replicas: int, skewed: bool = False) -> list:
    """The step's micro-batches: [replica][micro-batch] of (tokens [TOKENS], targets, cu_seqlens
    list). Micro-batch 0 of replica 0 and the last of the last replica are one long document
    each, the others short documents; skewed: replica 0's first three are long documents."""
    rng = np.random.default_rng(100 + step)
    out = []
    long = {(0, 0), (0, 1), (0, 2)} if skewed else {(0, 0), (replicas - 1, MICRO_BATCHES - 1)}
    for r in range(replicas):
        mbs = []
        for m in range(MICRO_BATCHES):
            if (r, m) in long:
                lengths = [TOKENS]
            else:
                lengths, left = [], TOKENS
                while left:
                    n = int(min(left, rng.integers(3, 30)))
                    lengths.append(n)
                    left -= n
            tokens = torch.from_numpy(rng.integers(0, 256, TOKENS)).long()
            targets = torch.roll(tokens, -1).clone()
            cu = [0] + [int(x) for x in np.cumsum(lengths)]
            for end in cu[1:]:
                targets[end - 1] = -1
            mbs.append((tokens, targets, cu))
        out.append(mbs)
    return out


def _total_targets(step_batches: list) -> int:
    return sum(int((t >= 0).sum()) for mbs in step_batches for _, t, _ in mbs)


def one_process(steps: int, replicas: int) -> dict:
    """The whole model on one process over every replica's micro-batches, documents end to end."""
    from distca.torch.train.model import (ModelArgs, Transformer, document_attention, document_positions,
                                          packed_cross_entropy)
    model = Transformer(ModelArgs(**ARGS))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        b = batches(step, replicas)
        tokens, targets, cu = _step_rows([mb for mbs in b for mb in mbs])
        logits = model(tokens, document_positions(cu), document_attention(torch.tensor(cu)))
        loss = packed_cross_entropy(logits, targets) / _total_targets(b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    return {"losses": losses, "params": {k: v.tolist() for k, v in model.state_dict().items()}}


def pipeline_worker(rank: int, world: int, pp: int, mode: str, steps: int, prefetch: bool = False,
                    tp: int = 1, fault: str = "") -> dict:
    """PP `pp` x TP `tp` x DP world / (pp tp): mode "cad" (ScheduleCADLockstep over the CAD
    group) or "1f1b" (PyTorch's Schedule1F1B, each stage attending its own micro-batch). Returns
    the losses (on the last stage), this stage's whole parameters (TP slices gathered) and, for
    cad, the tick records. fault (on rank 1, cad): "skip" walks the table without tick 2, "table"
    runs micro-batch 2 where the table gives 1; the step then raises, and the worker returns the
    error's first line and how long the step took to raise it."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from distca.torch import StepPlanner
    from distca.torch.parallel import RankGroups, ScheduleCADLockstep, full_state_dict, shard_model
    from distca.torch.train.model import ModelArgs, TransformerStage, packed_cross_entropy
    groups = RankGroups.make(pp=pp, tp=tp)
    stage_index, replica, dp = groups.me.stage, groups.me.replica, groups.map.dp
    args = ModelArgs(**ARGS)
    module = shard_model(TransformerStage(args, stage_index, pp), groups.tp)
    first, last = stage_index == 0, stage_index == pp - 1
    # The static shapes PipelineStage sends and receives; requires_grad marks what carries gradients.
    example_in = torch.zeros(TOKENS, dtype=torch.long) if first else torch.zeros(TOKENS, args.dim, requires_grad=True)
    example_out = torch.zeros(TOKENS, args.vocab_size if last else args.dim, requires_grad=True)
    stage = PipelineStage(module, stage_index, pp, torch.device("cpu"), input_args=(example_in,),
                          output_args=(example_out,), group=groups.pp)
    total = {"n": 1}

    def loss_fn(logits, targets):
        return packed_cross_entropy(logits, targets) / total["n"]

    planner = None
    if mode == "cad":
        planner = StepPlanner(groups.cad, model={"heads": args.n_heads // tp, "kv_heads": args.n_kv_heads // tp,
                                                 "head_dim": args.head_dim},
                              cost_model=COST_MODEL, backward="stateless", tolerance=0.0, granularity=16,
                              prefetch=prefetch)
        schedule = ScheduleCADLockstep(stage, MICRO_BATCHES, planner, layers_per_stage=args.n_layers // pp,
                                       loss_fn=loss_fn, scale_grads=False, tp_group=groups.tp)
        module.source = schedule.attention
        if fault and rank == 1:
            ticks = list(schedule.table.ticks)
            if fault == "skip":
                del ticks[2]
            else:
                ticks[1] = tuple(("F", 2) if (op, m) == ("F", 1) else (op, m) for op, m in ticks[1])
            schedule.table = dataclasses.replace(schedule.table, ticks=tuple(ticks))
    else:
        schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses, ticks = [], []
    for step in range(steps):
        b = batches(step, dp)
        total["n"] = _total_targets(b)
        mine = b[replica]
        mb_losses: list = []
        if fault:
            start = time.perf_counter()
            try:
                schedule.step(arg_mbs=[(t,) if first else () for t, _, _ in mine],
                              kwarg_mbs=[{"cu_seqlens": cu} for _, _, cu in mine],
                              target_mbs=[t for _, t, _ in mine], losses=mb_losses)
            except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
                return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                        "seconds": time.perf_counter() - start}
            return {"error": None, "seconds": time.perf_counter() - start}
        schedule.step(arg_mbs=[(t,) if first else () for t, _, _ in mine],
                      kwarg_mbs=[{"cu_seqlens": cu} for _, _, cu in mine],
                      target_mbs=[t for _, t, _ in mine], losses=mb_losses)
        for p in module.parameters():
            dist.all_reduce(p.grad, group=groups.dp)
        opt.step()
        opt.zero_grad()
        loss = torch.tensor([sum(float(x.detach()) for x in mb_losses) if last else 0.0], dtype=torch.float64)
        dist.all_reduce(loss, group=groups.dp)
        losses.append(float(loss.item()))
        if mode == "cad":
            ticks.append([r.to_dict() for r in schedule.records])
    if planner is not None:
        planner.finish()
    params = {k: v.tolist() for k, v in full_state_dict(module, groups.tp).items()}
    groups.destroy()
    return {"stage": stage_index, "replica": replica, "tp": groups.me.tp, "losses": losses if last else None,
            "ticks": ticks, "params": params}


def _step_rows(replica_mbs: list) -> tuple:
    """A replica's micro-batches as one step: (tokens, targets, cu_seqlens)."""
    tokens = torch.cat([t for t, _, _ in replica_mbs])
    targets = torch.cat([t for _, t, _ in replica_mbs])
    cu, at = [0], 0
    for _, _, c in replica_mbs:
        cu += [at + x for x in c[1:]]
        at += c[-1]
    return tokens, targets, cu


def _whole_grads(model) -> dict:
    return {k: p.grad.tolist() for k, p in model.named_parameters()}


def one_process_grads(replicas: int) -> dict:
    """The loss and every parameter's gradient of the whole model over step 0's skewed batch."""
    from distca.torch.train.model import ModelArgs, Transformer, document_attention, document_positions, packed_cross_entropy
    model = Transformer(ModelArgs(**ARGS))
    b = batches(0, replicas, skewed=True)
    tokens, targets, cu = _step_rows([mb for mbs in b for mb in mbs])
    logits = model(tokens, document_positions(cu), document_attention(torch.tensor(cu)))
    loss = packed_cross_entropy(logits, targets) / _total_targets(b)
    loss.backward()
    return {"loss": float(loss.detach()), "grads": _whole_grads(model)}


def tp_worker(rank: int, world: int, tp: int) -> dict:
    """TP `tp` x DP world / tp, one forward and backward of step 0's skewed batch (each replica its
    micro-batches as one step) with CAD over each TP index's group. Returns the loss, the whole
    gradients (TP slices gathered, summed over DP) and the bytes this rank's exchanges sent to
    other ranks, counted at the all-to-alls."""
    import distca.torch.cad.attention as attention
    from distca.torch import StepPlanner, cad_attention
    from distca.torch.parallel import RankGroups, full_state_dict, plan_tp, shard_model
    from distca.torch.train.model import ModelArgs, Transformer, packed_cross_entropy
    groups = RankGroups.make(tp=tp)
    args = ModelArgs(**ARGS)
    model = shard_model(Transformer(args), groups.tp)
    planner = StepPlanner(groups.cad, model={"heads": args.n_heads // tp, "kv_heads": args.n_kv_heads // tp,
                                             "head_dim": args.head_dim},
                          cost_model=COST_MODEL, tolerance=0.0, granularity=16)
    b = batches(0, groups.map.dp, skewed=True)
    tokens, targets, cu = _step_rows(b[groups.me.replica])
    layout = plan_tp(planner, groups.tp, cu)
    sent = {"bytes": 0}
    real = attention._Exchange

    def counting(tensor, send_splits, recv_splits, group, *rest):
        row = math.prod(tensor.shape[1:]) * tensor.element_size()
        sent["bytes"] += (sum(send_splits) - send_splits[dist.get_rank(group)]) * row
        return real(tensor, send_splits, recv_splits, group, *rest)

    attention._Exchange = counting
    try:
        logits = model(tokens, layout.positions, lambda q, k, v: cad_attention(q, k, v, layout))
        loss = packed_cross_entropy(logits, targets) / _total_targets(b)
        loss.backward()
    finally:
        attention._Exchange = real
    for p in model.parameters():
        dist.all_reduce(p.grad, group=groups.dp)
    total = torch.tensor([float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(total, group=groups.dp)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = {k: v.tolist() for k, v in full_state_dict(model, groups.tp).items()}
    planner.finish()
    groups.destroy()
    return {"loss": float(total), "grads": grads, "sent_bytes": sent["bytes"], "hash": layout.hash,
            "replica": groups.me.replica, "tp": groups.me.tp}


def tp_mismatch_worker(rank: int, world: int) -> dict:
    """TP 2 x DP 1: TP rank 1 gives other documents than rank 0, so their plans differ; returns
    what each rank raised and how long plan_tp took to raise it."""
    from distca.torch import StepPlanner
    from distca.torch.parallel import RankGroups, plan_tp
    groups = RankGroups.make(tp=2)
    planner = StepPlanner(groups.cad, model={"heads": 2, "kv_heads": 1, "head_dim": 8}, cost_model=COST_MODEL)
    cu = [0, 40, 64] if rank == 0 else [0, 10, 64]
    start = time.perf_counter()
    try:
        plan_tp(planner, groups.tp, cu)
        error = None
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        error = f"{type(e).__name__}: {e}"
    planner.close()
    groups.destroy()
    return {"error": error, "seconds": time.perf_counter() - start}
