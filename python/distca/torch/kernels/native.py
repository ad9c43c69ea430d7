"""The server kernels of distca's own native code through the custom operators of distca.torch.kernels.ops:
`distca` (distca's kernels, src/kernels), `hopper` (its sm_90a kernels) and `cudnn` (cuDNN's fused
attention on the same task list). The interface they implement is distca.torch.kernels.server's
(contract: the docstring of distca.torch.kernels.backends). What each takes (dtypes, head dims) and
whether this build has it is the C++ kernel registry's (distca.torch.kernels.ops.REGISTRY).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import ops
from .server import ServerKernel, ServerTasks


class DistcaKernel(ServerKernel):
    """distca's own attention kernels through the custom operators of distca.torch.kernels.ops
    (`distca::attention_fwd` / `distca::attention_bwd`): the server's whole task list, causal and
    non-causal, in one native call per pass, on the tensors' memory (no copies; the GIL released).
    Flash-style, GQA read in place, bottom-right causal tasks computed on their unmasked blocks
    only. The backward takes the merged O and LSE (distca.torch.kernels.backends' docstring), so key-split
    rows are exact without an LSE gradient.

    CPU (`_distca.CpuAttention`, the registry's "cpu" entry: its dtypes and head dims; torch.bfloat16
    is the top half of an IEEE float, the bit pattern of distca::bf16); results bit-identical for
    any thread count. Threads: `num_threads`, or torch.get_num_threads() at each call; one native
    object (its thread pool and workspace) per thread count, shared by every instance. The bf16
    backward writes dK/dV in bf16 (summed in fp32 inside, rounded once), widened to the interface's
    fp32, as sdpa's CPU kernel does.

    CUDA (`_distca.CudaAttention`, src/kernels/include/distca/kernels/cuda.h, the registry's entry
    named `cuda_kernel`: its dtypes and head dims), compute capability 8.0 or newer; on the current
    stream, one native object per device; dK/dV returned as their fp32 sums (never rounded to
    bf16). `auto` on CUDA picks PyTorch's FlashAttention-2 (varlen) first, which ran faster
    (distca.torch.kernels.backends).

    Head dims the kernels are not built for go to `fallback` where one is set (auto sets it), else
    raise ValueError."""
    name = "distca"
    cuda_kernel = "distca"   # the native CUDA implementation, a registry name (CudnnKernel: "cudnn")
    HEAD_DIMS = ops.HEAD_DIMS["cpu"]
    CUDA_HEAD_DIMS = ops.HEAD_DIMS["cuda"]

    def __init__(self, num_threads: Optional[int] = None, fallback: Optional[ServerKernel] = None):
        if num_threads is not None and not 1 <= int(num_threads) <= 1024:
            raise ValueError(f"distca backend: num_threads must be in [1, 1024], got {num_threads}")
        self.num_threads = None if num_threads is None else int(num_threads)
        self.fallback = fallback   # runs head dims the kernels are not built for (auto sets it)

    @classmethod
    def head_dims(cls, device: torch.device) -> tuple:
        """The head dims the registry says this kernel is built for on `device`'s type (none off
        cpu and cuda)."""
        if device.type not in ops.DTYPES:
            return ()
        return ops.kernel_head_dims(ops.registry_name(device.type, cls.cuda_kernel))

    @classmethod
    def not_built(cls) -> Optional[str]:
        """None where this build has the CUDA implementation, else why not (the registry's reason)."""
        entry = ops.REGISTRY[cls.cuda_kernel]
        return None if entry["built"] else entry["not_built"]

    def unavailable(self, device, dtype):
        return ops.unavailable(device, dtype)

    def native(self, device: Optional[torch.device] = None):
        """The native kernel object: on CPU (device None or cpu) the one for this call's thread
        count, on CUDA the one for the device (each made once)."""
        if device is None or device.type == "cpu":
            return ops.cpu_native(self.num_threads or 0)
        return ops.cuda_native(device.index if device.index is not None else torch.cuda.current_device(),
                               self.cuda_kernel)

    @staticmethod
    def task_array(tasks: ServerTasks) -> np.ndarray:
        """The tasks as the native (n, 5) int64 rows (q_offset, q_len, kv_offset, kv_len, is_causal),
        built once per ServerTasks (cached: every layer of the step reuses it)."""
        if "distca_tasks" not in tasks.cache:
            rows = [np.zeros((0, 5), np.int64)]
            for g in tasks.groups:
                if g.num_tasks <= 0:
                    continue
                a = np.empty((g.num_tasks, 5), np.int64)
                a[:, 0] = g.q_offset + g.cu_q[:-1]
                a[:, 1] = np.diff(g.cu_q)
                a[:, 2] = g.k_offset + g.cu_k[:-1]
                a[:, 3] = np.diff(g.cu_k)
                a[:, 4] = int(g.is_causal)
                rows.append(a)
            tasks.cache["distca_tasks"] = np.ascontiguousarray(np.concatenate(rows))
        return tasks.cache["distca_tasks"]

    @staticmethod
    def _task_tensor(tasks: ServerTasks) -> torch.Tensor:
        """task_array as the operators' CPU tensor (shares its memory; cached)."""
        if "distca_tasks_tensor" not in tasks.cache:
            tasks.cache["distca_tasks_tensor"] = ops.task_tensor(DistcaKernel.task_array(tasks))
        return tasks.cache["distca_tasks_tensor"]

    def forward_tasks(self, q, k, v, task_array, scale: Optional[float]):
        """forward on a native task array (numpy or CPU tensor; rows may share key rows, the C++
        side checks them)."""
        tasks = ops.task_tensor(task_array)
        ops.check_inputs(q, k, v, tasks)   # here too: the operator's dispatch refuses some inputs less clearly
        return torch.ops.distca.attention_fwd(q, k, v, tasks, scale, self.num_threads or 0, self.cuda_kernel)

    def backward_tasks(self, do, q, k, v, o, lse, task_array, scale: Optional[float]):
        """backward on a native task array: dq (q's dtype), dk, dv (fp32)."""
        tasks = ops.task_tensor(task_array)
        ops.check_inputs(q, k, v, tasks, (("o", o, "q"), ("lse", lse, "lse"), ("do", do, "q")))
        return torch.ops.distca.attention_bwd(do, q, k, v, o, lse, tasks, scale, self.num_threads or 0,
                                              self.cuda_kernel)

    @staticmethod
    def _check_rows(q, k, tasks: ServerTasks):
        if q.dim() >= 1 and k.dim() >= 1 and (q.shape[0] != tasks.num_q or k.shape[0] != tasks.num_k):
            raise ValueError(f"distca backend: the tasks address {tasks.num_q} query and {tasks.num_k} key rows, "
                             f"q has {q.shape[0]} and k {k.shape[0]}")

    def _hands_over(self, q) -> bool:
        return (self.fallback is not None and isinstance(q, torch.Tensor) and q.dim() == 3
                and q.shape[-1] not in self.head_dims(q.device))

    def forward(self, q, k, v, tasks, scale):
        if self._hands_over(q):
            return self.fallback.forward(q, k, v, tasks, scale)
        self._check_rows(q, k, tasks)
        return self.forward_tasks(q, k, v, self._task_tensor(tasks), scale)

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        if self._hands_over(q):
            return self.fallback.backward(do, q, k, v, o, lse, tasks, scale)
        self._check_rows(q, k, tasks)
        return self.backward_tasks(do, q, k, v, o, lse, self._task_tensor(tasks), scale)


def _cuda_reason(name, devices, device, dtype):
    """Why a CUDA-only backend cannot run on this device and dtype (None: it may)."""
    if device.type != "cuda":
        return f"the {name} backend runs on {devices}, not {device.type}"
    return ops.unavailable(device, dtype)


class CudnnKernel(DistcaKernel):
    """cuDNN's fused attention (the kernel under TransformerEngine's packed THD attention) on the
    server's task list, through the same operators and native object as `distca` with
    kernel="cudnn" (src/kernels/include/distca/kernels/cudnn.h): each task one sequence of a
    ragged batch, one cuDNN call per mask kind, graphs cached per bucketed shape. CUDA only, the
    registry's "cudnn" entry; builds that found cuDNN at configure time."""
    name = "cudnn"
    cuda_kernel = "cudnn"

    def unavailable(self, device, dtype):
        return _cuda_reason(self.name, "CUDA devices", device, dtype) or self.not_built()


class HopperKernel(DistcaKernel):
    """distca's sm_90a kernels (TMA, wgmma, a producer warpgroup feeding the compute warpgroups:
    src/kernels/cuda/sm90/), through the same operators and native object as `distca` with
    kernel="hopper". CUDA devices of compute capability 9.0 (H100, H200) in a build with sm_90a,
    the registry's "hopper" entry. `auto` picks it only where a device's measured kernel table
    names it (distca.torch.kernel_table)."""
    name = "hopper"
    cuda_kernel = "hopper"

    def unavailable(self, device, dtype):
        reason = _cuda_reason(self.name, "CUDA devices of compute capability 9.0", device, dtype)
        if reason is not None:
            return reason
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) != (9, 0):
            return f"the hopper backend needs compute capability 9.0 (H100, H200); this device has {major}.{minor}"
        return self.not_built()
