"""distca.torch: core attention disaggregation (CAD) as a PyTorch library.

    import torch.distributed as dist
    from distca.torch import StepPlanner, cad_attention

    planner = StepPlanner(model={"heads": 32, "kv_heads": 8, "head_dim": 128})   # over the world group
    layout = planner.plan(cu_seqlens)        # once per step, collective: this rank's packed documents
    for layer in layers:                     # every layer reuses the step's layout
        q, k, v = layer.qkv(x)               # [T, Hq, D], [T, Hkv, D], RoPE at layout.positions
        o = cad_attention(q, k, v, layout)   # [T, Hq, D]; differentiable

gloo on CPU, NCCL on CUDA; server kernels `reference`, `sdpa`, `varlen`, `flash_attn`, `flex`, `distca`
(distca's own CPU and CUDA kernels, also as the custom operators torch.ops.distca.attention_fwd/_bwd
of distca.torch.kernels.ops) (`auto` picks).
See docs/torch.md.

    cad/           StepPlanner, StepLayout, cad_attention: the plan, the layout and the exchanges
    kernels/       the server kernels behind one interface, and `auto`'s choice among them
    kernel_table   the measured table `auto` reads on CUDA (python -m distca.torch.kernel_table makes one)
    train/         the trainer, python -m distca.torch.train
    adapters/      CAD in Megatron Core's and TorchTitan's attention slot, and in Hugging Face
                   transformers' attention interface
    spawn          run_ranks: a function on N local processes joined by a gloo group
"""
try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover (the package's own install brings torch)
    raise ImportError("distca.torch needs PyTorch >= 2.10 (scripts/install-python.sh installs it into .venv)") from e

from .cad.agreement import InputError
from .cad.attention import CADAttention, cad_attention
from .cad.buffers import ExchangeBuffers
from .cad.layout import ModelShape, StepLayout, exchange_bytes, rank_layout
from .cad.nanobatch import NanoSplit, split_plan, split_tasks
from .cad.planner import PlannedStep, StepPlanner
from .cad.serve import cad_serve
from .kernels.backends import backend_names, get_backend
from .kernels.server import BackendUnavailable, ServerKernel
from .spawn import run_ranks

__all__ = [
    "StepPlanner", "StepLayout", "PlannedStep", "ModelShape", "InputError", "rank_layout", "split_tasks", "split_plan",
    "NanoSplit", "exchange_bytes",
    "cad_attention", "cad_serve", "CADAttention", "ExchangeBuffers",
    "BackendUnavailable", "ServerKernel", "backend_names", "get_backend", "run_ranks",
]
