"""Tensor parallelism by head group, as the paper and the C++ trainer do it (Megatron's split):

    attention   Wq, Wk, Wv by output columns: TP index i holds query heads
                [i Hq/T, (i+1) Hq/T) and key/value heads [i Hkv/T, (i+1) Hkv/T) (each query head's
                key/value head stays on its rank: GQA groups are whole); Wo by input columns;
                core attention of its own heads, through CAD over its TP index's CAD group
    feed-forward W1, W3 by output columns, W2 by input columns
    the rest    replicated: embedding, norms, LM head

Each split block starts with copy_to (identity forward, all-reduce of the gradient over the TP
group backward) and ends with reduce_from (all-reduce forward, identity backward), so the
replicated parameters get the whole gradient on every TP rank. Hkv not divisible by T is
refused (a key/value head would have to be copied to several TP ranks).

    shard_model(model, tp_group)          # a Transformer or TransformerStage, in place
    clip_grad_norm(model, 1.0, tp_group)  # the whole model's norm, the same on every TP rank
    layout = plan_tp(planner, tp_group, cu_seqlens)  # the plan's hash checked across the TP group
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cad.agreement import agree
from ..cad.layout import StepLayout
from ..cad.planner import StepPlanner
from ..trace import span


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        with span("tp all-reduce (input gradient)", track="exchange", rows=int(grad.shape[0])):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        with span("tp all-reduce (partial output)", track="exchange", rows=int(x.shape[0])):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """ValueError unless T divides the key/value heads (and so the query heads)."""
    if n_kv_heads % tp:
        raise ValueError(f"tensor parallelism: {n_kv_heads} key/value heads do not split over tp {tp} ranks (each TP "
                         f"rank holds Hkv / T key/value heads and their query heads; choose a tp dividing {n_kv_heads})")


def _rows(linear: nn.Linear, begin: int, end: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, end - begin, bias=False)
    with torch.no_grad():
        out.weight.copy_(linear.weight[begin:end])
    return out


def _columns(linear: nn.Linear, begin: int, end: int) -> nn.Linear:
    out = nn.Linear(end - begin, linear.out_features, bias=False)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:, begin:end])
    return out


class _SplitAttention(nn.Module):
    """One TP rank's slice of an Attention (train.model.Attention): the same forward."""

    def __init__(self, attention: nn.Module, group: Any, index: int, size: int):
        super().__init__()
        self.group = group
        d = attention.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads // size, attention.n_kv_heads // size, d
        q0, kv0 = index * self.n_heads * d, index * self.n_kv_heads * d
        self.wq = _rows(attention.wq, q0, q0 + self.n_heads * d)
        self.wk = _rows(attention.wk, kv0, kv0 + self.n_kv_heads * d)
        self.wv = _rows(attention.wv, kv0, kv0 + self.n_kv_heads * d)
        self.wo = _columns(attention.wo, q0, q0 + self.n_heads * d)
        self._forward = type(attention).forward

    def forward(self, x, cos, sin, core_attention):
        return reduce_from(self._forward(self, copy_to(x, self.group), cos, sin, core_attention), self.group)


class _SplitFeedForward(nn.Module):
    def __init__(self, ffn: nn.Module, group: Any, index: int, size: int):
        super().__init__()
        self.group = group
        hidden = ffn.w1.out_features
        if hidden % size:
            raise ValueError(f"tensor parallelism: the FFN's {hidden} hidden units do not split over tp {size} ranks")
        per = hidden // size
        self.w1 = _rows(ffn.w1, index * per, (index + 1) * per)
        self.w3 = _rows(ffn.w3, index * per, (index + 1) * per)
        self.w2 = _columns(ffn.w2, index * per, (index + 1) * per)
        self._forward = type(ffn).forward

    def forward(self, x):
        return reduce_from(self._forward(self, copy_to(x, self.group)), self.group)


def shard_model(model: nn.Module, group: Any) -> nn.Module:
    """Splits every TransformerBlock of `model` (a train.model.Transformer or TransformerStage,
    holding the whole model's weights) over the TP group, in place: this rank keeps its head
    group and FFN slice. A TP group of one changes nothing. Returns the model."""
    size, index = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return model
    args = model.args
    check_heads(args.n_heads, args.n_kv_heads, size)
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in layers:
        block.attention = _SplitAttention(block.attention, group, index, size)
        block.feed_forward = _SplitFeedForward(block.feed_forward, group, index, size)
    return model


# The split weights and the dimension they are split along (train.model's names).
_SPLIT_DIMS = {"attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0, "attention.wo.weight": 1,
               "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1}


def full_state_dict(model: nn.Module, group: Any) -> dict:
    """Collective over the TP group: the state dict of the whole model's weights (the split ones
    gathered in TP order), the same on every TP rank; what shard_model split, put back."""
    size = dist.get_world_size(group)
    out = {}
    for name, value in model.state_dict().items():
        dim = next((d for suffix, d in _SPLIT_DIMS.items() if name.endswith(suffix)), None)
        if size == 1 or dim is None:
            out[name] = value
            continue
        parts = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(parts, value.contiguous(), group=group)
        out[name] = torch.cat(parts, dim=dim)
    return out


def clip_grad_norm(model: nn.Module, max_norm: float, tp_group: Any, pp_group: Any = None) -> float:
    """torch.nn.utils.clip_grad_norm_ over the whole model when its blocks are split over the TP
    group (and its layers over the stages of pp_group): the split weights' squares summed over
    the TP group, the replicated ones counted once, the stages' sums added; every rank scales its
    gradients by the same factor. Collective over both groups. Returns the norm before clipping."""
    split = torch.zeros((), dtype=torch.float64)
    whole = torch.zeros((), dtype=torch.float64)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if any(name.endswith(suffix) for suffix in _SPLIT_DIMS):
            split += sq
        else:
            whole += sq
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(split, group=tp_group)
    total = split + whole
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def check_tp_plan(planner: StepPlanner, layout: StepLayout, tp_group: Any) -> None:
    """The layout's plan hash compared over the TP group (see plan_tp)."""
    size = dist.get_world_size(tp_group)
    if size == 1:
        return
    hashes = torch.zeros(size, dtype=torch.int64)
    hashes[dist.get_rank(tp_group)] = layout.hash & 0x7FFFFFFFFFFFFFFF
    dist.all_reduce(hashes, group=tp_group)
    message = None
    if len(set(hashes.tolist())) > 1:
        message = (f"the TP ranks of a replica made different plans (hashes "
                   f"{', '.join(f'{h:016x}' for h in hashes.tolist())}): they must give the same documents")
    agree(planner.control_group, message, "tensor parallelism")


def plan_tp(planner: StepPlanner, tp_group: Any, cu_seqlens: Any = None, *, pieces: Any = None) -> StepLayout:
    """planner.plan(cu_seqlens or pieces) over this TP index's CAD group, then its plan's hash compared over
    the TP group (the TP ranks of a replica hold the same documents, so their plans, over their
    own CAD groups, must be one): a mismatch raises the same InputError on every rank (agreed
    over the TP group, then over the CAD group, which together reach every rank)."""
    layout = planner.plan(cu_seqlens, pieces=pieces)
    check_tp_plan(planner, layout, tp_group)
    return layout
