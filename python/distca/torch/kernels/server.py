"""The server-kernel interface and what every kernel shares: the task list a server computes
(ServerTasks, its TaskGroups and ShapeBatches), the interface itself (ServerKernel, whose contract
distca.torch.kernels.backends' docstring states), BackendUnavailable, the GQA helpers, the backward through
a merged O and LSE (lse_autograd_backward), and the task list of one document's causal shards
(causal_shards) for benchmarks and checks. The kernels are in pytorch and native;
distca.torch.kernels.backends names and picks them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


class BackendUnavailable(ValueError):
    """A named server kernel cannot run here (device, dtype, missing package); says why."""


@dataclass
class TaskGroup:
    """One varlen group: `num_tasks` tasks whose query rows start at q_offset + cu_q[i] and key rows
    at k_offset + cu_k[i] in the server's varlen buffers."""
    is_causal: bool
    q_offset: int
    k_offset: int
    cu_q: np.ndarray          # (tasks + 1) int64, from 0
    cu_k: np.ndarray          # (tasks + 1) int64, from 0
    max_q: int
    max_k: int
    cu_q_dev: Optional[torch.Tensor] = None   # int32 copies on the device (varlen kernels)
    cu_k_dev: Optional[torch.Tensor] = None

    @property
    def num_tasks(self) -> int:
        return len(self.cu_q) - 1

    @property
    def num_q(self) -> int:
        return int(self.cu_q[-1]) if len(self.cu_q) else 0

    @property
    def num_k(self) -> int:
        return int(self.cu_k[-1]) if len(self.cu_k) else 0


@dataclass
class ShapeBatch:
    """Tasks of one (Lq, Lk, causal) shape, stacked into a batch: rows q_index [B * Lq] and k_index
    [B * Lk] of the varlen buffers (device tensors). `merge`: these query rows already have a part
    from an earlier batch of the list (a causal task cut in two), so the output is merged by the
    LSE rule and the query gradient added."""
    is_causal: bool
    num_tasks: int
    len_q: int
    len_k: int
    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: Optional[torch.Tensor] = None   # additive bottom-right mask [Lq, Lk] where Lq != Lk (causal)
    merge: bool = False


@dataclass
class ServerTasks:
    """A server's tasks for one nano-batch: the causal group, then the non-causal one. Kernels may
    cache derived forms (shape batches, masks) in `cache`, built once per step and reused by every
    layer."""
    groups: tuple[TaskGroup, TaskGroup]
    num_q: int
    num_k: int
    device: torch.device
    cache: dict = field(default_factory=dict)

    def shape_batches(self, dtype: torch.dtype, split_causal: bool = False) -> list[ShapeBatch]:
        """The tasks grouped by (causal, Lq, Lk), each group a batch (cached per dtype).

        split_causal: a causal task with more keys than queries (Lk > Lq) becomes two parts, a
        non-causal rectangle (its first Lk - Lq keys) and a square causal block (its last Lq keys),
        so a kernel whose bottom-right causal path would need a mask over the whole rectangle
        skips the masked half instead; the square parts come after every first part (merge=True)."""
        key = ("shape_batches", dtype, split_causal)
        if key not in self.cache:
            shapes: dict[tuple[bool, int, int, bool], list] = {}
            for g in self.groups:
                lq, lk = np.diff(g.cu_q), np.diff(g.cu_k)
                q0, k0 = g.q_offset + g.cu_q[:-1], g.k_offset + g.cu_k[:-1]
                for i, (len_q, len_k) in enumerate(zip(lq.tolist(), lk.tolist())):
                    if len_q == 0:
                        continue
                    if split_causal and g.is_causal and len_k > len_q:
                        shapes.setdefault((False, len_q, len_k - len_q, False), []).append((q0[i], k0[i]))
                        shapes.setdefault((True, len_q, len_q, True), []).append((q0[i], k0[i] + len_k - len_q))
                    else:
                        shapes.setdefault((g.is_causal, len_q, len_k, False), []).append((q0[i], k0[i]))
            batches = []
            # First parts (merge False) before second parts; causal before non-causal, then by shape.
            for (causal, len_q, len_k, merge), starts in sorted(shapes.items(), key=lambda kv: (kv[0][3], not kv[0][0],
                                                                                                kv[0][1], kv[0][2])):
                a = np.asarray(starts, dtype=np.int64)
                q_index = (a[:, :1] + np.arange(len_q)[None, :]).reshape(-1)
                k_index = (a[:, 1:] + np.arange(len_k)[None, :]).reshape(-1)
                mask = None
                if causal and len_q != len_k:
                    allowed = np.arange(len_k)[None, :] <= np.arange(len_q)[:, None] + (len_k - len_q)
                    mask = torch.zeros(len_q, len_k, dtype=dtype).masked_fill_(
                        torch.from_numpy(~allowed), float("-inf")).to(self.device)
                batches.append(ShapeBatch(causal, len(starts), len_q, len_k,
                                          torch.from_numpy(q_index).to(self.device),
                                          torch.from_numpy(k_index).to(self.device), mask, merge))
            self.cache[key] = batches
        return self.cache[key]


class ServerKernel:
    """The interface (see the docstring of distca.torch.kernels.backends). `unavailable(device, dtype)` is
    None when the kernel runs there, else the reason."""
    name = "?"

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        raise NotImplementedError

    def forward(self, q, k, v, tasks: ServerTasks, scale: float):
        raise NotImplementedError

    def backward(self, do, q, k, v, o, lse, tasks: ServerTasks, scale: float):
        raise NotImplementedError


def expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., Hq, D] (GQA: query head h reads kv head h // (Hq / Hkv))."""
    group = num_q_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def fold_kv_grad(dx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., Hq, D] -> [..., Hkv, D]: sums the gradients of the query heads sharing a kv head."""
    hq = dx.shape[-2]
    if hq == num_kv_heads:
        return dx
    return dx.unflatten(-2, (num_kv_heads, hq // num_kv_heads)).sum(-2)


def lse_autograd_backward(call, do, q, k, v, o, lse):
    """The backward of a differentiable kernel call(q, k, v) -> (o_part, lse_part) when the rows'
    results were merged with other parts into (o, lse): recompute under autograd and
    differentiate through O and LSE with the merge's gradients, dL/do_m = w dO and dL/dlse_m =
    w (dO.o_m - dO.O), w = exp(lse_m - LSE). Returns dq, and dk, dv in fp32."""
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o_part, lse_part = call(q, k, v)
        weight = torch.exp(lse_part.float().detach() - lse)                          # [N, Hq]
        dof = do.float()
        grad_o = (weight[..., None] * dof).to(o_part.dtype)
        grad_lse = weight * ((dof * o_part.detach().float()).sum(-1) - (dof * o.float()).sum(-1))
        dq, dk, dv = torch.autograd.grad((o_part, lse_part), (q, k, v), (grad_o, grad_lse.to(lse_part.dtype)))
    return dq, dk.float(), dv.float()


def causal_shards(n: int, shard: int, device: torch.device) -> ServerTasks:
    """One document of n tokens as a server's causal tasks of `shard` query rows, each with its key
    prefix (0: one whole task): the shapes CAD hands a kernel, for benchmarks and checks."""
    q_ends = np.unique(np.concatenate([np.arange(0, n, shard or n), [n]]))
    cu_q = q_ends.astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(q_ends[1:])]).astype(np.int64)
    dev32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)  # noqa: E731
    causal = TaskGroup(True, 0, 0, cu_q, cu_k, int(np.diff(cu_q).max()), n, dev32(cu_q), dev32(cu_k))
    zero = np.zeros(1, np.int64)
    empty = TaskGroup(False, int(cu_q[-1]), int(cu_k[-1]), zero, zero, 0, 0, dev32(zero), dev32(zero))
    return ServerTasks((causal, empty), int(cu_q[-1]), int(cu_k[-1]), device)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
