"""distca's attention kernels as PyTorch custom operators, on CPU and CUDA tensors:

    torch.ops.distca.attention_fwd(q, k, v, tasks, scale, num_threads, kernel)          -> o, lse
    torch.ops.distca.attention_bwd(do, q, k, v, o, lse, tasks, scale, num_threads, kernel) -> dq, dk, dv

q [Tq, Hq, D], k/v [Tkv, Hkv, D] packed THD (contiguous, one device), tasks an (n, 5) int64 CPU
tensor of (q_offset, q_len, kv_offset, kv_len, is_causal) rows, the task list of kernels::AttnTask
(tasks may share key rows; the C++ side checks them). o has q's dtype, lse [Tq, Hq] fp32 (natural
log; -inf where a row sees no key); dq has q's dtype, dk/dv are fp32 (summed over the tasks that
read a row). The backward takes the O and LSE it is given (a key-split row's merged ones), as
distca.torch.kernels.backends describes. `scale` None is 1/sqrt(D), else a number finite and positive in
float32 (the kernels' precision: 1e300 and 1e-300 are refused); `num_threads` is the CPU kernels'
thread count (0: torch.get_num_threads()), ignored on CUDA; `kernel` picks the CUDA implementation,
one of the kernel registry's CUDA entries (CUDA_KERNELS: "distca", distca's own kernels; "hopper",
its sm_90a ones; "cudnn", cuDNN's fused attention on the same task list), ignored on CPU.

CPU: `_distca.CpuAttention`, the registry's "cpu" entry. CUDA: `_distca.CudaAttention` on the
tensors' device and the current stream (compute capability 8.0 or newer), asynchronous like any
CUDA op. The dtypes and head dims each takes are the registry's (`_distca.kernels()`, from
src/kernels/include/distca/kernels/registry.h): DTYPES and HEAD_DIMS below. One native object per
CPU thread count and per CUDA device and kernel, made at first use and shared.

Both operators have fake (meta) implementations that check the same shapes, dtypes and devices,
so they trace under torch.compile without a graph break, and attention_fwd is differentiable in
q, k, v through attention_bwd (lse is not differentiable: a caller that merges key-split parts
passes the merged O and LSE to the backward instead, as cad_attention does).
"""
from __future__ import annotations

import math
import numbers
import re
import threading
from typing import Any, Optional

import numpy as np
import torch

from ... import _distca

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The kernel registry (C++: kernels/registry.h), by name: the one statement of what each C++ kernel
# takes. CPU tensors go to its "cpu" entry, CUDA tensors to a CUDA entry (the three share dtypes
# and head dims: one contract, CudaAttention's).
REGISTRY = {k["name"]: k for k in _distca.kernels()}
CUDA_KERNELS = tuple(name for name, k in REGISTRY.items() if k["device"] == "cuda")


def kernel_dtypes(name: str) -> tuple:
    """The torch dtypes the registered kernel `name` takes."""
    return tuple(_TORCH_DTYPES[d] for d in REGISTRY[name]["dtypes"])


def kernel_head_dims(name: str) -> tuple:
    """The head dims the registered kernel `name` is built for (empty: any)."""
    return tuple(REGISTRY[name]["head_dims"])


def registry_name(device_type: str, kernel: str = "distca") -> str:
    """The registry's name of what runs tensors on `device_type`: "cpu" on CPU, `kernel` on CUDA."""
    return "cpu" if device_type == "cpu" else kernel


DTYPES = {"cpu": kernel_dtypes("cpu"), "cuda": kernel_dtypes("distca")}
HEAD_DIMS = {"cpu": kernel_head_dims("cpu"), "cuda": kernel_head_dims("distca")}
MIN_CAPABILITY = (8, 0)
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
_PREFIX = "distca attention: "

_natives: dict = {}          # ("cpu", threads, isa) or ("cuda", device index) -> native kernel object
_natives_lock = threading.Lock()


def _names(items) -> str:
    return " or ".join(str(x).removeprefix("torch.") for x in items)


def cpu_isa() -> str:
    """The build of the CPU kernels that runs: DISTCA_CPU_ISA where set (ValueError where this CPU
    cannot run it), else the fastest this CPU runs (avx512, avx2, portable)."""
    return _distca.cpu_isa()


def cpu_native(num_threads: int = 0):
    """The CPU kernels' native object for `num_threads` (0: torch.get_num_threads()) and the build
    cpu_isa() names now."""
    threads = int(num_threads) or torch.get_num_threads()
    key = ("cpu", threads, cpu_isa())
    native = _natives.get(key)
    if native is None:
        with _natives_lock:
            native = _natives.get(key) or _natives.setdefault(key, _distca.CpuAttention(threads, key[2]))
    return native


def cuda_native(index: int, kernel: str = "distca"):
    """The CUDA native object for device `index` running `kernel` (distca's own kernels, or cuDNN's
    fused attention behind the same task-list contract): made once; ValueError or RuntimeError with
    the C++ Status message where it cannot be made: not built, no such device, too old."""
    key = ("cuda", index, kernel)
    native = _natives.get(key)
    if native is None:
        if kernel not in CUDA_KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(CUDA_KERNELS)}, got {kernel!r}")
        with _natives_lock:
            native = _natives.get(key)
            if native is None:
                native = _natives.setdefault(key, _distca.CudaAttention(index, kernel))
    return native


def _arch_runs(entry: str, major: int, minor: int) -> bool:
    """Whether one entry of cuda_kernels_archs() (CMake's form: "80", "80-real", "90a-virtual",
    or "sm_80") has code that runs on compute capability major.minor: a cubin runs on the same
    major with an equal or higher minor ("a" variants on exactly their own), PTX on any newer
    device (JIT-compiled by the driver). A bare number is both, as in CMake."""
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+)(\d)([af]?)(-real|-virtual)?", entry.strip())
    if m is None:
        return False
    arch_major, arch_minor, variant, kind = int(m[1]), int(m[2]), m[3], m[4] or ""
    if entry.strip().startswith("compute_"):
        kind = "-virtual"
    if variant:   # arch-specific features: that exact device only
        return (arch_major, arch_minor) == (major, minor)
    cubin = kind in ("", "-real") and arch_major == major and arch_minor <= minor
    ptx = kind in ("", "-virtual") and (arch_major, arch_minor) <= (major, minor)
    return cubin or ptx


def unavailable(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when distca's kernels run on `device` with `dtype`, else the reason."""
    if device.type not in DTYPES:
        return f"distca's attention kernels run on cpu and cuda, not {device.type}"
    if dtype not in DTYPES[device.type]:
        return f"distca's attention kernels take {_names(DTYPES[device.type])} on {device.type}, not {dtype}"
    if device.type == "cpu":
        if not hasattr(_distca, "CpuAttention"):
            return "this build of distca's native module has no CpuAttention (reinstall: pip install .)"
        return None
    if not hasattr(_distca, "CudaAttention"):
        return "this build of distca's native module has no CudaAttention (reinstall: pip install .)"
    if not _distca.cuda_kernels_built():
        return ("this build of distca has no CUDA kernels (nvcc was not found when the native module was "
                "configured, or DISTCA_WITH_CUDA=OFF); reinstall where the CUDA toolkit is: pip install .")
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        return f"there is no CUDA device {index} (torch sees {torch.cuda.device_count()})"
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if (major, minor) < MIN_CAPABILITY:
        return (f"{name} (cuda:{index}) has compute capability {major}.{minor}; distca's CUDA kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    archs = _distca.cuda_kernels_archs()
    if not any(_arch_runs(a, major, minor) for a in re.split(r"[;,]", archs) if a.strip()):
        return (f"distca's CUDA kernels were compiled for {archs}, which has no code for {name} (sm_{major}{minor}); "
                f"rebuild with DISTCA_CUDA_ARCHS including it: pip install . "
                f"--config-settings=cmake.define.DISTCA_CUDA_ARCHS=\"{major}{minor}-real\"")
    try:
        cuda_native(index)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def task_tensor(tasks) -> torch.Tensor:
    """An (n, 5) int64 array (numpy or tensor) as the operators' task tensor (no copy when it is one)."""
    if isinstance(tasks, np.ndarray):
        tasks = torch.from_numpy(np.ascontiguousarray(tasks, dtype=np.int64))
    if not isinstance(tasks, torch.Tensor):
        raise ValueError(f"{_PREFIX}tasks must be an (n, 5) int64 array or tensor, got {type(tasks).__name__}")
    return tasks


def scale_problem(scale: Any) -> Optional[str]:
    """None where `scale` is None (1/sqrt(D)) or a real number that is finite and positive once
    rounded to float32, the precision every kernel multiplies in whatever the inputs' dtype (1e300
    is inf there, 1e-300 is 0: uniform attention); else what is wrong, in one line."""
    if scale is None:
        return None
    wanted = "scale must be a finite positive number (default 1/sqrt(head_dim))"
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        return f"{wanted}, got {scale!r}"
    try:
        value = float(scale)
    except OverflowError:   # an int past a double's range
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        return f"{wanted}, got {scale!r}"
    with np.errstate(over="ignore", under="ignore"):
        in_fp32 = float(np.float32(value))
    if not math.isfinite(in_fp32) or in_fp32 <= 0:
        return f"{wanted}, got {scale!r}, which is {in_fp32:g} in float32 (the kernels compute in float32)"
    return None


def _check_scale(scale: Any) -> None:
    problem = scale_problem(scale)
    if problem is not None:
        raise ValueError(f"{_PREFIX}{problem}")


def _check_tensor(name: str, x, device: torch.device, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{_PREFIX}{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        raise ValueError(f"{_PREFIX}{name} is on {x.device}, q on {device}: every tensor of a call must be on one device")
    if x.layout != torch.strided:
        raise ValueError(f"{_PREFIX}{name} has layout {x.layout}; the kernels take dense (strided) tensors")
    if x.dtype != dtype:
        raise ValueError(f"{_PREFIX}{name} is {x.dtype}, expected {dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{_PREFIX}{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{_PREFIX}{name} is not contiguous (call .contiguous())")


def check_inputs(q, k, v, tasks, others=(), is_fake: bool = False) -> tuple:
    """Checks q [Tq, Hq, D], k and v [Tkv, Hkv, D], the task tensor and `others` ((name, tensor,
    "q"/"k"/"lse") triples: a tensor shaped like q, like k, or [Tq, Hq] fp32) -> the native dims
    (Tq, Tkv, Hq, Hkv, D). Runs on fake tensors too (is_fake: meta allowed, nothing read)."""
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{_PREFIX}{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{_PREFIX}q and k must be [rows, heads, D], got shapes {tuple(q.shape)} and "
                             f"{tuple(getattr(k, 'shape', ()))}")
    device, dtype = q.device, q.dtype
    kind = device.type
    if kind == "meta" and not is_fake:
        raise ValueError(f"{_PREFIX}q is on meta; the kernels run on cpu and cuda")
    if kind not in DTYPES and kind != "meta":
        raise ValueError(f"{_PREFIX}q is on {device}; distca's attention kernels run on cpu and cuda")
    allowed = DTYPES.get(kind, DTYPES["cpu"] + DTYPES["cuda"])
    if dtype not in allowed:
        raise ValueError(f"{_PREFIX}q is {dtype}; the kernels take {_names(allowed)} on {kind}")
    (tq, hq, d), (tkv, hkv, dk) = q.shape, k.shape
    if dk != d:
        raise ValueError(f"{_PREFIX}q has head dim {d}, k {dk}")
    dims_allowed = HEAD_DIMS.get(kind, HEAD_DIMS["cpu"])
    if d not in dims_allowed:
        raise ValueError(f"{_PREFIX}head dim {d} is not one the kernels are built for on {kind} "
                         f"({', '.join(map(str, dims_allowed))})")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{_PREFIX}{hq} query heads are not a multiple of {hkv} key/value heads")
    shapes = {"q": ((tq, hq, d), dtype), "k": ((tkv, hkv, d), dtype), "lse": ((tq, hq), torch.float32)}
    for name, x, like in (("q", q, "q"), ("k", k, "k"), ("v", v, "k")) + tuple(others):
        _check_tensor(name, x, device, *shapes[like])
    if not isinstance(tasks, torch.Tensor):
        raise ValueError(f"{_PREFIX}tasks must be an (n, 5) int64 CPU tensor, got {type(tasks).__name__}")
    if tasks.dtype != torch.int64 or tasks.dim() != 2 or tasks.shape[1] != 5:
        raise ValueError(f"{_PREFIX}tasks must be an (n, 5) int64 tensor of (q_offset, q_len, kv_offset, kv_len, "
                         f"is_causal) rows, got {tasks.dtype} of shape {tuple(tasks.shape)}")
    if tasks.device.type != "cpu" and not (is_fake and tasks.device.type == "meta"):
        raise ValueError(f"{_PREFIX}tasks is on {tasks.device}; the task list is host memory (a CPU tensor)")
    if not tasks.is_contiguous():
        raise ValueError(f"{_PREFIX}tasks is not contiguous (call .contiguous())")
    return tq, tkv, hq, hkv, d


def _dims(x) -> tuple:
    return tuple(int(s) for s in x)


@torch.library.custom_op("distca::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tasks: torch.Tensor, scale: Optional[float] = None,
                  num_threads: int = 0, kernel: str = "distca") -> tuple[torch.Tensor, torch.Tensor]:
    _check_scale(scale)
    dims = _dims(check_inputs(q, k, v, tasks))
    tq, _, hq, _, d = dims
    o = torch.empty((tq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((tq, hq), dtype=torch.float32, device=q.device)
    if tq == 0:
        return o, lse
    array, dtype = tasks.numpy(), _DTYPE_NAMES[q.dtype]
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
    if q.device.type == "cpu":
        cpu_native(num_threads).forward(*pointers, dims, array, scale, dtype)
    else:
        with torch.cuda.device(q.device):
            cuda_native(q.device.index, kernel).forward(*pointers, dims, array, scale, dtype,
                                                torch.cuda.current_stream(q.device).cuda_stream)
    return o, lse


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, tasks, scale=None, num_threads=0, kernel="distca"):
    _check_scale(scale)
    check_inputs(q, k, v, tasks, is_fake=True)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("distca::attention_bwd", mutates_args=())
def attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, tasks: torch.Tensor, scale: Optional[float] = None,
                  num_threads: int = 0, kernel: str = "distca") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_scale(scale)
    dims = _dims(check_inputs(q, k, v, tasks, (("o", o, "q"), ("lse", lse, "lse"), ("do", do, "q"))))
    tq, tkv, hq, hkv, d = dims
    dq = torch.empty((tq, hq, d), dtype=q.dtype, device=q.device)
    array, dtype = tasks.numpy(), _DTYPE_NAMES[q.dtype]
    if q.device.type == "cpu":
        # The CPU kernels write dK/dV in the storage dtype (summed in fp32 inside, rounded once).
        dk, dv = (torch.empty((tkv, hkv, d), dtype=q.dtype) for _ in range(2))
        if tq or tkv:
            cpu_native(num_threads).backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                             do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dims, array,
                                             scale, dtype)
        return dq, dk.float(), dv.float()
    dk, dv = (torch.empty((tkv, hkv, d), dtype=torch.float32, device=q.device) for _ in range(2))
    if tq == 0:   # no query reads a key: nothing to launch
        return dq, dk.zero_(), dv.zero_()
    with torch.cuda.device(q.device):
        cuda_native(q.device.index, kernel).backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), do.data_ptr(), dq.data_ptr(),
            dk.data_ptr(), dv.data_ptr(), dims, array, scale, dtype, torch.cuda.current_stream(q.device).cuda_stream,
            d_lse=0, dkv_fp32=True)
    return dq, dk, dv


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, lse, tasks, scale=None, num_threads=0, kernel="distca"):
    _check_scale(scale)
    check_inputs(q, k, v, tasks, (("o", o, "q"), ("lse", lse, "lse"), ("do", do, "q")), is_fake=True)
    return (q.new_empty(q.shape), k.new_empty(k.shape, dtype=torch.float32),
            k.new_empty(k.shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, tasks, scale, num_threads, kernel = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, tasks)
    ctx.scale, ctx.num_threads, ctx.kernel = scale, num_threads, kernel
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, tasks = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do.contiguous(), q, k, v, o, lse, tasks, ctx.scale, ctx.num_threads, ctx.kernel)
    return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def pairs(tasks) -> int:
    """(query, key) pairs per head the task list computes (causal tasks count their triangle)."""
    return int(_distca.attention_pairs(task_tensor(tasks).numpy()))


def flops(tasks, num_q_heads: int, head_dim: int) -> tuple[float, float]:
    """Forward and backward FLOPs of the task list: 4 D Hq per (query, key) pair, the backward 2.5x."""
    forward = 4.0 * head_dim * num_q_heads * pairs(tasks)
    return forward, 2.5 * forward


__all__ = ["attention_fwd", "attention_bwd", "check_inputs", "scale_problem", "unavailable", "task_tensor", "pairs", "flops",
           "cpu_isa", "cpu_native", "cuda_native", "CUDA_KERNELS", "DTYPES", "HEAD_DIMS"]
