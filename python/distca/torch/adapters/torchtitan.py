"""CAD in TorchTitan's attention slot (torchtitan 0.3, `torchtitan` on PyPI).

    from distca.torch.adapters.torchtitan import apply_cad

    model = model_config.build(); model.init_states()      # a TorchTitan decoder (Llama3, Qwen3, ...)
    cad = apply_cad(model, policy="minbytes")               # or apply_cad(model, planner=StepPlanner(...))
    # each step (TorchTitan's Trainer.post_dataloading_process already makes this call):
    masks = model.get_attention_masks(positions)            # plans the step once (collective): CADMasks
    logits = model(tokens, positions=positions, attention_masks=masks)   # every layer reuses the layout

apply_cad swaps every layer's `attention.inner_attention` (TorchTitan's FlexAttention,
VarlenAttention or ScaledDotProductAttention) for CADInnerAttention, and replaces the model's
`get_attention_masks(positions)` by TorchTitanCAD.get_attention_masks: it reads the documents from
`positions` the way TorchTitan's block-causal masks do (a document starts where positions is 0,
and at the start of each batch row), plans them once with distca.torch.StepPlanner, and returns a
CADMasks that the model forwards, as its attention_masks, to every layer. Attention is causal
within each document (TorchTitan's block_causal), batch rows packed end to end into this rank's
rows. RoPE is left to TorchTitan: its attention applies it at `positions` (per-document positions
from its dataloaders), before the inner attention; CAD does not touch positions.

TorchTitan's Trainer calls get_attention_masks only for models configured with its flex or varlen
backend (the language-model default): keep that config; with ScaledDotProductAttention, call
cad.plan(shape=(B, L)) (one document per row) and pass the result as attention_masks yourself.
CADInnerAttention runs eagerly under torch.compile.

Pipeline parallelism: split the model into stages as TorchTitan's pipeline_llm does, apply_cad to
each stage module, and run the stages under distca.torch.parallel.ScheduleCADLockstep with
documents=lockstep_documents and attention_masks=LockstepMasks(schedule, B, L) in every
micro-batch's keywords (tested: 2 stages on 2 gloo ranks against one process).

Tensor parallelism by head group: tensor_parallel(model, tp_mesh) shards every layer with
PyTorch's DTensor (torch.distributed.tensor.parallel: the query/key/value and FFN input
projections column-wise, the attention output and FFN output projections row-wise, as
TorchTitan's dense TP plan; embeddings, norms and the LM head replicated), so each TP rank's
attention sees Hq / T query and Hkv / T key/value heads as plain tensors; then
apply_cad(model, group=<the DP ranks of this TP index>, tp_group=<the TP group>) plans with that
shape and checks each plan's hash over the TP group (a mismatch: one InputError on every rank).
TorchTitan 0.3's own parallelize path declares its sharding through spmd_types on the configs and
ParallelDims; that path is not used here. Untested: context parallelism, activation
checkpointing (its recomputed forward calls cad_attention again, on every rank in the same order).

Not supported (ValueError): attention modules other than TorchTitan's GQAttention family, models
with their own get_attention_masks (sliding windows, multimodal masks), out_transform (attention
sinks), score_mod, non-causal calls, value head dim != query head dim (MLA), a planner whose
attention shape is not this rank's (the model's heads / T under tp_group), and heads or key/value
heads not divisible by T. The
framework is imported only here, when used; `import distca.torch` never needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..cad.attention import cad_attention
from ..cad.layout import StepLayout
from ..cad.planner import StepPlanner
from ..parallel.tensor import check_tp_plan
from .documents import document_cu_seqlens

__all__ = ["CADInnerAttention", "CADMasks", "LockstepMasks", "TorchTitanCAD", "apply_cad", "document_cu_seqlens",
           "lockstep_documents", "tensor_parallel"]


def _torchtitan():
    """The real TorchTitan package (absolute import: not this module, which shares its name)."""
    try:
        import torchtitan
        from torchtitan.models.common import attention as tt_attention
        from torchtitan.models.common import decoder as tt_decoder
    except ImportError as e:
        raise ImportError(
            "distca.torch.adapters.torchtitan needs TorchTitan's model code: pip install --no-deps "
            "torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1") from e
    return torchtitan, tt_attention, tt_decoder


@dataclass
class CADMasks:
    """One step's CAD layout, passed by the model as attention_masks to every layer."""
    layout: StepLayout
    batch: int                 # B of the model's [B, L] input
    seq_len: int               # L
    cu_seqlens: list           # document boundaries in this rank's B * L packed rows
    step: int                  # TorchTitanCAD's plan count when made

    @property
    def num_documents(self) -> int:
        return len(self.cu_seqlens) - 1


@dataclass
class LockstepMasks:
    """attention_masks for a TorchTitan pipeline stage under ScheduleCADLockstep
    (distca.torch.parallel): every micro-batch passes the same object, and each layer reads the
    layout of the tick being run (schedule.current). batch and seq_len: a micro-batch's [B, L]."""
    schedule: Any
    batch: int
    seq_len: int

    @property
    def layout(self) -> StepLayout:
        layout = self.schedule.current
        if layout is None:
            raise ValueError("LockstepMasks: the stage ran outside a forward tick of its ScheduleCADLockstep")
        return layout


def lockstep_documents(kwargs: dict) -> list:
    """ScheduleCADLockstep's documents= for TorchTitan stages: a micro-batch's cu_seqlens from
    its `positions` keyword (documents restart where positions is 0), as get_attention_masks
    reads them."""
    return document_cu_seqlens(kwargs["positions"], None)


class TorchTitanCAD:
    """The per-model CAD state apply_cad returns: the planner, and the step's planning.

    get_attention_masks(positions) (installed as the model's) / plan(positions): collective over
    the planner's group, once per step; every layer's CADInnerAttention reuses the CADMasks."""

    def __init__(self, planner: StepPlanner, tp_group: Any = None):
        self.planner = planner
        self.tp_group = tp_group          # the plan's hash is checked over it (tensor parallelism)
        self.num_plans = 0
        self.last: Optional[CADMasks] = None
        self._swapped: list = []          # (attention module, its original inner attention)
        self._model: Any = None
        self._own_masks_fn: Any = None    # an instance-level get_attention_masks apply_cad replaced

    @property
    def inner_attentions(self) -> list:
        """The CADInnerAttention of every swapped layer, in model order."""
        return [attention.inner_attention for attention, _ in self._swapped]

    def plan(self, positions: Optional[torch.Tensor] = None, *, shape: Optional[tuple] = None) -> CADMasks:
        """Plans one step: positions [B, L] (documents restart where positions is 0), or shape
        (B, L) with positions None (one document per row)."""
        cu = document_cu_seqlens(positions, shape)      # checks positions / shape
        b, s = tuple(positions.shape) if positions is not None else tuple(shape or ())
        layout = self.planner.plan(cu)
        if self.tp_group is not None:
            check_tp_plan(self.planner, layout, self.tp_group)
        self.num_plans += 1
        self.last = CADMasks(layout, int(b), int(s), cu, self.num_plans)
        return self.last

    def get_attention_masks(self, positions: Optional[torch.Tensor] = None, **kwargs: Any) -> CADMasks:
        """The model's get_attention_masks after apply_cad (TorchTitan's trainer calls it per step)."""
        if kwargs:
            raise ValueError(f"get_attention_masks: CAD takes positions only, got {sorted(kwargs)}")
        if positions is None:
            raise ValueError("get_attention_masks needs positions [B, L]; without positions call cad.plan(shape=(B, L))")
        return self.plan(positions)

    def remove(self) -> None:
        """Puts TorchTitan's own inner attentions and get_attention_masks back."""
        for attention, inner in self._swapped:
            attention.inner_attention = inner
        self._swapped = []
        if self._model is not None:
            self._model.__dict__.pop("get_attention_masks", None)
            if self._own_masks_fn is not None:
                self._model.__dict__["get_attention_masks"] = self._own_masks_fn
            self._model.__dict__.pop("_distca_cad", None)
            self._model = None


class CADInnerAttention(nn.Module):
    """TorchTitan's inner attention slot, computed by cad_attention: same call as TorchTitan's
    FlexAttention / VarlenAttention (q, k, v [B, L, N, H] after RoPE; attention_masks; scale;
    enable_gqa) -> [B, L, Hq, H]. attention_masks must be the step's CADMasks. Runs eagerly
    under torch.compile (the exchanges are collectives)."""

    def __init__(self, backend: Optional[str] = None, replaces: str = ""):
        super().__init__()
        self.backend = backend
        self.replaces = replaces
        self.calls = 0

    def extra_repr(self) -> str:
        return f"replaces={self.replaces or '?'}, backend={self.backend or 'planner'}"

    @torch.compiler.disable
    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
                out_transform: Any = None, score_mod: Any = None, is_causal: bool = True,
                **kwargs: Any) -> torch.Tensor:
        if not isinstance(attention_masks, (CADMasks, LockstepMasks)):
            got = "None" if attention_masks is None else type(attention_masks).__name__
            raise ValueError(
                f"CADInnerAttention needs the step's CADMasks as attention_masks, got {got}: after apply_cad, "
                "masks = model.get_attention_masks(positions) (TorchTitan's trainer does this each step) or "
                "cad.plan(...), then model(tokens, positions=positions, attention_masks=masks)")
        if out_transform is not None:
            raise ValueError("CADInnerAttention: out_transform (e.g. attention sinks) is not supported: "
                             "it needs a differentiable LSE")
        if score_mod is not None:
            raise ValueError("CADInnerAttention: score_mod is not supported (CAD computes plain softmax attention)")
        if not is_causal:
            raise ValueError("CADInnerAttention: only causal (block-causal per document) attention is supported")
        for name, x in (("q", q_BLNH), ("k", k_BLNH), ("v", v_BLNH)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"CADInnerAttention: {name} must be [B, L, heads, head_dim], got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        b, s, hq, d = q_BLNH.shape
        if k_BLNH.shape[:2] != (b, s) or v_BLNH.shape[:2] != (b, s):
            raise ValueError(f"CADInnerAttention: q, k, v must share [B, L]: {tuple(q_BLNH.shape)}, "
                             f"{tuple(k_BLNH.shape)}, {tuple(v_BLNH.shape)}")
        if k_BLNH.shape[-1] != d or v_BLNH.shape[-1] != d:
            raise ValueError(f"CADInnerAttention: q, k and v need one head_dim (MLA's value head dim is not "
                             f"supported): {d}, {k_BLNH.shape[-1]}, {v_BLNH.shape[-1]}")
        m = attention_masks
        if (b, s) != (m.batch, m.seq_len):
            raise ValueError(f"CADInnerAttention: the input is [B, L] = [{b}, {s}], the step was planned for "
                             f"[{m.batch}, {m.seq_len}] (plan each step, with that step's positions)")
        t = b * s
        q = q_BLNH.reshape(t, hq, d).contiguous()
        k = k_BLNH.reshape(t, k_BLNH.shape[2], d).contiguous()
        v = v_BLNH.reshape(t, v_BLNH.shape[2], d).contiguous()
        self.calls += 1
        o = cad_attention(q, k, v, m.layout, scale=scale, backend=self.backend)
        return o.view(b, s, hq, d)


def _attention_modules(model: nn.Module) -> list:
    return [(name, mod) for name, mod in model.named_modules() if hasattr(mod, "inner_attention")]


def apply_cad(model: nn.Module, planner: Optional[StepPlanner] = None, *, group: Any = None,
              tp_group: Any = None, backend: Optional[str] = None, **planner_kwargs: Any) -> TorchTitanCAD:
    """Swaps every layer's inner attention of a TorchTitan decoder for CADInnerAttention and
    installs TorchTitanCAD.get_attention_masks as the model's; returns the TorchTitanCAD.

    planner: a StepPlanner whose model shape is this rank's layers' (heads, kv_heads, head_dim);
      without one, StepPlanner(group, model=that shape, **planner_kwargs) is made (collective over
      the group; torch.distributed must be initialised, world size 1 included).
    tp_group: with tensor parallelism (tensor_parallel), the rank's TP group: each rank's layers
      hold heads / T and kv_heads / T, and every plan's hash is checked over it. `group` is then
      the CAD group, the data-parallel ranks of this TP index.
    backend: the server kernel cad_attention uses (default: the planner's).
    """
    _, tt_attention, tt_decoder = _torchtitan()
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_cad: model must be a torch.nn.Module, got {type(model).__name__}")
    if "_distca_cad" in model.__dict__:
        raise ValueError("apply_cad: CAD is already applied to this model (TorchTitanCAD.remove() undoes it)")
    if not isinstance(model, tt_decoder.Decoder):
        raise ValueError(f"apply_cad: supports TorchTitan decoders (torchtitan.models.common.decoder.Decoder: "
                         f"Llama3, Qwen3, ...), got {type(model).__name__}")
    if type(model).get_attention_masks is not tt_decoder.Decoder.get_attention_masks:
        raise ValueError(f"apply_cad: {type(model).__name__} makes its own attention masks (sliding windows, "
                         f"multimodal or hybrid masks); CAD supports causal document masking only")
    supported = (tt_attention.FlexAttention, tt_attention.VarlenAttention, tt_attention.ScaledDotProductAttention)
    found = _attention_modules(model)
    if not found:
        raise ValueError("apply_cad: the model has no attention layer (no module with an inner_attention)")
    shapes = set()
    for name, attn in found:
        inner = attn.inner_attention
        if isinstance(inner, CADInnerAttention):
            raise ValueError(f"apply_cad: {name} already holds a CADInnerAttention")
        if not isinstance(attn, tt_attention.GQAttention):
            raise ValueError(f"apply_cad: {name} is a {type(attn).__name__}; CAD supports TorchTitan's "
                             f"GQAttention family (its inner attention calls are plain causal attention)")
        if not isinstance(inner, supported):
            raise ValueError(f"apply_cad: {name}.inner_attention is a {type(inner).__name__}; CAD replaces "
                             f"FlexAttention, VarlenAttention or ScaledDotProductAttention")
        if isinstance(inner, tt_attention.VarlenAttention) and tuple(inner.window_size) != (-1, 0):
            raise ValueError(f"apply_cad: {name} uses a varlen window {tuple(inner.window_size)}; CAD supports "
                             f"causal attention (window (-1, 0)) only")
        shapes.add((attn.n_heads, attn.n_kv_heads, attn.head_dim))
    if len(shapes) != 1:
        raise ValueError(f"apply_cad: the layers' attention shapes differ ({sorted(shapes)}); one planner "
                         f"serves one shape")
    heads, kv_heads, head_dim = shapes.pop()
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if heads % tp or kv_heads % tp:
        raise ValueError(f"apply_cad: {heads} heads and {kv_heads} key/value heads do not split over tensor "
                         f"parallelism {tp} (each TP rank holds whole head groups)")
    heads, kv_heads = heads // tp, kv_heads // tp
    if planner is None:
        planner = StepPlanner(group, model={"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim},
                              **planner_kwargs)
    else:
        if not isinstance(planner, StepPlanner):
            raise TypeError(f"apply_cad: planner must be a distca.torch.StepPlanner, got {type(planner).__name__}")
        if planner_kwargs or group is not None:
            raise ValueError("apply_cad: pass a planner or the planner's arguments, not both")
        shape = (planner.model.num_q_heads, planner.model.num_kv_heads, planner.model.head_dim)
        if shape != (heads, kv_heads, head_dim):
            raise ValueError(f"apply_cad: the planner's attention shape (heads, kv_heads, head_dim) = {shape} is "
                             + (f"not the model's {(heads, kv_heads, head_dim)}" if tp == 1 else
                                f"not this rank's {(heads, kv_heads, head_dim)} (the model's heads over tensor "
                                f"parallelism {tp})"))
    cad = TorchTitanCAD(planner, tp_group if tp > 1 else None)
    for _, attn in found:
        inner = attn.inner_attention
        cad._swapped.append((attn, inner))
        attn.inner_attention = CADInnerAttention(backend, type(inner).__name__)
    cad._model = model
    cad._own_masks_fn = model.__dict__.get("get_attention_masks")
    model.__dict__["_distca_cad"] = cad   # plain attribute (not a submodule): marks the model
    model.get_attention_masks = cad.get_attention_masks
    return cad


def tensor_parallel(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Shards a TorchTitan decoder's layers over a 1-d DeviceMesh with DTensor (in place; returns
    the model): per layer, the attention's fused wqkv (or wq, wk, wv) and the FFN's w1, w3
    column-wise, the attention's wo and the FFN's w2 row-wise, outputs as plain tensors; the
    embeddings, norms and LM head stay replicated (their gradients agree over the TP group). Each
    rank's attention then holds n_heads / T query and n_kv_heads / T key/value heads: pass the TP
    group to apply_cad(..., tp_group=). Raises ValueError on a model whose layers do not split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    _, tt_attention, tt_decoder = _torchtitan()
    if not isinstance(model, tt_decoder.Decoder):
        raise ValueError(f"tensor_parallel: supports TorchTitan decoders, got {type(model).__name__}")
    tp = tp_mesh.size()
    for name, layer in model.layers.items():
        attn = getattr(layer, "attention", None)
        if not isinstance(attn, tt_attention.GQAttention):
            raise ValueError(f"tensor_parallel: layer {name} has no GQAttention")
        if attn.n_heads % tp or attn.n_kv_heads % tp:
            raise ValueError(f"tensor_parallel: layer {name}'s {attn.n_heads} heads / {attn.n_kv_heads} key/value "
                             f"heads do not split over {tp} ranks")
        qkv = attn.qkv_linear
        plan: dict = {"attention.wo": RowwiseParallel()}
        if isinstance(qkv, tt_attention.FusedQKVLinear):
            plan["attention.qkv_linear.wqkv"] = ColwiseParallel()     # rows [kv head, q heads + k + v, head_dim]
        elif isinstance(qkv, tt_attention.QKVLinear):
            plan.update({f"attention.qkv_linear.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
        else:
            raise ValueError(f"tensor_parallel: layer {name}'s {type(qkv).__name__} projection is not one this "
                             "plan splits (QKVLinear or FusedQKVLinear)")
        ffn = getattr(layer, "feed_forward", None)
        if ffn is None or not all(isinstance(getattr(ffn, w, None), nn.Linear) for w in ("w1", "w2", "w3")):
            raise ValueError(f"tensor_parallel: layer {name} has no dense SwiGLU feed-forward (w1, w2, w3)")
        if ffn.w1.out_features % tp:
            raise ValueError(f"tensor_parallel: layer {name}'s FFN width {ffn.w1.out_features} does not split over "
                             f"{tp} ranks")
        plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                     "feed_forward.w3": ColwiseParallel()})
        parallelize_module(layer, tp_mesh, plan)
    return model
