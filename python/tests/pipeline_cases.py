"""Shared by the pipeline tests: ranks that serve with no rows of their own, and a PP x DP run of
the small model under the lockstep CAD schedule or PyTorch's Schedule1F1B, against one process
over the whole batch."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from torch_cases import COST_MODEL, MODEL, doc_data

# The pipeline runs' model: 4 layers, GQA.
ARGS = dict(vocab_size=256, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64)
TOKENS = 96          # per micro-batch
MICRO_BATCHES = 4
LR, EPS = 3e-3, 1e-4  # AdamW; eps 1e-4 so that a gradient entry near zero does not move its weight by ±lr


def serve_worker(rank: int, world: int, backward: str) -> dict:
    """Ranks 0 and 1 hold documents, rank 2 none: it plans [0] and serves with cad_serve. Returns
    each rank's max error against whole-document attention and the rows rank 2 served."""
    from distca.torch import StepPlanner, cad_attention, cad_serve
    from torch_cases import whole_document
    lengths = {0: [200], 1: [9, 30, 17, 4]}
    planner = StepPlanner(model=MODEL, cost_model=COST_MODEL, backward=backward, policy="minlink", tolerance=0.0,
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


def batches(step: int, replicas: int) -> list:
    """The step's micro-batches: [replica][micro-batch] of (tokens [TOKENS], targets, cu_seqlens
    list). Micro-batch 0 of replica 0 is one long document; the others short documents."""
    rng = np.random.default_rng(100 + step)
    out = []
    for r in range(replicas):
        mbs = []
        for m in range(MICRO_BATCHES):
            if (r, m) == (0, 0) or (r, m) == (replicas - 1, MICRO_BATCHES - 1):
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
    from distca.torch.train.model import ModelArgs, Transformer, document_attention, packed_cross_entropy
    model = Transformer(ModelArgs(**ARGS))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        b = batches(step, replicas)
        flat = [mb for mbs in b for mb in mbs]
        tokens = torch.cat([t for t, _, _ in flat])
        targets = torch.cat([t for _, t, _ in flat])
        cu, at = [0], 0
        for _, _, c in flat:
            cu += [at + x for x in c[1:]]
            at += c[-1]
        from distca.torch.train.model import document_positions
        logits = model(tokens, document_positions(cu), document_attention(torch.tensor(cu)))
        loss = packed_cross_entropy(logits, targets) / _total_targets(b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    return {"losses": losses, "params": {k: v.tolist() for k, v in model.state_dict().items()}}


def pipeline_worker(rank: int, world: int, pp: int, mode: str, steps: int, prefetch: bool = False) -> dict:
    """PP `pp` x DP world / pp: mode "cad" (ScheduleCADLockstep over the CAD group) or "1f1b"
    (PyTorch's Schedule1F1B, each stage attending its own micro-batch). Returns the losses (on
    the last stage), this stage's parameters and, for cad, the tick records."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from distca.torch import StepPlanner
    from distca.torch.parallel import RankGroups, ScheduleCADLockstep
    from distca.torch.train.model import ModelArgs, TransformerStage, packed_cross_entropy
    groups = RankGroups.make(pp=pp)
    stage_index, replica, dp = groups.me.stage, groups.me.replica, groups.map.dp
    args = ModelArgs(**ARGS)
    module = TransformerStage(args, stage_index, pp)
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
        planner = StepPlanner(groups.cad, model={"heads": args.n_heads, "kv_heads": args.n_kv_heads,
                                                 "head_dim": args.head_dim},
                              cost_model=COST_MODEL, backward="stateless", tolerance=0.0, granularity=16,
                              prefetch=prefetch)
        schedule = ScheduleCADLockstep(stage, MICRO_BATCHES, planner, layers_per_stage=args.n_layers // pp,
                                       loss_fn=loss_fn, scale_grads=False)
        module.source = schedule.attention
    else:
        schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses, ticks = [], []
    for step in range(steps):
        b = batches(step, dp)
        total["n"] = _total_targets(b)
        mine = b[replica]
        mb_losses: list = []
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
    groups.destroy()
    return {"stage": stage_index, "replica": replica, "losses": losses if last else None, "ticks": ticks,
            "params": {k: v.tolist() for k, v in module.state_dict().items()}}
