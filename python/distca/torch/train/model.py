"""A small Llama-style decoder for the distca.torch trainer (TorchTitan style: plain modules).

    model = Transformer(PRESETS["demo"])
    layout = planner.plan(cu_seqlens)                                  # the step's CAD layout
    logits = model(tokens, layout.positions, lambda q, k, v: cad_attention(q, k, v, layout))
    loss_sum = packed_cross_entropy(logits, targets)                   # targets -1: no target

Byte-level vocabulary (256). Per layer: RMSNorm -> Wq, Wk, Wv -> RoPE at each row's position in
its document -> core attention -> Wo + residual -> RMSNorm -> SwiGLU MLP + residual; then the
final RMSNorm and the LM head (untied unless tie_embeddings). GQA: Hq query heads share Hkv
key/value heads. Rows are packed documents, "THD": tokens [T], q [T, Hq, D], k/v [T, Hkv, D].

Core attention is a callable the caller passes in, `core_attention(q, k, v) -> o [T, Hq, D]`
(q, k, v contiguous, after RoPE): causal attention inside each document, nothing across
documents. The trainer passes distca.torch.cad_attention with the step's layout, which serves
every layer forward and backward; the colocated backend is the same call with a layout planned
by policy "none". The module holds no attention state, so one model runs under either backend.

The layers follow the C++ model (src/model/model.cc): RoPE rotates each head's halves
(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) at angle pos * base^(-2j / D); weights are drawn
from N(0, init_std) from a fixed seed, norm gains are 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..trace import span

CoreAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256          # byte-level tokens
    dim: int = 64                  # d_model
    n_layers: int = 2
    n_heads: int = 2               # Hq
    n_kv_heads: int = 1            # Hkv; Hq % Hkv == 0
    head_dim: int = 32             # D, even (RoPE rotates halves)
    ffn_dim: int = 128             # SwiGLU hidden width
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    init_seed: int = 1
    tie_embeddings: bool = False   # the LM head reuses the embedding matrix

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model: {name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model: query heads ({self.n_heads}) must be a multiple of key/value heads "
                             f"({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model: head dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_base > 1:
            raise ValueError(f"model: rope base must be > 1, got {self.rope_base}")
        if not 0 < self.norm_eps <= 1 or not 0 < self.init_std <= 1:
            raise ValueError("model: norm eps and init std must be in (0, 1]")

    def num_parameters(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer = 2 * self.dim + self.dim * (q + 2 * kv) + q * self.dim + 3 * self.dim * self.ffn_dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + head + self.n_layers * layer + self.dim

    def to_dict(self) -> dict:
        return asdict(self)


# The C++ trainer's presets (src/model/config.cc): tiny is ModelConfig's defaults.
PRESETS = {
    "tiny": ModelArgs(),
    "demo": ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=64, ffn_dim=512),
}
# Per preset: tokens per rank per step and the default workload (as `distca train`).
PRESET_CONTEXT = {"tiny": 256, "demo": 6144}
PRESET_WORKLOAD = {"tiny": "skewed", "demo": "skewed"}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise ValueError(f"no preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype) -> tuple:
    """(cos, sin), each [T, D/2], for rows at `positions` (int64 [T], position in the document)."""
    half = head_dim // 2
    inv_freq = base ** (-2.0 * torch.arange(half, dtype=torch.float64, device=positions.device) / head_dim)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated per row: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                core_attention: CoreAttention) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)          # [T, Hq, D]
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)       # [T, Hkv, D]
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)       # [T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = core_attention(q.contiguous(), k.contiguous(), v.contiguous())   # [T, Hq, D]
        return self.wo(o.reshape(t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)   # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)   # up
        self.w2 = nn.Linear(hidden, dim, bias=False)   # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x, cos, sin, core_attention: CoreAttention):
        # The block's linear work as spans (distca.torch.trace; record_function ranges for a
        # user's profiler): its attention projections with RoPE and core attention inside, its MLP.
        with span("layer: attention projections"):
            x = x + self.attention(self.attention_norm(x), cos, sin, core_attention)
        with span("layer: feed-forward"):
            return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """tokens [T] (this rank's packed documents), positions [T] -> logits [T, vocab]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every matrix from N(0, init_std) drawn from init_seed (the same on every rank and for
        every backend), norm gains 1."""
        gen = torch.Generator().manual_seed(self.args.init_seed)
        seen = set()
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * self.args.init_std)
            else:
                p.fill_(1.0)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, core_attention: CoreAttention) -> torch.Tensor:
        h = self.tok_embeddings(tokens)                                          # [T, dim]
        cos, sin = rope_tables(positions, self.args.head_dim, self.args.rope_base, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, core_attention)
        return self.output(self.norm(h))                                         # [T, vocab]


def document_positions(cu_seqlens: Any) -> torch.Tensor:
    """Each row's position in its document (int64 [T]) for documents end to end at cu_seqlens."""
    bounds = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    parts = [torch.arange(b - a, dtype=torch.int64) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def local_attention(cu_seqlens: Any) -> tuple:
    """A TransformerStage's attention source without CAD: (positions, document_attention) of its
    micro-batch's documents (what PyTorch's own pipeline schedules run)."""
    return document_positions(cu_seqlens), document_attention(torch.as_tensor(cu_seqlens, dtype=torch.int64))


AttentionSource = Callable[[Any], tuple]   # cu_seqlens -> (positions [T] int64, core_attention)


class TransformerStage(nn.Module):
    """Pipeline stage `stage` of `stages` of a Transformer: its layers [stage L/P, (stage+1) L/P)
    (keys their indices in the whole model), the embedding on the first stage, the final norm and
    the LM head on the last. forward(x, cu_seqlens): x the tokens [T] (first stage) or the hidden
    rows [T, dim]; returns the hidden rows, or the logits on the last stage.

    source(cu_seqlens) -> (positions, core_attention) gives the rows' positions and the core
    attention of the micro-batch (default local_attention; under ScheduleCADLockstep its
    `attention` method, which reads the tick's layout). The weights are the whole model's
    (Transformer(args)), sliced: a stage equals the same layers of the one-process model."""

    def __init__(self, args: ModelArgs, stage: int, stages: int, source: Optional[AttentionSource] = None):
        super().__init__()
        args.validate()
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or args.n_layers % stages:
            raise ValueError(f"pipeline: {args.n_layers} layers do not split into {stages!r} stages of equal layers "
                             f"(every stage serves as many attention exchanges as the busiest)")
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
            raise ValueError(f"pipeline: stage must be in [0, {stages}), got {stage!r}")
        if args.tie_embeddings and stages > 1:
            raise ValueError("pipeline: tie_embeddings needs the embedding and the LM head on one stage (stages 1)")
        whole = Transformer(args)
        self.args, self.stage, self.stages = args, stage, stages
        self.source = source or local_attention
        per = args.n_layers // stages
        self.layers = nn.ModuleDict({str(i): whole.layers[i] for i in range(stage * per, (stage + 1) * per)})
        self.tok_embeddings = whole.tok_embeddings if stage == 0 else None
        self.norm = whole.norm if stage == stages - 1 else None
        self.output = whole.output if stage == stages - 1 else None

    def forward(self, x: torch.Tensor, cu_seqlens: Any = None) -> torch.Tensor:
        positions, core_attention = self.source(cu_seqlens)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = rope_tables(positions, self.args.head_dim, self.args.rope_base, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, core_attention)
        if self.output is None or self.norm is None:
            return h
        return self.output(self.norm(h))


def packed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over rows with a target (targets -1: a document's last token). The
    caller divides by the number of targets over all ranks."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction="sum")


def document_attention(cu_seqlens: torch.Tensor, scale: Optional[float] = None) -> CoreAttention:
    """A single-process core attention over whole documents end to end (cu_seqlens, int64): PyTorch's
    SDPA per document. The reference the distributed backends are checked against."""
    bounds = [int(x) for x in cu_seqlens.tolist()]

    def attend(q, k, v):
        group = q.shape[1] // k.shape[1]
        out = []
        for a, b in zip(bounds, bounds[1:]):
            qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))               # [H, L, D]
            kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
            out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(out, dim=0)

    return attend
