"""CAD in Megatron Core's `core_attention` slot: a drop-in for `DotProductAttention` /
`TEDotProductAttention` in a GPT layer spec.

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from distca.torch.adapters.megatron_core import CADContext, use_cad

    # after parallel_state.initialize_model_parallel(...); collective over the data-parallel group
    cad = CADContext(config)                         # a StepPlanner over the DP group, shapes from config
    spec = use_cad(get_gpt_layer_local_spec(), cad)  # every core_attention -> CADCoreAttention(cad=cad)
    model = GPTModel(config, spec, ...)
    loss = model(tokens, position_ids, None, labels=labels,
                 packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                   max_seqlen_q=m, max_seqlen_kv=m))

Planning, once per step. The first CAD layer that sees a micro-batch plans it (collective over the
context's group), and every later layer of that forward (and its backward, and a recomputation)
reuses the layout: `cad.num_plans` counts the plans. A THD micro-batch is known by its
`packed_seq_params.cu_seqlens_q` tensor (the object and its in-place version counter), so each
micro-batch needs its own cu_seqlens tensor (Megatron's data path makes a new one per batch) or an
in-place update of the old one. The ranks agree at every layer whether to plan (one tiny all-reduce
on the planner's gloo group), so a rank that reuses an unchanged tensor cannot hang the others. An
sbhd micro-batch [S, B, ...] is B documents of length S; its layout is kept per (S, B) and reused by
later steps of the same shape (all documents are equally long then: CAD has nothing to balance
within a rank, only across ranks). With `auto_plan=False` the layers never plan: the caller calls
`cad.plan(cu_seqlens)` (or `pieces=`, or `cad.planner.plan_async`) before each forward and the
layers use `cad.planner.current`.

Inputs, as Megatron's Attention passes them (after RoPE): THD q [T, Hq, D], k/v [T, Hkv, D] with
`PackedSeqParams(qkv_format="thd")`, returning [T, Hq * D]; sbhd [S, B, Hq, D] returning
[S, B, Hq * D]. Causal attention inside each document ("causal" or, with THD, "padding_causal"
masks; sbhd ignores attention_mask, as the causal mask type means). Megatron's THD RoPE restarts at
every cu_seqlens boundary, so each rank holds whole documents (`pieces` for documents spanning
ranks need RoPE at `layout.positions`, which Megatron does not apply).

Parallelism. The context's group is the data-parallel group (default: parallel_state's DP group,
without context parallelism): its ranks hold the same attention heads and different documents.
With tensor parallelism each rank's layer holds num_attention_heads / tp query heads and
num_query_groups / tp key/value heads (CADContext reads tp from parallel_state, or `tp_size=`),
and the ranks of one TP group plan the same documents alike (TP 2 x DP 2 on CPU: test_torch_megatron.py).
Context parallelism, attention dropout,
sliding windows, attention bias, softmax offsets, multi-latent and cross attention raise ValueError.

Megatron is imported only when the adapter is used (CADCoreAttention is built on first access);
`import distca.torch` and importing this module need no Megatron. megatron-core 0.16 needs NumPy
>= 1.25 (it imports `numpy.dtypes`): scripts/install-python.sh puts NumPy 1.26 in .venv.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import types
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..cad.agreement import agree
from ..cad.attention import cad_attention
from ..cad.layout import StepLayout
from ..cad.planner import StepPlanner

__all__ = ["CADContext", "CADCoreAttention", "use_cad", "cad_layer_spec", "core_attention_spec"]


def require_megatron() -> types.SimpleNamespace:
    """Megatron Core's modules the adapters use (an ImportError naming what to install without it)."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core import parallel_state
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.spec_utils import ModuleSpec
    except ImportError as e:
        raise ImportError("distca.torch.adapters.megatron_core needs megatron-core 0.16 and NumPy >= 1.25 "
                          "(pip install megatron-core==0.16.1 'numpy>=1.25'): " + str(e)) from e
    return types.SimpleNamespace(parallel_state=parallel_state, AttnMaskType=AttnMaskType,
                                 MegatronModule=MegatronModule, ModuleSpec=ModuleSpec)


def _tp_size(pg_collection: Any = None) -> int:
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if tp is not None:
        return tp.size()
    ps = require_megatron().parallel_state
    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_world_size()
    return 1


def _attention_shape(config: Any, tp: int) -> dict:
    """This rank's heads, key/value heads and head dim of a TransformerConfig under TP `tp`."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels or config.hidden_size // heads
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of the tensor-parallel size ({tp})")
    # Megatron's Attention gives core_attention max(num_query_groups, tp) groups (TE needs >= 1 per rank).
    groups = max(groups, tp)
    if groups % tp:
        raise ValueError(f"num_query_groups ({groups}) must be a multiple of the tensor-parallel size ({tp})")
    return {"heads": heads // tp, "kv_heads": groups // tp, "head_dim": head_dim}


class CADContext:
    """One model's CAD planning: a StepPlanner shared by every CADCoreAttention of the model.

    config: the model's TransformerConfig (the attention shape per TP rank and what the planner
      prices), or None with `model` given (StepPlanner's model dict of this rank's heads).
    group: the process group whose ranks exchange attention; default the data-parallel group
      (parallel_state, without CP) when Megatron's model parallelism is initialised, else the world.
    tp_size: tensor-parallel size (default: parallel_state's, or 1).
    auto_plan: layers plan each new micro-batch themselves (True), or use the layout the caller
      planned with `plan` / `planner.plan_async` (False).
    cache_size: layouts kept per context (recent micro-batches: recomputing an earlier micro-batch's
      core attention, as selective recompute does in its backward, reuses its layout).
    planner_options: StepPlanner's keywords (policy, tolerance, granularity, pingpong, backward,
      backend, check_inputs, static_buffers, ...).
    With an NCCL group, constructing it is collective over the default group (StepPlanner makes a
    gloo group with dist.new_group): construct it on every rank, in the same order.
    """

    def __init__(self, config: Any = None, *, model: Optional[Mapping[str, Any]] = None, group: Any = None,
                 tp_size: Optional[int] = None, auto_plan: bool = True, cache_size: int = 8,
                 **planner_options: Any):
        if config is None and model is None:
            raise ValueError("CADContext needs the model's TransformerConfig (or model={heads, kv_heads, head_dim})")
        if not isinstance(auto_plan, bool):
            raise TypeError("auto_plan must be a bool")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive integer, got {cache_size!r}")
        if group is None:
            ps = require_megatron().parallel_state if config is not None else None
            if ps is not None and ps.model_parallel_is_initialized():
                group = ps.get_data_parallel_group(with_context_parallel=False)
        if config is not None:
            if getattr(config, "context_parallel_size", 1) != 1:
                raise ValueError(f"CAD replaces context parallelism: context_parallel_size must be 1, got "
                                 f"{config.context_parallel_size}")
            tp = _tp_size() if tp_size is None else int(tp_size)
            shape = _attention_shape(config, tp)
            if model is None:
                model = shape
            planner_options.setdefault("cost_model", {
                "layers": config.num_layers, "hidden": config.hidden_size,
                "heads": config.num_attention_heads, "kv_heads": shape["kv_heads"] * tp, "head_dim": shape["head_dim"],
                "ffn_hidden": config.ffn_hidden_size or 4 * config.hidden_size,
                "dtype_bytes": 2 if (config.bf16 or config.fp16) else 4, "tp": tp})
        assert model is not None
        self.config = config
        self.planner = StepPlanner(group, model=model, **planner_options)
        self.auto_plan = auto_plan
        self.num_plans = 0
        # A pipeline schedule's current tick (megatron_lockstep.LockstepForwardBackward): while set,
        # the layers take their layout from it instead of planning on first sight.
        self.tick: Any = None
        self._cache: "collections.OrderedDict[Any, tuple]" = collections.OrderedDict()
        self._cache_size = cache_size

    @property
    def group(self) -> Any:
        return self.planner.group

    @property
    def layout(self) -> Optional[StepLayout]:
        """The last planned layout (planner.current)."""
        return self.planner.current

    def plan(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None) -> StepLayout:
        """Collective over the group: plans this rank's documents for the next forward (see
        StepPlanner.plan); with auto_plan=False the layers use it."""
        layout = self.planner.plan(cu_seqlens, pieces=pieces)
        self.num_plans += 1
        return layout

    # The layers' side --------------------------------------------------------------------------

    def _agree_all_hit(self, hit: bool) -> bool:
        if self.planner.world_size == 1:
            return hit
        flag = torch.tensor([0 if hit else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.planner.control_group)
        return flag.item() == 0

    def _cached(self, key: Any, state: tuple, make_cu) -> StepLayout:
        """The layout cached under `key` when its state is `state` (on every rank), else a new plan."""
        entry = self._cache.get(key)
        hit = entry is not None and len(entry[0]) == len(state) and all(a is b or (type(a) is int and a == b)
                                                                       for a, b in zip(entry[0], state))
        if self._agree_all_hit(hit) and entry is not None:     # every rank hit (so did this one)
            self._cache.move_to_end(key)
            return entry[1]
        layout = self.plan(make_cu())
        self._cache[key] = (state, layout)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return layout

    def layout_thd(self, packed_seq_params: Any, num_rows: int) -> StepLayout:
        """The layout of a THD micro-batch (planned on first sight, see the module docstring)."""
        cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("CADCoreAttention: THD input needs packed_seq_params.cu_seqlens_q")
        if self.tick is not None:
            return self.tick.layout(self, ("thd", cu), lambda: self._thd_documents(packed_seq_params, num_rows))
        if not self.auto_plan:
            return self._current(num_rows)
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"CADCoreAttention: packed_seq_params.cu_seqlens_q must be a tensor, got "
                             f"{type(cu).__name__}")
        key = ("thd", id(cu))     # the entry holds cu itself, so its id is not reused while cached

        def make_cu():
            host, message = self._thd_documents(packed_seq_params, num_rows)
            # Every rank raises the same error, so none is left waiting in the plan's collectives.
            agree(self.planner.control_group, message, "CADCoreAttention")
            return host

        # The layout is reused while every cu_seqlens field is the same object, unmodified.
        state = []
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            t = getattr(packed_seq_params, name, None)
            state += [t, t._version if isinstance(t, torch.Tensor) else -1]
        return self._cached(key, tuple(state), make_cu)

    @staticmethod
    def _thd_documents(packed_seq_params: Any, num_rows: int) -> tuple:
        """(cu_seqlens_q on the host, what is wrong with the micro-batch's packing or None)."""
        cu = packed_seq_params.cu_seqlens_q
        if not isinstance(cu, torch.Tensor):
            return None, f"packed_seq_params.cu_seqlens_q must be a tensor, got {type(cu).__name__}"
        host = cu.detach().to("cpu", torch.int64)
        for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            other = getattr(packed_seq_params, name, None)
            if other is not None and other is not cu and not torch.equal(
                    torch.as_tensor(other).detach().to("cpu", torch.int64), host):
                return host, (f"packed_seq_params.{name} differs from cu_seqlens_q (CAD runs self-attention "
                              "over unpadded documents: the keys are the queries' rows)")
        if host.dim() != 1 or len(host) < 2 or int(host[-1]) != num_rows:
            return host, f"cu_seqlens_q {host.tolist()[:8]} does not end at q's {num_rows} rows"
        return host, None

    def layout_sbhd(self, seq_len: int, batch: int) -> StepLayout:
        """The layout of an sbhd micro-batch: `batch` documents of `seq_len` rows (b-major)."""
        if self.tick is not None:
            return self.tick.layout(self, ("sbhd", seq_len, batch),
                                    lambda: (torch.arange(batch + 1, dtype=torch.int64) * seq_len, None))
        if not self.auto_plan:
            return self._current(seq_len * batch)
        return self._cached(("sbhd", seq_len, batch), (), lambda: torch.arange(batch + 1, dtype=torch.int64) * seq_len)

    def _current(self, num_rows: int) -> StepLayout:
        """auto_plan=False: the caller's layout (cad_attention checks it against the input, on every rank)."""
        layout = self.planner.current
        if layout is None:
            raise ValueError("CADCoreAttention: no layout planned (auto_plan=False: call cad.plan(cu_seqlens) "
                             "before the forward)")
        return layout


def _check_settings(config: Any, attn_mask_type: Any, attention_type: str, attention_dropout: Optional[float],
                    layer_number: int) -> None:
    m = require_megatron()
    problems = []
    if attention_type != "self":
        problems.append(f"attention_type {attention_type!r} (CAD serves causal self-attention only)")
    p = config.attention_dropout if attention_dropout is None else attention_dropout
    if p:
        problems.append(f"attention dropout {p} (set attention_dropout=0.0)")
    if getattr(config, "context_parallel_size", 1) != 1:
        problems.append(f"context_parallel_size {config.context_parallel_size} (CAD replaces context parallelism)")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type {config.softmax_type!r} (only 'vanilla')")
    if getattr(config, "window_size", None) is not None:
        problems.append(f"window_size {config.window_size} (sliding-window attention)")
    if getattr(config, "multi_latent_attention", False):
        problems.append("multi_latent_attention (q/k and v head dims differ)")
    if getattr(config, "qk_clip", False):
        problems.append("qk_clip (needs the attention logits' maximum)")
    if attn_mask_type not in (m.AttnMaskType.causal, m.AttnMaskType.padding_causal):
        problems.append(f"attn_mask_type {attn_mask_type} (only causal or padding_causal)")
    if problems:
        raise ValueError(f"CADCoreAttention (layer {layer_number}): unsupported setting: " + "; ".join(problems))


def _build_core_attention_class():
    m = require_megatron()

    class CADCoreAttention(m.MegatronModule):
        """Megatron Core's `core_attention` computed by CAD (see the module docstring). Constructed by
        Megatron from a spec with params {"cad": CADContext}; the arguments are DotProductAttention's."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                     cp_comm_type: Optional[str] = None, pg_collection: Any = None, *,
                     cad: Optional[CADContext] = None):
            super().__init__(config=config)
            if not isinstance(cad, CADContext):
                raise ValueError("CADCoreAttention needs cad=CADContext(...): build the layer spec with "
                                 "use_cad(spec, cad) or cad_layer_spec(cad)")
            self.layer_number = max(1, layer_number)
            _check_settings(config, attn_mask_type, attention_type, attention_dropout, self.layer_number)
            self.cad = cad
            self.attn_mask_type = attn_mask_type
            self.attention_type = attention_type
            self.pg_collection = pg_collection
            shape = _attention_shape(config, _tp_size(pg_collection))
            want = cad.planner.model
            if (shape["heads"], shape["kv_heads"], shape["head_dim"]) != (want.num_q_heads, want.num_kv_heads,
                                                                         want.head_dim):
                raise ValueError(f"CADCoreAttention (layer {self.layer_number}): this rank's attention is "
                                 f"{shape['heads']} heads, {shape['kv_heads']} key/value heads, head dim "
                                 f"{shape['head_dim']}; the CADContext was made for {want.num_q_heads}, "
                                 f"{want.num_kv_heads}, {want.head_dim}")
            self.num_attention_heads_per_partition = shape["heads"]
            self.num_query_groups_per_partition = shape["kv_heads"]
            self.head_dim = shape["head_dim"]
            # DotProductAttention's scale: query-key layer scaling divides it by the layer number and
            # its softmax multiplies back, so the product is softmax_scale or 1/sqrt(head dim).
            self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
            self.current_max_attn_logits = None
            self.num_calls = 0

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                    attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
            """THD [T, H, D] (packed_seq_params.qkv_format "thd") -> [T, Hq * D];
            sbhd [S, B, H, D] -> [S, B, Hq * D]. attention_mask is not read: the mask is causal
            inside each document."""
            if attention_bias is not None:
                raise ValueError("CADCoreAttention: attention_bias is not supported")
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            fmt = getattr(packed_seq_params, "qkv_format", None) if packed_seq_params is not None else "sbhd"
            causal = m.AttnMaskType.causal
            self.num_calls += 1
            if fmt == "thd":
                if mask_type not in (causal, m.AttnMaskType.padding_causal):
                    raise ValueError(f"CADCoreAttention: attn_mask_type {mask_type} (only causal / padding_causal)")
                if query.dim() == 4 and query.shape[1] == 1:      # [T, 1, H, D], as some callers keep it
                    query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
                if query.dim() != 3:
                    raise ValueError(f"CADCoreAttention: THD query must be [T, H, D], got {tuple(query.shape)}")
                layout = self.cad.layout_thd(packed_seq_params, query.shape[0])
                out = cad_attention(query.contiguous(), key.contiguous(), value.contiguous(), layout,
                                    scale=self.softmax_scale)
                return out.reshape(out.shape[0], -1)
            if fmt != "sbhd":
                raise ValueError(f"CADCoreAttention: qkv_format {fmt!r} (only 'thd' or 'sbhd')")
            if mask_type != causal:
                raise ValueError(f"CADCoreAttention: sbhd input needs attn_mask_type causal, got {mask_type}")
            if query.dim() != 4:
                raise ValueError(f"CADCoreAttention: sbhd query must be [S, B, H, D], got {tuple(query.shape)}")
            s, b = query.shape[0], query.shape[1]
            layout = self.cad.layout_sbhd(s, b)
            q, k, v = (x.transpose(0, 1).reshape(s * b, x.shape[2], x.shape[3]).contiguous() for x in (query, key, value))
            out = cad_attention(q, k, v, layout, scale=self.softmax_scale)      # [B * S, Hq, D]
            return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    CADCoreAttention.__module__ = __name__
    CADCoreAttention.__qualname__ = "CADCoreAttention"
    return CADCoreAttention


_CLASSES: dict = {}


def __getattr__(name: str):
    if name == "CADCoreAttention":
        if name not in _CLASSES:
            _CLASSES[name] = _build_core_attention_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def core_attention_spec(cad: CADContext) -> Any:
    """A ModuleSpec for a `core_attention` slot: CADCoreAttention with this context."""
    if not isinstance(cad, CADContext):
        raise TypeError(f"cad must be a CADContext, got {type(cad).__name__}")
    return require_megatron().ModuleSpec(module=__getattr__("CADCoreAttention"), params={"cad": cad})


def use_cad(spec: Any, cad: CADContext) -> Any:
    """A copy of a Megatron spec (a TransformerLayer ModuleSpec, TransformerBlockSubmodules, or any
    spec tree) with every `core_attention` replaced by CADCoreAttention on `cad`. The spec given is
    not changed. Raises ValueError when the spec has no core_attention."""
    replacement = core_attention_spec(cad)
    found = [0]

    def walk(node: Any) -> Any:
        if isinstance(node, (list, tuple)):
            return type(node)(walk(x) for x in node)
        if not dataclasses.is_dataclass(node) or isinstance(node, type):
            return node
        changes = {}
        for f in dataclasses.fields(node):
            if f.name == "params" or not f.init:
                continue
            value = getattr(node, f.name)
            if f.name == "core_attention":
                changes[f.name] = replacement
                found[0] += 1
            else:
                new = walk(value)
                if new is not value:
                    changes[f.name] = new
        return dataclasses.replace(node, **changes) if changes else node

    out = walk(spec)
    if not found[0]:
        raise ValueError("use_cad: the spec has no core_attention submodule")
    return out


def cad_layer_spec(cad: CADContext, **local_spec_kwargs: Any) -> Any:
    """Megatron's local GPT layer spec (get_gpt_layer_local_spec(**local_spec_kwargs)) with CAD core
    attention. For Transformer Engine layers: use_cad(get_gpt_layer_with_transformer_engine_spec(), cad)."""
    require_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return use_cad(get_gpt_layer_local_spec(**local_spec_kwargs), cad)
