"""Server kernels: attention over one server's CA tasks, behind one small interface.

A server holds, per nano-batch, its tasks' rows in the varlen layout (docs/design.md §2 letters):
    q  [Nq, Hq, D]   every task's query rows, causal tasks first
    k  [Nk, Hkv, D]  every task's own key rows (a task's keys are contiguous), v likewise
and `ServerTasks` says where each task's rows are. A kernel computes

    forward(q, k, v, tasks, scale)                 -> o [Nq, Hq, D] (q's dtype), lse [Nq, Hq] fp32
    backward(do, q, k, v, o, lse, tasks, scale)    -> dq [Nq, Hq, D], dk, dv [Nk, Hkv, D] (fp32)

Causal tasks are bottom-right aligned (query i of a task with Lq queries and Lk keys sees keys
[0, Lk - Lq + i]); non-causal tasks see all their keys. GQA: query head h reads key/value head
h // (Hq / Hkv).

The backward takes o and lse as arguments, not the kernel's own: for a row whose keys were split
over several tasks, the caller passes the *merged* O and LSE, and the softmax gradient of each
part is then exact (P = exp(S - LSE_merged), dS = P (dP - rowsum(dO O_merged))), the pattern of
ring attention. So every backend here is exact on key-split rows, including kernels whose own
autograd would drop the LSE gradient.

Backends: `reference` (torch ops per task in fp32: the specification, any device and dtype),
`sdpa` (PyTorch's fused scaled-dot-product kernels with their LSE, tasks grouped by shape; CPU
and CUDA), `varlen` (PyTorch's FlashAttention-2 varlen kernel, one call per causal/non-causal
group; CUDA), `flash_attn` (the flash-attn package, when importable; CUDA), `flex`
(FlexAttention over the whole task list with a task/position mask, compiled; CUDA), `distca`
(distca's own kernels, src/kernels, through the custom operators distca::attention_fwd/_bwd of
distca.torch.kernels.ops on the tensors' addresses: the whole task list in one call, forward and backward;
on CPU and CUDA, the current stream), `cudnn` (cuDNN's fused attention on the same task list
through the same operators; CUDA, builds that found cuDNN), `hopper` (distca's sm_90a kernels;
CUDA devices of compute capability 9.0; `auto` picks it only where the device's measured kernel
table names it, after its bench checks passed). The dtypes and head dims these three take, and
whether this build has them, are the C++ kernel registry's (distca.torch.kernels.ops.REGISTRY).
`auto` picks the best that runs on the device:
on CUDA, per task list by the device's measured kernel table (distca.torch.kernel_table: the
fastest kernel per kind of list, `long` or `shards`) where one exists, else as an H100 measured
them: varlen, then distca, then sdpa; on CPU, distca where its avx512 or avx2 build runs, else
sdpa: as measured per build. A StepPlanner's layouts say which (`StepLayout.backend_note`). A
named backend that cannot run raises BackendUnavailable with the reason.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from . import ops
# The interface and what the kernels share live in server, the kernels in pytorch and native; this
# module names the kernels and picks `auto`.
from .native import CudnnKernel, DistcaKernel, HopperKernel
from .pytorch import FlashAttnKernel, FlexKernel, ReferenceKernel, SdpaKernel, VarlenKernel
from .server import BackendUnavailable, ServerKernel, ServerTasks


_BACKENDS: dict[str, Callable[[], ServerKernel]] = {
    "reference": ReferenceKernel,
    "sdpa": SdpaKernel,
    "varlen": VarlenKernel,
    "flash_attn": FlashAttnKernel,
    "flex": FlexKernel,
    "distca": DistcaKernel,
    "cudnn": CudnnKernel,
    "hopper": HopperKernel,
}
# `auto` tries these in order.
# CUDA: measured on an H100 (reports/gpu/): varlen ahead of distca (distca 0.7-0.8x its
# forward, 0.5-0.65x its backward on 128-token shards), distca ahead of sdpa (1.4x/1.0x on a whole 16K
# document, 6x/6x on its 128-token shards).
_AUTO_ORDER = {"cuda": ("varlen", "flash_attn", "distca", "sdpa", "flex", "reference")}
# CPU: by the build of distca's kernels that runs (ops.cpu_isa()), as python/bench/bench_cpu_kernels.py
# measured it against sdpa with PyTorch held to the same vector width (reports/cpu/):
# avx512 and avx2 ahead of sdpa on every shape, the portable build (SSE2 on x86-64) behind it. aarch64
# (portable: NEON) is not measured (only run under qemu): sdpa first there too.
_CPU_AUTO_ORDER = {"avx512": ("distca", "sdpa", "reference"), "avx2": ("distca", "sdpa", "reference"),
                   "portable": ("sdpa", "distca", "reference")}


def _auto_order(device: torch.device) -> tuple:
    if device.type == "cpu":
        return _CPU_AUTO_ORDER[ops.cpu_isa()]
    return _AUTO_ORDER.get(device.type, ("reference",))


def backend_names() -> list[str]:
    return ["auto"] + list(_BACKENDS)


def _first_that_runs(order, device, dtype, head_dim: Optional[int]) -> Optional[ServerKernel]:
    for i, candidate in enumerate(order):
        kernel = _BACKENDS[candidate]()
        if kernel.unavailable(device, dtype) is not None:
            continue
        if isinstance(kernel, DistcaKernel):
            if head_dim is not None and head_dim not in kernel.head_dims(device):
                continue
            # Head dims it is not built for (known only at the call) go to the next that runs.
            kernel.fallback = _first_that_runs(order[i + 1:], device, dtype, head_dim)
        return kernel
    return None


class AutoKernel(ServerKernel):
    """`auto` on a device with a measured kernel table (distca.torch.kernel_table): each call's
    task list goes to the kernel the table names fastest for its kind (`long` or `shards`); a kind
    the table lacks, or a kernel that cannot run here, goes to the default order's choice."""
    name = "auto"

    def __init__(self, choices: dict, default: ServerKernel, source: str):
        self.choices, self.default, self.source = choices, default, source

    def unavailable(self, device, dtype):
        return self.default.unavailable(device, dtype)

    def pick(self, tasks: ServerTasks) -> ServerKernel:
        if "kernel_kind" not in tasks.cache:
            from ..kernel_table import classify
            tasks.cache["kernel_kind"] = classify(DistcaKernel.task_array(tasks))
        return self.choices.get(tasks.cache["kernel_kind"], self.default)

    def forward(self, q, k, v, tasks, scale):
        return self.pick(tasks).forward(q, k, v, tasks, scale)

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        return self.pick(tasks).backward(do, q, k, v, o, lse, tasks, scale)


def _table_auto(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> Optional[AutoKernel]:
    """`auto` from the device's measured kernel table, or None where it has none."""
    from ..kernel_table import find_table
    path, table = find_table(torch.cuda.get_device_name(device))
    if table is None:
        return None
    default = _first_that_runs(_auto_order(device), device, dtype, head_dim)
    if default is None:
        return None
    choices = {}
    for kind, entry in table["kinds"].items():
        kernel = _BACKENDS[entry["fastest"]]()
        if kernel.unavailable(device, dtype) is not None:
            continue
        if isinstance(kernel, DistcaKernel):
            if head_dim is not None and head_dim not in kernel.head_dims(device):
                continue
            kernel.fallback = default   # head dims it is not built for, known only at the call
        choices[kind] = kernel
    return AutoKernel(choices, default, str(path))


def describe_auto(device: torch.device, dtype: torch.dtype, head_dim: Optional[int] = None) -> str:
    """What `auto` runs on `device` with `dtype`, and why: the measured table's choice per kind of
    task list, or the default order's first kernel that runs."""
    kernel = get_backend("auto", device, dtype, head_dim)
    if isinstance(kernel, AutoKernel):
        picks = ", ".join(f"{kind} -> {k.name}" for kind, k in sorted(kernel.choices.items()))
        return f"auto: per task list from the measured table {kernel.source} ({picks}; otherwise {kernel.default.name})"
    why = ""
    if device.type == "cuda":
        why = f"; no measured kernel table for {torch.cuda.get_device_name(device)}, so the default order"
    return f"auto: {kernel.name}{why} ({', '.join(_auto_order(device))})"


def get_backend(name: Union[str, ServerKernel], device: torch.device, dtype: torch.dtype,
                head_dim: Optional[int] = None) -> ServerKernel:
    """The server kernel `name` for tensors on `device` of `dtype` (and `head_dim`, where known);
    `auto` picks the first that runs (cuda: varlen, flash_attn, distca, sdpa, flex, reference; cpu:
    distca, sdpa, reference where distca's kernels run their avx512 or avx2 build, else sdpa, distca,
    reference; distca only for the head dims it is built for: without `head_dim`, its kernel hands
    other head dims to the next at the call). BackendUnavailable names why a named one
    cannot run."""
    if isinstance(name, ServerKernel):
        return name
    if not isinstance(name, str):
        raise TypeError(f"backend must be one of {', '.join(backend_names())} or a ServerKernel instance, "
                        f"got {type(name).__name__}")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if name == "auto":
        table_kernel = _table_auto(device, dtype, head_dim) if device.type == "cuda" else None
        if table_kernel is not None:
            return table_kernel
        kernel = _first_that_runs(_auto_order(device), device, dtype, head_dim)
        if kernel is None:
            raise BackendUnavailable(f"no server kernel runs on {device} with {dtype}")
        return kernel
    if name not in _BACKENDS:
        raise BackendUnavailable(f"backend must be one of {', '.join(backend_names())}, got {name!r}")
    kernel = _BACKENDS[name]()
    reason = kernel.unavailable(device, dtype)
    if (reason is None and isinstance(kernel, DistcaKernel) and head_dim is not None
            and head_dim not in kernel.head_dims(device)):
        reason = (f"the kernels are built for head dims {', '.join(map(str, kernel.head_dims(device)))} on "
                  f"{device.type}, not {head_dim}")
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run on {device} with {dtype}: {reason}")
    return kernel
