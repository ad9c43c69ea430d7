"""CAD in Hugging Face transformers' attention interface (transformers 5.x, `transformers` on PyPI).

    from distca.torch.adapters.transformers import apply_cad, cad_state

    dist.init_process_group("gloo")                        # or nccl; torchrun's environment
    model = AutoModelForCausalLM.from_config(config)        # Llama, Qwen3, Qwen2, Mistral, ... (causal)
    model = apply_cad(model)                                 # or apply_cad(model, policy="minbytes", ...)
    model = DDP(model)                                       # or HF Trainer / accelerate, FSDP2
    out = model(input_ids=ids, position_ids=pos, labels=labels)  # packed rows: documents restart at 0
    # or DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s cu_seq_lens_q/k, max_length_q/k

apply_cad registers `distca` in transformers' AttentionInterface (the attention function) and
AttentionMaskInterface (a mask function), sets the model's attention implementation to it, and
puts a forward pre-hook on the base model (LlamaModel inside LlamaForCausalLM, ...). Each forward
of the model in training mode with gradients on is a CAD forward: the hook reads this rank's
documents (from cu_seq_lens_q, or else where position_ids restart at 0, TRL's padding-free form,
or else one per batch row), plans them once with distca.torch.StepPlanner over a process group of
the adapter's own (never the one DDP or FSDP uses), and every layer's attention, and gradient
checkpointing's recomputation of it, runs cad_attention with that forward's layout. The mask
function builds no mask for CAD forwards (CAD masks by document itself: no [S, S] mask is made).
RoPE stays HF's (the model applies it at position_ids before the attention function).

Other forwards (evaluation, generate(), anything under torch.no_grad() or in eval mode) make no
collective: their attention runs on this rank, per document when the rows are packed and no past
key/value exists (right whatever use_cache says: HF's own sdpa and eager attend across documents
when a cache exists), else by HF's sdpa with the mask its sdpa mask function built (decoding with
a KV cache, padded batches). Each of those is said once per process (a warning).

Refused in one line on every rank (InputError, agreed before any exchange), for a CAD forward: a
2-D attention mask with zeros (padding; pack the documents instead) or a 4-D mask, a cache that
already holds tokens, attention dropout > 0, a document longer than the sliding window of a
sliding-window model (documents within the window are exactly full causal attention), rows that
disagree with cu_seq_lens (its end is not B * L, a document crosses a row, cu_seq_lens_k differs,
position_ids restart elsewhere). Refused by apply_cad (ValueError): a model whose attention does
not go through the interface (named), non-causal attention modules, logit softcapping,
sliding-window layers of models that mix them (layer_types), one planner for layers of different
shapes. A forward whose attention calls were not the model's attention modules' count raises
(same on every rank: the model is the same).

Every rank must run the same number of CAD forwards: a rank that has run its last one calls
cad_state(model).finish() (or exits: an atexit handler calls it while torch.distributed is up),
and a rank still in a forward then gets, as the finished ranks do, one InputError naming each
rank's count, instead of waiting. finish() lets go of the process groups, so a torchrun job ends
with status 0. save_pretrained writes the model's config without the attention implementation
(transformers does not save it): it loads without distca.

The framework is imported only here, when used; `import distca.torch` never needs it.
"""
from __future__ import annotations

import atexit
import inspect
import time
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..cad.agreement import InputError
from ..cad.attention import cad_attention
from ..cad.layout import StepLayout
from ..cad.planner import StepPlanner
from .documents import document_cu_seqlens

__all__ = ["ATTENTION_NAME", "HFCAD", "apply_cad", "attention_forward", "cad_state", "mask_function"]

ATTENTION_NAME = "distca"   # the name in AttentionInterface and AttentionMaskInterface

_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()      # model -> HFCAD
_BY_MODULE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # attention module -> HFCAD
_BY_CONFIG: dict = {}                                                      # id(config) -> weakref(HFCAD)
_SAID: set = set()                                                         # fallbacks said once
EXIT_GRACE_SECONDS = 2.0   # a rank whose counts disagree at exit waits this long before exiting


def _transformers():
    """The real transformers package (absolute import: not this module, which shares its name)."""
    try:
        import transformers
        from transformers import masking_utils, modeling_utils
        from transformers.integrations import sdpa_attention
    except ImportError as e:
        raise ImportError("distca.torch.adapters.transformers needs Hugging Face transformers 5.x: "
                          "scripts/install-python.sh installs it (pip install 'transformers>=5.24,<6')") from e
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(f"distca.torch.adapters.transformers needs transformers 5.x, found {transformers.__version__}")
    return transformers, masking_utils, modeling_utils, sdpa_attention


def _say_once(key: str, text: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(f"distca.torch.adapters.transformers: {text}", stacklevel=3)


def _config_window(config: Any) -> Optional[int]:
    """The sliding window every layer of the model uses (Mistral's config.sliding_window), or
    None for full causal attention (Qwen's sliding_window is None unless use_sliding_window)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types:
        return window if any(t == "sliding_attention" for t in types) else None
    return window


class HFCAD:
    """The CAD state of one model (cad_state(model) returns it): its planner and its forwards.

    forwards / local_forwards: CAD forwards planned / forwards computed on this rank alone.
    plans: the planner's plans (one per CAD forward). layout: the last CAD forward's StepLayout.
    calls: attention calls of the last forward (recomputation by gradient checkpointing not
    counted). finish(): see the module docstring; remove(): undoes apply_cad."""

    def __init__(self, model: nn.Module, base: nn.Module, modules: list, shape: tuple, group: Any,
                 options: dict, previous: Optional[str]):
        self.model_name = type(model).__name__
        self.shape = shape                         # (heads, kv_heads, head_dim)
        self.options = options
        self.window = _config_window(model.config)
        self.dropout = float(getattr(model.config, "attention_dropout", 0.0) or 0.0)
        self.planner: Optional[StepPlanner] = None
        self.group = group
        self._own_group = group is None
        self.forwards = self.local_forwards = self.plans = 0
        self.layout: Optional[StepLayout] = None
        self.mode: Optional[str] = None            # "cad" or "local": the last forward's
        self.rows: tuple = (0, 0)                  # (B, L) of the last forward
        self.cu: Optional[list] = None             # its documents over the B * L packed rows
        self.calls = 0
        self._recompute = False
        self._modules = modules
        self._base = base
        self._model_ref = weakref.ref(model)
        self._previous = previous
        self._signature = inspect.signature(base.forward)
        self._hooks = [base.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       base.register_forward_hook(self._post_forward, with_kwargs=True)]
        self.finished = False

    # --- the planner ---------------------------------------------------------------------------
    def _ensure_planner(self, device: torch.device) -> StepPlanner:
        """The planner, made on the first CAD forward where torch.distributed was not up at
        apply_cad (collective: new_group over the default group, every rank in the same order)."""
        if self.planner is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("distca.torch.adapters.transformers: a CAD forward needs torch.distributed "
                                   "initialised (dist.init_process_group; torchrun, HF Trainer or accelerate do it)")
            self.planner = _make_planner(self, device)
        return self.planner

    def finish(self) -> None:
        """Collective: this rank has run its last CAD forward (see the module docstring), then the
        planner and the adapter's process group are let go. Harmless when already finished."""
        if self.finished:
            return
        self.finished = True
        planner, self.planner, self.layout = self.planner, None, None
        try:
            if planner is not None and not planner.closed:
                planner.finish()
        except InputError as e:
            raise InputError(f"distca CAD finish after {self.forwards} forwards: {e} (one plan per CAD forward: "
                             f"every rank must run the same number of training forwards)") from None
        finally:
            self._release_group()

    def _release_group(self) -> None:
        """Destroys the process group the adapter made (not one it was given), joining its threads
        while the interpreter is whole: one left to the interpreter's teardown can abort the process
        ("terminate called without an active exception") after the script has finished."""
        group, self.group = self.group, None
        if group is not None and self._own_group and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 (already destroyed with the default group)
                pass

    def remove(self) -> None:
        """Undoes apply_cad: the hooks off, the model's previous attention implementation back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        model = self._model_ref()
        if model is not None:
            _BY_MODEL.pop(model, None)
            _BY_CONFIG.pop(id(model.config), None)
            if self._previous is not None:
                model.set_attn_implementation(self._previous)
        for module in self._modules:
            _BY_MODULE.pop(module, None)
        if self.planner is not None and not self.planner.closed:
            self.planner.close()
        self.planner = None
        self._release_group()

    # --- per forward -----------------------------------------------------------------------------
    def _documents(self, args: dict, b: int, s: int) -> tuple:
        """This rank's documents over the B * L packed rows -> (cu_seqlens, what is wrong or None)."""
        extra = args.get("kwargs") or {}
        def arg(name: str) -> Any:
            return args.get(name, extra.get(name))
        cu_q, cu_k, positions = arg("cu_seq_lens_q"), arg("cu_seq_lens_k"), arg("position_ids")
        if positions is not None:
            if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] != s \
                    or positions.shape[0] not in (1, b):
                return None, (f"position_ids must be [B, L] = [{b}, {s}] (or [1, L]), got "
                              f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
            positions = positions.expand(b, s)
        from_positions = document_cu_seqlens(positions, None if positions is not None else (b, s))
        if cu_q is None:
            if cu_k is not None:
                return None, "cu_seq_lens_k was given without cu_seq_lens_q"
            return from_positions, None
        if cu_k is not None and (not isinstance(cu_k, torch.Tensor) or not torch.equal(cu_k.cpu(), cu_q.cpu())):
            return None, "cu_seq_lens_k differs from cu_seq_lens_q: CAD computes causal self-attention (the same rows)"
        if not isinstance(cu_q, torch.Tensor) or cu_q.dim() != 1 or cu_q.is_floating_point() or cu_q.numel() < 2:
            return None, f"cu_seq_lens_q must be a 1-d integer tensor [documents + 1], got {cu_q!r:.80}"
        cu = [int(x) for x in cu_q.detach().cpu().tolist()]
        if cu[0] != 0 or cu[-1] != b * s or any(y <= x for x, y in zip(cu, cu[1:])):
            return None, (f"the batch rows disagree with cu_seq_lens_q: it must rise strictly from 0 to B * L = "
                          f"{b * s} ([B, L] = [{b}, {s}]), got {cu[:6]}{' ...' if len(cu) > 6 else ''} ending at {cu[-1]}")
        crossing = [r * s for r in range(1, b) if r * s not in set(cu)]
        if crossing:
            return None, (f"the batch rows disagree with cu_seq_lens_q: a document crosses from one row to the next "
                          f"at packed row {crossing[0]} (each row of [B, L] = [{b}, {s}] must begin a document)")
        # position_ids that restart inside a row must restart where cu_seq_lens_q says
        if positions is not None and len(from_positions) > b + 1 and from_positions != cu:
            wrong = next((x for x in from_positions if x not in set(cu)), None)
            at = f"position_ids restart at packed row {wrong}" if wrong is not None else "position_ids restart less often"
            return None, f"the batch rows disagree with cu_seq_lens_q: {at}, not where cu_seq_lens_q begins its documents"
        return cu, None

    def _check(self, args: dict, b: int, s: int, cu: list) -> Optional[str]:
        """A CAD forward's refusals (None: fine)."""
        mask = args.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                return ("CAD forwards take no custom attention mask (a 4-D or block mask): CAD masks by document; "
                        "pass position_ids or cu_seq_lens_q")
            if not bool(mask.bool().all()):
                return ("the attention mask has zeros (padding): CAD attends whole documents packed end to end; pack "
                        "the rows instead (DataCollatorWithFlattening, TRL's padding_free) and pass no mask")
        cache = args.get("cache", args.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
        if past:
            return f"the cache already holds {past} tokens: CAD forwards are whole training forwards, without past keys"
        if self.dropout > 0:
            return (f"attention dropout {self.dropout} in training: CAD's attention has no dropout (set the config's "
                    f"attention_dropout to 0)")
        if self.window is not None:
            longest = max(y - x for x, y in zip(cu, cu[1:]))
            if longest > self.window:
                return (f"a document of {longest} tokens is longer than the model's sliding window ({self.window}): "
                        f"CAD computes full causal attention within documents (equal to the window's for documents "
                        f"up to {self.window} tokens)")
        return None

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        x = bound.get("input_ids")
        if x is None:
            x = bound.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"distca.torch.adapters.transformers: {self.model_name} got neither input_ids [B, L] nor "
                             f"inputs_embeds [B, L, hidden]")
        b, s = int(x.shape[0]), int(x.shape[1])
        self.rows, self.calls = (b, s), 0
        cad = module.training and torch.is_grad_enabled()
        if self.finished:
            raise RuntimeError("distca.torch.adapters.transformers: finish() was called: this model runs no more CAD "
                               "forwards (apply_cad to a new model)")
        cu, problem = self._documents(bound, b, s)
        if not cad:
            self.mode, self.cu = "local", cu
            self.local_forwards += 1
            return
        if problem is None:
            problem = self._check(bound, b, s, cu)
        planner = self._ensure_planner(x.device)
        number = self.forwards + 1
        try:
            layout = planner.plan(cu, input_error=problem)
        except InputError as e:
            if "finished planning" in str(e):   # the others have stopped: nothing left to agree on at exit
                self.finished = True
                planner.close()
                self.planner = None
            raise InputError(f"distca CAD forward {number}: {e}") from None   # the same line on every rank
        self.mode, self.cu, self.layout = "cad", cu, layout
        self.forwards, self.plans = number, self.plans + 1

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        want = len(self._modules)
        if self.calls != want:
            raise RuntimeError(
                f"distca.torch.adapters.transformers: {self.model_name}'s forward made {self.calls} attention calls "
                f"through transformers' attention interface, its {want} attention modules should make {want}: "
                f"a layer whose attention does not go through the interface is not supported")


def _make_planner(cad: HFCAD, device: torch.device) -> StepPlanner:
    group = cad.group
    if group is None:   # a group of the adapter's own, never DDP's or FSDP's
        group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
        cad.group = group
    heads, kv_heads, head_dim = cad.shape
    options = dict(cad.options)
    options.setdefault("device", device)
    try:
        return StepPlanner(group, model={"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}, **options)
    except TypeError as e:
        raise TypeError(f"apply_cad: {e} (the planner's options are StepPlanner's keywords)") from None


def cad_state(model: nn.Module) -> HFCAD:
    """The HFCAD of a model apply_cad was applied to (DDP, FSDP or accelerate's wrapper unwrapped)."""
    inner = getattr(model, "module", model)
    cad = _BY_MODEL.get(inner) or _BY_MODEL.get(model)
    if cad is None:
        raise ValueError(f"cad_state: apply_cad was not applied to this {type(model).__name__}")
    return cad


def _local_attention(cad: HFCAD, module: nn.Module, query, key, value, scaling: Optional[float]):
    """This rank's attention, causal within each document of the forward: [B, L, Hq, D]."""
    b, hq, s, d = query.shape
    out = query.new_empty(b, s, hq, d)
    cu = cad.cu if cad.cu is not None and cad.rows == (b, s) else [r * s for r in range(b + 1)]
    for x, y in zip(cu, cu[1:]):
        row, begin, end = x // s, x % s, x % s + (y - x)
        o = F.scaled_dot_product_attention(query[row:row + 1, :, begin:end], key[row:row + 1, :, begin:end],
                                           value[row:row + 1, :, begin:end], is_causal=True, scale=scaling,
                                           enable_gqa=key.shape[1] != hq)
        out[row, begin:end] = o[0].transpose(0, 1)
    return out


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward in this thread (where gradient
    checkpointing recomputes a layer's forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs: Any) -> tuple:
    """The function registered as `distca` in transformers' AttentionInterface: query [B, Hq, L, D],
    key/value [B, Hkv, L', D] -> ([B, L, Hq, D], None). CAD forwards run cad_attention with the
    forward's layout; other forwards run on this rank (see the module docstring)."""
    cad = _BY_MODULE.get(module)
    if cad is None:
        raise RuntimeError(f"distca attention: this {type(module).__name__} belongs to no model apply_cad was applied "
                           f"to: a copy of one, or a model sharing its config object (apply_cad sets the config's attention "
                           f"implementation): give each model a config of its own, or apply_cad to it")
    if kwargs.get("softcap") is not None:
        raise ValueError("distca attention: logit softcapping is not supported (CAD computes plain softmax attention)")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("distca attention: only causal attention is supported")
    window = kwargs.get("sliding_window")
    in_backward = _in_backward()   # gradient checkpointing's recomputation: not a call of the forward
    if not in_backward:
        cad.calls += 1
    if cad.mode != "cad":
        if key.shape[2] == query.shape[2] and attention_mask is None and window is None:
            _say_once("local", "a forward outside training (eval mode or no gradients): its attention runs on this "
                               "rank, per document, without CAD")
            return _local_attention(cad, module, query, key, value, scaling), None
        _say_once("sdpa", "a forward with past keys or a padding mask (generation, padded evaluation): HF's sdpa "
                          "attention computes it on this rank, without CAD")
        _, _, _, sdpa_attention = _transformers()
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                     scaling=scaling, **kwargs)
    if dropout:
        raise ValueError(f"distca attention: dropout {dropout} in a CAD forward (set the config's attention_dropout to 0)")
    if window is not None and window != cad.window:
        raise ValueError(f"distca attention: the layer uses a sliding window of {window} tokens that the model's "
                         f"config does not say; CAD cannot check its documents against it")
    b, hq, s, d = query.shape
    layout = cad.layout
    if (b, s) != cad.rows or key.shape[2] != s or layout is None:
        raise ValueError(f"distca attention: q is [B, Hq, L, D] = {list(query.shape)}, k {list(key.shape)}: the "
                         f"forward was planned for [B, L] = {list(cad.rows)} rows")
    q = query.transpose(1, 2).reshape(b * s, hq, d).contiguous()
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d).contiguous()
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d).contiguous()
    o = cad_attention(q, k, v, layout, scale=scaling)
    return o.view(b, s, hq, d), None


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """The function registered as `distca` in transformers' AttentionMaskInterface: no mask for a
    CAD forward (CAD masks by document), HF's sdpa mask for other forwards."""
    config = kwargs.get("config")
    ref = _BY_CONFIG.get(id(config)) if config is not None else None
    cad = ref() if ref is not None else None
    if cad is not None and cad.mode == "cad":
        return None
    _, masking_utils, _, _ = _transformers()
    return masking_utils.sdpa_mask(*args, **kwargs)


def _attention_modules(model: nn.Module) -> list:
    """The modules that call the attention interface: HF's attention modules carry layer_idx and
    is_causal (LlamaAttention, Qwen3Attention, ...)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "is_causal") and hasattr(m, "layer_idx") and hasattr(m, "config")]


def _finish_at_exit() -> None:
    """At exit: every model's finish() while torch.distributed is up (see the module docstring);
    a rank whose counts disagree with the others' prints the one line and exits with status 1."""
    for cad in list(_BY_MODEL.values()):
        if cad.finished or cad.planner is None:
            cad._release_group()
            continue
        if not (dist.is_available() and dist.is_initialized()):
            cad.planner.close()
            continue
        try:
            cad.finish()
        except InputError as e:
            import os
            import sys
            sys.stderr.write(f"rank {dist.get_rank()}: {e}\n")   # one write: ranks share the stream
            sys.stderr.flush()
            # The ranks still in a forward got the same InputError at the same moment; torchrun stops
            # them as soon as this one exits, so it waits a little for them to report it too.
            time.sleep(EXIT_GRACE_SECONDS)
            os._exit(1)
        except Exception:   # noqa: BLE001 (a peer already gone: nothing left to agree with)
            pass


atexit.register(_finish_at_exit)


def apply_cad(model: nn.Module, group: Any = None, **planner_options: Any) -> nn.Module:
    """CAD attention for a Hugging Face causal LM (see the module docstring); returns the model.

    group: the process group whose ranks exchange attention (default: a new group of every rank,
      gloo on CPU, NCCL on CUDA, made when torch.distributed is up: now, or at the first CAD
      forward); never pass the group DDP or FSDP uses. planner_options: StepPlanner's keywords
      (policy, tolerance, pingpong, backward, backend, ...); the attention shape comes from the
      model. cad_state(model) returns the adapter's state.
    """
    _, _, modeling_utils, _ = _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if not isinstance(model, modeling_utils.PreTrainedModel):
        raise TypeError(f"apply_cad: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if model in _BY_MODEL:
        raise ValueError("apply_cad: CAD is already applied to this model (cad_state(model).remove() undoes it)")
    config = model.config
    name = type(model).__name__
    if not model._can_set_attn_implementation():
        raise ValueError(f"apply_cad: {name}'s attention does not go through transformers' AttentionInterface "
                         f"(it cannot set its attention implementation); CAD needs a model that does")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"apply_cad: {name} is an encoder-decoder; CAD supports decoder-only causal LMs")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"apply_cad: {name} caps its attention logits (attn_logit_softcapping = "
                         f"{config.attn_logit_softcapping}); CAD computes plain softmax attention")
    types = getattr(config, "layer_types", None) or []
    if any(t == "sliding_attention" for t in types) and any(t != "sliding_attention" for t in types):
        raise ValueError(f"apply_cad: {name} mixes sliding-window and full attention layers ({sorted(set(types))}); "
                         f"CAD supports full causal attention (or one window for every layer, within its documents)")
    found = _attention_modules(model)
    if not found:
        raise ValueError(f"apply_cad: {name} has no attention module that calls transformers' attention interface")
    shapes = set()
    for mod_name, m in found:
        if not m.is_causal:
            raise ValueError(f"apply_cad: {mod_name} ({type(m).__name__}) is not causal; CAD computes causal attention")
        q_heads = getattr(m.config, "num_attention_heads", None)
        kv_heads = getattr(m.config, "num_key_value_heads", None) or q_heads
        head_dim = getattr(m, "head_dim", None) or getattr(m.config, "head_dim", None)
        if not (q_heads and kv_heads and head_dim):
            raise ValueError(f"apply_cad: {mod_name}: cannot read the attention shape (num_attention_heads, "
                             f"num_key_value_heads, head_dim) from its config")
        shapes.add((int(q_heads), int(kv_heads), int(head_dim)))
    if len(shapes) != 1:
        raise ValueError(f"apply_cad: the layers' attention shapes differ ({sorted(shapes)}); one planner serves one shape")
    planner_options = dict(planner_options)
    if group is not None and "group" in planner_options:
        raise ValueError("apply_cad: group given twice")
    base = model.base_model
    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, mask_function)
    previous = config._attn_implementation
    cad = HFCAD(model, base, [m for _, m in found], shapes.pop(), group, planner_options, previous)
    _BY_MODEL[model] = cad
    _BY_CONFIG[id(config)] = weakref.ref(cad)
    for _, m in found:
        _BY_MODULE[m] = cad
    model.set_attn_implementation(ATTENTION_NAME)
    if dist.is_available() and dist.is_initialized():
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        cad._ensure_planner(device)   # bad planner options fail here, on every rank
    return model
