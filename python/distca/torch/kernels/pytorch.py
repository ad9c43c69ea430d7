"""The server kernels built on PyTorch's own operators: `reference` (the specification, torch ops
per task in fp32), `sdpa` (PyTorch's fused kernels with their LSE), `varlen` (PyTorch's
FlashAttention-2 varlen kernel), `flash_attn` (the flash-attn package) and `flex`
(FlexAttention). The interface they implement is distca.torch.kernels.server's (contract: the docstring
of distca.torch.kernels.backends).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .server import ServerKernel, ServerTasks, ShapeBatch, TaskGroup, expand_kv, fold_kv_grad, lse_autograd_backward


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
            kt, vt = expand_kv(k[ks].float(), hq), expand_kv(v[ks].float(), hq)
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
            kt, vt = expand_kv(k[ks].float(), hq), expand_kv(v[ks].float(), hq)
            s = self._scores(qt, kt, causal, scale)
            p = torch.exp(s - lse[qs].transpose(0, 1)[..., None])           # [Hq, Lq, Lk]
            dp = torch.einsum("qhd,khd->hqk", dot, vt)
            delta = (dot * ot).sum(-1).transpose(0, 1)                      # [Hq, Lq]
            ds = p * (dp - delta[..., None])
            dq[qs] = torch.einsum("hqk,khd->qhd", ds, kt) * scale
            dk[ks] = fold_kv_grad(torch.einsum("hqk,qhd->khd", ds, qt) * scale, hkv)
            dv[ks] = fold_kv_grad(torch.einsum("hqk,qhd->khd", p, dot), hkv)
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
        return expand_kv(x.index_select(0, index), heads).view(batch, length, heads, -1)

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
            dk.index_copy_(0, b.k_index, fold_kv_grad(dkb.reshape(-1, hk, dkb.shape[-1]).float(), hkv))
            dv.index_copy_(0, b.k_index, fold_kv_grad(dvb.reshape(-1, hk, dvb.shape[-1]).float(), hkv))
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
