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
distca.torch.ops on the tensors' addresses: the whole task list in one call, forward and backward;
CPU: float32 and bfloat16, head dims 32, 64, 128, 256; CUDA: bfloat16 and float16, head dims 64
and 128, on the current stream), `cudnn` (cuDNN's fused attention on the same task list through
the same operators; CUDA, builds that found cuDNN). `auto` picks the best that runs on the device:
on CUDA, per task list by the device's measured kernel table (distca.torch.kernel_table: the
fastest kernel per kind of list, `long` or `shards`) where one exists, else as an H100 measured
them: varlen, then distca, then sdpa; on CPU, distca where its avx512 or avx2 build runs, else
sdpa: as measured per build. A StepPlanner's layouts say which (`StepLayout.backend_note`). A
named backend that cannot run raises BackendUnavailable with the reason.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import torch

from . import ops


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
    """The interface (see the module docstring). `unavailable(device, dtype)` is None when the
    kernel runs there, else the reason."""
    name = "?"

    def unavailable(self, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        raise NotImplementedError

    def forward(self, q, k, v, tasks: ServerTasks, scale: float):
        raise NotImplementedError

    def backward(self, do, q, k, v, o, lse, tasks: ServerTasks, scale: float):
        raise NotImplementedError


def _expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., Hq, D] (GQA: query head h reads kv head h // (Hq / Hkv))."""
    group = num_q_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _fold_kv_grad(dx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., Hq, D] -> [..., Hkv, D]: sums the gradients of the query heads sharing a kv head."""
    hq = dx.shape[-2]
    if hq == num_kv_heads:
        return dx
    return dx.unflatten(-2, (num_kv_heads, hq // num_kv_heads)).sum(-2)


class ReferenceKernel(ServerKernel):
    """Softmax attention written out per task in fp32 torch ops: the specification."""
    name = "reference"

    def unavailable(self, device, dtype):
        return None

    @staticmethod
    def _tasks(tasks: ServerTasks):
        for g in tasks.groups:
            for i in range(g.num_tasks):
                q0, q1 = g.q_offset + int(g.cu_q[i]), g.q_offset + int(g.cu_q[i + 1])
                k0, k1 = g.k_offset + int(g.cu_k[i]), g.k_offset + int(g.cu_k[i + 1])
                yield g.is_causal, slice(q0, q1), slice(k0, k1)

    @staticmethod
    def _scores(q, k, causal, scale):
        """q [Lq, Hq, D], k [Lk, Hq, D] fp32 -> [Hq, Lq, Lk], masked."""
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            lq, lk = q.shape[0], k.shape[0]
            allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            s = s.masked_fill(~allowed, float("-inf"))
        return s

    def forward(self, q, k, v, tasks, scale):
        hq = q.shape[1]
        o = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for causal, qs, ks in self._tasks(tasks):
            qt = q[qs].float()
            kt, vt = _expand_kv(k[ks].float(), hq), _expand_kv(v[ks].float(), hq)
            s = self._scores(qt, kt, causal, scale)
            m = torch.logsumexp(s, dim=-1)                                   # [Hq, Lq]
            o[qs] = torch.einsum("hqk,khd->qhd", torch.exp(s - m[..., None]), vt).to(q.dtype)
            lse[qs] = m.transpose(0, 1)
        return o, lse

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        hq, hkv = q.shape[1], k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for causal, qs, ks in self._tasks(tasks):
            qt, dot, ot = q[qs].float(), do[qs].float(), o[qs].float()
            kt, vt = _expand_kv(k[ks].float(), hq), _expand_kv(v[ks].float(), hq)
            s = self._scores(qt, kt, causal, scale)
            p = torch.exp(s - lse[qs].transpose(0, 1)[..., None])           # [Hq, Lq, Lk]
            dp = torch.einsum("qhd,khd->hqk", dot, vt)
            delta = (dot * ot).sum(-1).transpose(0, 1)                      # [Hq, Lq]
            ds = p * (dp - delta[..., None])
            dq[qs] = torch.einsum("hqk,khd->qhd", ds, kt) * scale
            dk[ks] = _fold_kv_grad(torch.einsum("hqk,qhd->khd", ds, qt) * scale, hkv)
            dv[ks] = _fold_kv_grad(torch.einsum("hqk,qhd->khd", p, dot), hkv)
        return dq.to(q.dtype), dk, dv


class SdpaKernel(ServerKernel):
    """PyTorch's fused attention kernels with their LSE: tasks of one (causal, Lq, Lk) shape run as
    one batched call. CPU: the flash kernel for CPU (`_scaled_dot_product_flash_attention_for_cpu`
    and its backward, which take O and LSE). Its causal mode is top-left and skips the masked
    blocks, while a bottom-right task with Lk > Lq would need an additive mask over its whole
    rectangle, every block computed; so on CPU such a task is cut into a non-causal rectangle and a
    square causal block, merged by the LSE rule (1.17x faster forward + backward on the demo's
    1536 x 6144 shard; the same time where Lq is small beside Lk). CUDA: the memory-efficient kernel (`_efficient_attention_forward` and its backward,
    which take O and LSE; bottom-right causal masking built in, custom_mask_type 2, as
    torch.nn.attention.bias.causal_lower_right uses it)."""
    name = "sdpa"
    _LOWER_RIGHT = 2   # torch.nn.attention.bias.CausalVariant.LOWER_RIGHT

    def unavailable(self, device, dtype):
        if device.type == "cpu":
            if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
                return f"torch {torch.__version__} has no _scaled_dot_product_flash_attention_for_cpu"
            return None
        if device.type == "cuda":
            if not hasattr(torch.ops.aten, "_efficient_attention_forward"):
                return f"torch {torch.__version__} has no aten._efficient_attention_forward"
            return None
        return f"sdpa runs on cpu and cuda, not {device.type}"

    @staticmethod
    def _stack(x, index, batch, length, heads):
        """Rows `index` of x [N, H, D] as [B, L, heads, D] (key/value heads expanded to `heads`)."""
        return _expand_kv(x.index_select(0, index), heads).view(batch, length, heads, -1)

    def forward(self, q, k, v, tasks, scale):
        hq = q.shape[1]
        split = q.device.type == "cpu"    # the CPU kernel masks bottom-right causal tasks in full: cut them
        hk = k.shape[1] if split else hq  # the CPU kernel reads GQA's shared heads in place; CUDA's needs them expanded
        o = torch.empty(q.shape, dtype=torch.float32 if split else q.dtype, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for i, b in enumerate(tasks.shape_batches(q.dtype, split_causal=split)):
            qb = self._stack(q, b.q_index, b.num_tasks, b.len_q, hq)
            kb, vb = (self._stack(x, b.k_index, b.num_tasks, b.len_k, hk) for x in (k, v))
            ob, lb = self._call_forward(qb, kb, vb, b, scale, tasks.cache, i)    # [B, Lq, Hq, D], [B, Hq, >= Lq]
            ob = ob.reshape(-1, hq, ob.shape[-1])
            lb = lb[..., :b.len_q].transpose(1, 2).reshape(-1, hq).float()
            if b.merge:   # the LSE rule with the part already there
                old = lse.index_select(0, b.q_index)
                new = torch.logaddexp(old, lb)
                ob = o.index_select(0, b.q_index) * torch.exp(old - new)[..., None] + ob * torch.exp(lb - new)[..., None]
                lb = new
            o.index_copy_(0, b.q_index, ob.to(o.dtype))
            lse.index_copy_(0, b.q_index, lb)
        return o.to(q.dtype), lse

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        hq, hkv = q.shape[1], k.shape[1]
        split = q.device.type == "cpu"
        hk = hkv if split else hq
        dq = torch.empty(q.shape, dtype=torch.float32 if split else q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for i, b in enumerate(tasks.shape_batches(q.dtype, split_causal=split)):
            qb, dob, ob = (self._stack(x, b.q_index, b.num_tasks, b.len_q, hq) for x in (q, do, o))
            kb, vb = (self._stack(x, b.k_index, b.num_tasks, b.len_k, hk) for x in (k, v))
            lb = lse.index_select(0, b.q_index).view(b.num_tasks, b.len_q, hq).transpose(1, 2)  # [B, Hq, Lq]
            dqb, dkb, dvb = self._call_backward(dob, qb, kb, vb, ob, lb, b, scale, tasks.cache, i)
            dqb = dqb.reshape(-1, hq, dqb.shape[-1]).to(dq.dtype)
            (dq.index_add_ if b.merge else dq.index_copy_)(0, b.q_index, dqb)
            dk.index_copy_(0, b.k_index, _fold_kv_grad(dkb.reshape(-1, hk, dkb.shape[-1]).float(), hkv))
            dv.index_copy_(0, b.k_index, _fold_kv_grad(dvb.reshape(-1, hk, dvb.shape[-1]).float(), hkv))
        return dq.to(q.dtype), dk, dv

    def _call_forward(self, qb, kb, vb, b: ShapeBatch, scale, cache, i):
        """[B, L, H, D] inputs -> (o [B, Lq, H, D], lse [B, H, >= Lq])."""
        if qb.device.type == "cpu":
            t = lambda x: x.transpose(1, 2)  # noqa: E731 (the CPU kernel takes [B, H, L, D])
            square_causal = b.is_causal and b.len_q == b.len_k
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                t(qb), t(kb), t(vb), 0.0, square_causal, attn_mask=b.mask, scale=scale)
            return t(o), lse
        o, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            qb, kb, vb, None, None, None, None, None, 0.0, self._LOWER_RIGHT if b.is_causal else 0, True, scale=scale)
        cache["sdpa_rng", i] = (seed, offset, lse.shape[-1])   # what the backward of this shape takes
        return o, lse

    def _call_backward(self, dob, qb, kb, vb, ob, lb, b: ShapeBatch, scale, cache, i):
        """[B, L, H, D] inputs, lb [B, H, Lq] -> dq, dk, dv as [B, L, H, D]."""
        if qb.device.type == "cpu":
            t = lambda x: x.transpose(1, 2)  # noqa: E731
            square_causal = b.is_causal and b.len_q == b.len_k
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                t(dob), t(qb), t(kb), t(vb), t(ob), lb.contiguous(), 0.0, square_causal, attn_mask=b.mask, scale=scale)
            return t(dq), t(dk), t(dv)
        if ("sdpa_rng", i) not in cache:
            raise RuntimeError("sdpa: the backward of a shape batch whose forward did not run on this layout")
        seed, offset, lse_len = cache["sdpa_rng", i]
        # The CUDA kernel's LSE is padded along Lq (to a multiple of 32): give the merged one that shape.
        lse = torch.nn.functional.pad(lb, (0, lse_len - b.len_q)).contiguous()
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dob, qb, kb, vb, None, ob, None, None, b.len_q, b.len_k, lse, 0.0, seed, offset,
            self._LOWER_RIGHT if b.is_causal else 0, False, scale=scale)
        return dq, dk, dv


class VarlenKernel(ServerKernel):
    """PyTorch's FlashAttention-2 varlen kernel (what `torch.nn.attention.varlen.varlen_attn`
    calls): one call for the causal group and one for the non-causal group; its backward takes O
    and LSE. GQA natively. CUDA, fp16/bf16."""
    name = "varlen"

    def unavailable(self, device, dtype):
        if device.type != "cuda":
            return f"varlen (FlashAttention-2 in PyTorch) runs on cuda, not {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"varlen takes float16 or bfloat16, not {dtype}"
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return f"torch {torch.__version__} has no aten._flash_attention_forward"
        if not torch.backends.cuda.is_flash_attention_available():
            return "this torch build has no flash attention"
        return None

    @staticmethod
    def _rows(x, g: TaskGroup, offset_is_q: bool):
        start = g.q_offset if offset_is_q else g.k_offset
        return x[start:start + (g.num_q if offset_is_q else g.num_k)]

    @staticmethod
    def _lse_rows(lse, g: TaskGroup, hq):
        """The kernel's LSE as [rows, Hq]: FlashAttention-2 varlen gives [Hq, rows]."""
        if lse.dim() == 2 and lse.shape == (hq, g.num_q):
            return lse.transpose(0, 1)
        raise RuntimeError(f"varlen: unexpected LSE shape {tuple(lse.shape)} for {g.num_q} rows and {hq} heads "
                           f"(torch {torch.__version__}); use backend='sdpa'")

    def forward(self, q, k, v, tasks, scale):
        hq = q.shape[1]
        o = q.new_empty(q.shape)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for g in tasks.groups:
            if g.num_tasks == 0:
                continue
            qg, kg, vg = self._rows(q, g, True), self._rows(k, g, False), self._rows(v, g, False)
            out, lg, *_ = torch.ops.aten._flash_attention_forward(
                qg, kg, vg, g.cu_q_dev, g.cu_k_dev, g.max_q, g.max_k, 0.0, g.is_causal, False, scale=scale)
            o[g.q_offset:g.q_offset + g.num_q] = out
            lse[g.q_offset:g.q_offset + g.num_q] = self._lse_rows(lg, g, hq)
        return o, lse

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        for g in tasks.groups:
            if g.num_tasks == 0:
                continue
            rows = slice(g.q_offset, g.q_offset + g.num_q)
            keys = slice(g.k_offset, g.k_offset + g.num_k)
            lg = lse[rows].transpose(0, 1).contiguous()
            dqg, dkg, dvg = torch.ops.aten._flash_attention_backward(
                do[rows].contiguous(), q[rows], k[keys], v[keys], o[rows].contiguous(), lg, g.cu_q_dev,
                g.cu_k_dev, g.max_q, g.max_k, 0.0, g.is_causal, rng, unused, scale=scale)
            dq[rows], dk[keys], dv[keys] = dqg, dkg.float(), dvg.float()
        return dq, dk, dv


class FlashAttnKernel(VarlenKernel):
    """The flash-attn package's varlen kernels (`flash_attn.flash_attn_interface`), when importable."""
    name = "flash_attn"

    def unavailable(self, device, dtype):
        try:
            from flash_attn import flash_attn_interface  # noqa: F401
        except Exception as e:  # noqa: BLE001 (any import failure means it cannot run)
            return f"import flash_attn failed: {type(e).__name__}: {e}"
        return VarlenKernel.unavailable(self, device, dtype)

    def forward(self, q, k, v, tasks, scale):
        from flash_attn import flash_attn_interface as fa
        o = q.new_empty(q.shape)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for g in tasks.groups:
            if g.num_tasks == 0:
                continue
            out, lg, _ = fa.flash_attn_varlen_func(
                self._rows(q, g, True), self._rows(k, g, False), self._rows(v, g, False), g.cu_q_dev, g.cu_k_dev,
                g.max_q, g.max_k, softmax_scale=scale, causal=g.is_causal, return_attn_probs=True)
            o[g.q_offset:g.q_offset + g.num_q] = out
            lse[g.q_offset:g.q_offset + g.num_q] = self._lse_rows(lg, g, q.shape[1])
        return o, lse

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        from flash_attn import flash_attn_interface as fa
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=k.dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=v.dtype, device=q.device)
        for g in tasks.groups:
            if g.num_tasks == 0:
                continue
            rows = slice(g.q_offset, g.q_offset + g.num_q)
            keys = slice(g.k_offset, g.k_offset + g.num_k)
            # flash-attn >= 2.6's positional signature: dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k,
            # max_q, max_k, dropout_p, scale, causal, window_left, window_right, softcap, alibi, deterministic.
            fa._flash_attn_varlen_backward(
                do[rows].contiguous(), q[rows], k[keys], v[keys], o[rows].contiguous(),
                lse[rows].transpose(0, 1).contiguous(), dq[rows], dk[keys], dv[keys], g.cu_q_dev, g.cu_k_dev,
                g.max_q, g.max_k, 0.0, scale, g.is_causal, -1, -1, 0.0, None, False)
        return dq, dk.float(), dv.float()


class FlexKernel(ServerKernel):
    """FlexAttention over the server's whole packed task list in one call: a mask from each row's
    task and position (bottom-right causal or full), compiled with torch.compile on CUDA. Its
    backward recomputes the forward under autograd and differentiates through O *and* LSE with
    the gradients the merge implies (dL/do_m = w dO, dL/dlse_m = w (dO.o_m - dO.O), w =
    exp(lse_m - LSE)), so key-split rows are exact. CUDA; torch refuses FlexAttention's backward
    on CPU (the forward runs there, eagerly, for tests)."""
    name = "flex"
    _compiled = None

    def unavailable(self, device, dtype):
        try:
            from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
        except Exception as e:  # noqa: BLE001 (an older torch)
            return f"torch {torch.__version__} has no flex_attention with AuxRequest: {type(e).__name__}: {e}"
        if device.type != "cuda":
            return f"torch refuses FlexAttention's backward on {device.type} (flex runs on cuda)"
        return None

    @staticmethod
    def _rows(tasks: ServerTasks):
        """Per row: its task, and for a query row the last key position it sees in its task."""
        if "flex_rows" not in tasks.cache:
            q_task, q_limit, k_task, k_pos = (np.zeros(n, np.int64) for n in (tasks.num_q, tasks.num_q, tasks.num_k, tasks.num_k))
            task = 0
            for g in tasks.groups:
                for i in range(g.num_tasks):
                    q0, q1 = g.q_offset + g.cu_q[i], g.q_offset + g.cu_q[i + 1]
                    k0, k1 = g.k_offset + g.cu_k[i], g.k_offset + g.cu_k[i + 1]
                    lq, lk = q1 - q0, k1 - k0
                    q_task[q0:q1], k_task[k0:k1] = task, task
                    k_pos[k0:k1] = np.arange(lk)
                    q_limit[q0:q1] = np.arange(lq) + (lk - lq) if g.is_causal else lk - 1
                    task += 1
            dev = lambda a: torch.from_numpy(a).to(tasks.device)  # noqa: E731
            tasks.cache["flex_rows"] = tuple(dev(a) for a in (q_task, q_limit, k_task, k_pos))
        return tasks.cache["flex_rows"]

    def _block_mask(self, tasks: ServerTasks):
        if "flex_mask" not in tasks.cache:
            from torch.nn.attention.flex_attention import create_block_mask
            q_task, q_limit, k_task, k_pos = self._rows(tasks)

            def mask_mod(b, h, q, kv):
                return (q_task[q] == k_task[kv]) & (k_pos[kv] <= q_limit[q])
            # On CUDA the mask is built compiled, block by block: the eager path materialises all
            # num_q x num_k entries (129 GiB for a 16K document's 128-token shards, measured on an H100).
            tasks.cache["flex_mask"] = create_block_mask(mask_mod, 1, None, tasks.num_q, tasks.num_k,
                                                         device=tasks.device, _compile=tasks.device.type == "cuda")
        return tasks.cache["flex_mask"]

    def _call(self, q, k, v, tasks, scale):
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention
        fn = flex_attention
        if q.device.type == "cuda":
            if FlexKernel._compiled is None:
                FlexKernel._compiled = torch.compile(flex_attention, dynamic=True)
            fn = FlexKernel._compiled
        as_bhnd = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 ([N, H, D] -> [1, H, N, D])
        with warnings.catch_warnings():
            # Off CUDA flex runs eagerly (tests of its mask); its "use torch.compile" warning is known.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o, aux = fn(as_bhnd(q), as_bhnd(k), as_bhnd(v), block_mask=self._block_mask(tasks), scale=scale,
                        enable_gqa=True, return_aux=AuxRequest(lse=True))
        return o[0].transpose(0, 1), aux.lse[0].transpose(0, 1)

    def forward(self, q, k, v, tasks, scale):
        if tasks.num_q == 0:
            return q.new_empty(q.shape), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        with torch.no_grad():
            o, lse = self._call(q, k, v, tasks, scale)
        return o.contiguous(), lse.float().contiguous()

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        if tasks.num_q == 0:
            return q.new_zeros(q.shape), k.new_zeros(k.shape, dtype=torch.float32), v.new_zeros(v.shape, dtype=torch.float32)
        return lse_autograd_backward(lambda *x: self._call(*x, tasks, scale), do, q, k, v, o, lse)


class DistcaKernel(ServerKernel):
    """distca's own attention kernels through the custom operators of distca.torch.ops
    (`distca::attention_fwd` / `distca::attention_bwd`): the server's whole task list, causal and
    non-causal, in one native call per pass, on the tensors' memory (no copies; the GIL released).
    Flash-style, GQA read in place, bottom-right causal tasks computed on their unmasked blocks
    only. The backward takes the merged O and LSE (the module docstring), so key-split rows are
    exact without an LSE gradient.

    CPU (`_distca.CpuAttention`): float32 and bfloat16 (torch.bfloat16 is the top half of an IEEE
    float, the bit pattern of distca::bf16), head dims 32, 64, 128, 256; results bit-identical for
    any thread count. Threads: `num_threads`, or torch.get_num_threads() at each call; one native
    object (its thread pool and workspace) per thread count, shared by every instance. The bf16
    backward writes dK/dV in bf16 (summed in fp32 inside, rounded once), widened to the interface's
    fp32, as sdpa's CPU kernel does.

    CUDA (`_distca.CudaAttention`, src/kernels/include/distca/kernels/cuda.h): bfloat16 and
    float16, head dims 64 and 128, compute capability 8.0 or newer; on the current stream, one
    native object per device; dK/dV returned as their fp32 sums (never rounded to bf16). Validated
    on an H100 by python/tests/gpu/check_torch_cuda.py (reports/gpu/2026-11-25-h100); `auto` on
    CUDA picks PyTorch's FlashAttention-2 (varlen) first, which ran faster there.

    Head dims the kernels are not built for go to `fallback` where one is set (auto sets it), else
    raise ValueError."""
    name = "distca"
    cuda_kernel = "distca"   # the native CUDA implementation (CudnnKernel: "cudnn")
    HEAD_DIMS = ops.HEAD_DIMS["cpu"]
    CUDA_HEAD_DIMS = ops.HEAD_DIMS["cuda"]

    def __init__(self, num_threads: Optional[int] = None, fallback: Optional[ServerKernel] = None):
        if num_threads is not None and not 1 <= int(num_threads) <= 1024:
            raise ValueError(f"distca backend: num_threads must be in [1, 1024], got {num_threads}")
        self.num_threads = None if num_threads is None else int(num_threads)
        self.fallback = fallback   # runs head dims the kernels are not built for (auto sets it)

    @staticmethod
    def head_dims(device: torch.device) -> tuple:
        """The head dims the kernels are built for on `device`'s type."""
        return ops.HEAD_DIMS.get(device.type, ())

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


class CudnnKernel(DistcaKernel):
    """cuDNN's fused attention (the kernel under TransformerEngine's packed THD attention) on the
    server's task list, through the same operators and native object as `distca` with
    kernel="cudnn" (src/kernels/include/distca/kernels/cudnn.h): each task one sequence of a
    ragged batch, one cuDNN call per mask kind, graphs cached per bucketed shape. CUDA only;
    bfloat16 and float16, head dims 64 and 128; builds that found cuDNN at configure time."""
    name = "cudnn"
    cuda_kernel = "cudnn"

    def unavailable(self, device, dtype):
        if device.type != "cuda":
            return f"the cudnn backend runs on CUDA devices, not {device.type}"
        reason = ops.unavailable(device, dtype)
        if reason is not None:
            return reason
        from distca import _distca
        if not _distca.cudnn_built():
            return ("this build of distca has no cuDNN kernel (cuDNN or cudnn-frontend's headers were not found at "
                    "configure time: scripts/cudnn-frontend.sh, then reinstall)")
        return None


_BACKENDS: dict[str, Callable[[], ServerKernel]] = {
    "reference": ReferenceKernel,
    "sdpa": SdpaKernel,
    "varlen": VarlenKernel,
    "flash_attn": FlashAttnKernel,
    "flex": FlexKernel,
    "distca": DistcaKernel,
    "cudnn": CudnnKernel,
}
# `auto` tries these in order.
# CUDA: measured on an H100 (reports/gpu/2026-11-25-h100): varlen ahead of distca (distca 0.7-0.8x its
# forward, 0.5-0.65x its backward on 128-token shards), distca ahead of sdpa (1.4x/1.0x on a whole 16K
# document, 6x/6x on its 128-token shards).
_AUTO_ORDER = {"cuda": ("varlen", "flash_attn", "distca", "sdpa", "flex", "reference")}
# CPU: by the build of distca's kernels that runs (ops.cpu_isa()), as python/bench/bench_cpu_kernels.py
# measured it against sdpa with PyTorch held to the same vector width (reports/cpu/2026-11-27-isa):
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
            if head_dim is not None and head_dim not in DistcaKernel.head_dims(device):
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
            from .kernel_table import classify
            tasks.cache["kernel_kind"] = classify(DistcaKernel.task_array(tasks))
        return self.choices.get(tasks.cache["kernel_kind"], self.default)

    def forward(self, q, k, v, tasks, scale):
        return self.pick(tasks).forward(q, k, v, tasks, scale)

    def backward(self, do, q, k, v, o, lse, tasks, scale):
        return self.pick(tasks).backward(do, q, k, v, o, lse, tasks, scale)


def _table_auto(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> Optional[AutoKernel]:
    """`auto` from the device's measured kernel table, or None where it has none."""
    from .kernel_table import find_table
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
            if head_dim is not None and head_dim not in DistcaKernel.head_dims(device):
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
    if reason is None and name in ("distca", "cudnn") and head_dim is not None and head_dim not in DistcaKernel.head_dims(device):
        reason = (f"the kernels are built for head dims {', '.join(map(str, DistcaKernel.head_dims(device)))} on "
                  f"{device.type}, not {head_dim}")
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run on {device} with {dtype}: {reason}")
    return kernel


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
