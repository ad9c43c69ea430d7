"""Random CA-task lists as an attention server holds them, and the float64 truth with an error
bound per output element for a kernel that stores bf16/fp16 and accumulates fp32: shared by the
GPU check of distca's CUDA kernels (python/tests/gpu/check_torch_cuda.py) and its CPU dry run
(test_attention_cases.py, against the CPU kernels).

Task lists (`random_server`): documents of lengths 1, primes and tile sizes +-1, each with its
K/V rows stored once; a document is one whole causal task, or causal shards each over its key
prefix (every shard of it reads the same K/V rows), or shards whose keys are split in two or three
parts (a non-causal part over the first keys, a causal part over the rest) computed on copies of
the shard's query rows, to be merged by the LSE rule; beside them non-causal tasks with no keys
(rows that see nothing), tasks with no queries, query rows no task covers and key rows no task
reads. The tasks come in a random order.

Error bounds (`reference_forward`, `reference_backward`): first order in the unit roundoffs, u of
the storage dtype (bf16 2^-8, fp16 2^-11) and u32 = 2^-24 of fp32 accumulation, with
gamma_n = n u32 / (1 - n u32) for a sum of n terms (Higham's standard model). Rounding x to the
storage dtype errs by at most u|x| + eta, eta half its smallest subnormal (fp16 2^-25, bf16 2^-134):
below fp16's smallest normal, 2^-14, the spacing is absolute, and P and dS reach there (an H100 run
of CudaAttention in fp16 matched, to every digit of the worst ratio, float64 math with only dS
rounded to fp16, and broke the bound without eta by 32-59x on 4-92 dQ elements of about 3e-7, whose
rounding to fp16 is absolute). Per element:
  scores     eS = gamma_D c|q||k| + 3 u32 (|S| + |LSE|)   (dot over D; scale, max shift, exp2 argument)
  P          relative error eP = eS + 4 u32                 (exp2's approximation)
  LSE        max_j eP + gamma_n + 2 u32 |LSE| + u32
  O          (P eP)|V| + (u + 2 gamma_n + max_j eP) P|V| + eta [P>0]|V| + u|O| + eta   (P rounded to
             storage for P V, the sum over n keys, the normalizer, O rounded once)
  dS         (P eP)|dP - delta| + P (gamma_D |dO||V| + gamma_D rowsum|dO||O|) + (u32 + u)|dS| + eta [P>0]
             (dS rounded to storage for the dQ and dK products)
  dV         (P eP)^T|dO| + (u + gamma_M) P^T|dO| + eta [P>0]^T|dO|
  dK         c ((e_dS)^T|Q| + gamma_M |dS|^T|Q|)   (+ u|dK| + eta where dK is rounded to storage)
  dQ         c (e_dS |K| + gamma_N |dS||K|) + u|dQ| + eta
with n, N the keys of the task, M every query row x query head summed into a key row. A kernel
passes where |got - truth| <= SLACK x bound: the bound drops terms of order u^2 (each at most the
first-order bound times n u), so twice it holds them. Where the bound is 0 (rows that see no key,
keys no query reads) the output must be exactly the truth: 0, or -inf for an LSE.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

U32 = 2.0 ** -24
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: U32}
# Half the smallest subnormal: the absolute part of rounding to the dtype (|fl(x) - x| <= u|x| + eta).
UNDERFLOW = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25, torch.float32: 2.0 ** -150}
SLACK = 2.0
LENGTHS = (1, 2, 3, 5, 7, 13, 31, 61, 63, 64, 65, 127, 128, 129, 131, 257, 509)


def gamma(n) -> float:
    n = float(n)
    return n * U32 / (1.0 - n * U32)


@dataclass
class Server:
    """tasks: (n, 5) int64 rows (q_offset, q_len, kv_offset, kv_len, is_causal); source[Tq]: the
    logical query of each Q row (rows of one source are copies: key-split parts of one shard);
    num_sources queries in all."""
    tasks: np.ndarray
    num_q: int
    num_kv: int
    source: np.ndarray
    num_sources: int
    counts: dict


def random_server(rng: np.random.Generator, target_rows: int, lengths=LENGTHS) -> Server:
    tasks: list = []
    source: list = []
    counts = {"whole": 0, "shards": 0, "split_parts": 0, "no_keys": 0, "no_queries": 0, "gap_rows": 0,
              "unread_kv_rows": 0}
    q_at = k_at = 0
    next_source = 0

    def take_q(n, sources=None):
        nonlocal q_at, next_source
        gap = int(rng.integers(0, 3)) if rng.random() < 0.3 else 0   # rows no task covers
        counts["gap_rows"] += gap
        for _ in range(gap):
            source.append(next_source)
            next_source += 1
        start = q_at + gap
        if sources is None:
            sources = list(range(next_source, next_source + n))
            next_source += n
        source.extend(sources)
        q_at = start + n
        return start, sources

    while q_at < target_rows:
        if rng.random() < 0.15:   # key rows no task reads (their dK, dV must be 0)
            extra = int(rng.integers(1, 4))
            k_at += extra
            counts["unread_kv_rows"] += extra
        kind = rng.random()
        if kind < 0.12:   # a non-causal task with its own keys, possibly none, or one with no queries
            lq = int(rng.choice([0, 1, 5, 64, 67]))
            lk = int(rng.choice([0, 1, 13, 130]))
            q0, _ = take_q(lq)
            tasks.append((q0, lq, k_at, lk, 0))
            k_at += lk
            counts["no_keys" if lk == 0 and lq > 0 else "no_queries" if lq == 0 else "shards"] += 1
            continue
        length = int(rng.choice(lengths))
        k0 = k_at
        k_at += length
        if kind < 0.4 or length == 1:
            q0, _ = take_q(length)
            tasks.append((q0, length, k0, length, 1))
            counts["whole"] += 1
            continue
        num_cuts = int(rng.integers(1, min(length, 6)))
        cuts = np.unique(np.concatenate([[0, length], rng.choice(np.arange(1, length), num_cuts, replace=False)]))
        split = kind >= 0.7
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            q0, sources = take_q(b - a)
            if split and a > 0 and rng.random() < 0.7:
                # Keys [0, b) in parts: non-causal [0, c1), [c1, c2) ..., then causal [c_last, b) with c_last <= a.
                parts = sorted(set(rng.integers(1, a + 1, size=int(rng.integers(1, 3))).tolist()))
                bounds = [0] + parts
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    tasks.append((q0, b - a, k0 + lo, hi - lo, 0))
                    q0, _ = take_q(b - a, sources)   # the next part on a copy of the rows
                    counts["split_parts"] += 1
                tasks.append((q0, b - a, k0 + bounds[-1], b - bounds[-1], 1))
                counts["split_parts"] += 1
            else:
                tasks.append((q0, b - a, k0, b, 1))   # a shard over its key prefix: the document's K/V rows
                counts["shards"] += 1
        if rng.random() < 0.2:   # a causal task with no queries over this document's keys
            q0, _ = take_q(0)
            tasks.append((q0, 0, k0, int(rng.integers(0, length + 1)), 1))
            counts["no_queries"] += 1
    k_at += 1   # one key row no task reads, always
    counts["unread_kv_rows"] += 1
    order = rng.permutation(len(tasks))
    array = np.asarray(tasks, dtype=np.int64).reshape(-1, 5)[order]
    return Server(np.ascontiguousarray(array), q_at, k_at, np.asarray(source, dtype=np.int64), next_source, counts)


def server_inputs(server: Server, hq: int, hkv: int, d: int, dtype, device, seed: int):
    """q, k, v, do in `dtype` on `device` (rows of one source identical), from a float64 draw."""
    gen = torch.Generator().manual_seed(seed)
    q_src, do_src = (torch.randn(server.num_sources, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(server.num_kv, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    index = torch.from_numpy(server.source)
    return [x.to(dtype).to(device).contiguous() for x in (q_src[index], k, v, do_src[index])]


def _task_views(q, k, v, row, group):
    q0, lq, k0, lk, causal = (int(x) for x in row)
    qs, ks = slice(q0, q0 + lq), slice(k0, k0 + lk)
    kt, vt = (x[ks].repeat_interleave(group, dim=1) for x in (k, v))
    allowed = None
    if causal:
        allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    return qs, ks, q[qs], kt, vt, allowed, lk


def _scores(qt, kt, allowed, scale):
    s = torch.einsum("qhd,khd->hqk", qt, kt) * scale
    sa = torch.einsum("qhd,khd->hqk", qt.abs(), kt.abs()) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
        sa = sa.masked_fill(~allowed, 0.0)
    return s, sa


def _probabilities(s, lse):
    """exp(S - LSE) with 0 where a key is masked or the row sees no key (LSE = -inf)."""
    finite = torch.isfinite(lse)[..., None]
    return torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], torch.zeros_like(lse[..., None]))),
                       torch.zeros_like(s))


def reference_forward(q, k, v, tasks: np.ndarray, scale: float, dtype):
    """float64 O [Tq, Hq, D], LSE [Tq, Hq] and their bounds, from float64 copies of the stored inputs."""
    u = UNIT_ROUNDOFF[dtype]
    q, k, v = (x.double() for x in (q, k, v))
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    e_o, e_lse = torch.zeros_like(o), torch.zeros_like(lse)
    for row in tasks:
        qs, _, qt, kt, vt, allowed, n = _task_views(q, k, v, row, group)
        if qt.shape[0] == 0:
            continue
        s, sa = _scores(qt, kt, allowed, scale)
        m = torch.logsumexp(s, dim=-1)                                        # [Hq, Lq]
        p = _probabilities(s, m)
        finite_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e_p = gamma(d) * sa + 3 * U32 * (torch.nan_to_num(s.abs(), posinf=0.0) + finite_m.abs()[..., None]) + 4 * U32
        e_p = torch.where(p > 0, e_p, torch.zeros_like(e_p))
        max_ep = e_p.amax(dim=-1) if n else torch.zeros_like(m)               # [Hq, Lq]
        ot = torch.einsum("hqk,khd->qhd", p, vt)
        oa = torch.einsum("hqk,khd->qhd", p, vt.abs())
        pe = torch.einsum("hqk,khd->qhd", p * e_p, vt.abs())
        o[qs] = ot
        lse[qs] = m.transpose(0, 1)
        has_keys = torch.isfinite(m).transpose(0, 1)
        under = torch.einsum("hqk,khd->qhd", UNDERFLOW[dtype] * (p > 0).double(), vt.abs())   # P rounded for P V
        e_o[qs] = (pe + (u + 2 * gamma(n) + max_ep.transpose(0, 1)[..., None]) * oa + under + u * ot.abs()
                   + UNDERFLOW[dtype] * has_keys[..., None].double())   # O rounded once; a row that sees no key is 0
        e_lse[qs] = torch.where(has_keys, max_ep.transpose(0, 1) + gamma(n) + 2 * U32 * finite_m.abs().transpose(0, 1) + U32,
                                torch.zeros_like(e_lse[qs]))
    return o, lse, e_o, e_lse


def merge_by_source(o, lse, source: np.ndarray, num_sources: int):
    """The LSE rule over the rows of each source (float64): every row gets its source's merged O, LSE."""
    index = torch.from_numpy(source).to(o.device)
    hq = lse.shape[1]
    shift = torch.full((num_sources, hq), float("-inf"), dtype=torch.float64, device=o.device)
    shift.scatter_reduce_(0, index[:, None].expand(-1, hq), lse, "amax", include_self=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w = torch.exp(lse - shift[index])                                          # 0 where lse = -inf
    total = torch.zeros_like(shift).index_add_(0, index, w)
    merged_o = torch.zeros((num_sources,) + tuple(o.shape[1:]), dtype=torch.float64, device=o.device)
    merged_o.index_add_(0, index, w[..., None] * o)
    merged_o = merged_o / total.clamp_min(1e-300)[..., None]
    merged_lse = shift + torch.log(total)
    return merged_o[index], merged_lse[index]


def reference_backward(do, q, k, v, o, lse, tasks: np.ndarray, scale: float, dtype, dkv_rounded: bool):
    """float64 dQ, dK, dV and their bounds, given the O and LSE the kernel is given (merged ones for
    key-split rows). dkv_rounded: the kernel stores dK/dV in `dtype` (else fp32)."""
    u = UNIT_ROUNDOFF[dtype]
    q, k, v, o, do, lse = (x.double() for x in (q, k, v, o, do, lse))
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    group = hq // hkv
    big_m = max(1, int(tasks[:, 1].sum()) * group)   # every query row x head that may sum into a key row
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk, dv = (torch.zeros(k.shape, dtype=torch.float64, device=q.device) for _ in range(2))
    e_dq, e_dk, e_dv = torch.zeros_like(dq), torch.zeros_like(dk), torch.zeros_like(dv)
    fold = lambda x: x.unflatten(1, (hkv, group)).sum(2)  # noqa: E731 ([L, Hq, D] -> [L, Hkv, D])
    for row in tasks:
        qs, ks, qt, kt, vt, allowed, n = _task_views(q, k, v, row, group)
        if qt.shape[0] == 0 or n == 0:
            continue
        dot, ot, lt = do[qs], o[qs], lse[qs].transpose(0, 1)                     # lt [Hq, Lq]
        s, sa = _scores(qt, kt, allowed, scale)
        p = _probabilities(s, lt)
        finite_l = torch.where(torch.isfinite(lt), lt, torch.zeros_like(lt))
        e_p = gamma(d) * sa + 3 * U32 * (torch.nan_to_num(s.abs(), posinf=0.0) + finite_l.abs()[..., None]) + 4 * U32
        pe = p * torch.where(p > 0, e_p, torch.zeros_like(e_p))                   # absolute error of P
        dp = torch.einsum("qhd,khd->hqk", dot, vt)
        dpa = torch.einsum("qhd,khd->hqk", dot.abs(), vt.abs())
        delta = (dot * ot).sum(-1).transpose(0, 1)                               # [Hq, Lq]
        delta_a = (dot.abs() * ot.abs()).sum(-1).transpose(0, 1)
        ds = p * (dp - delta[..., None])
        eta = UNDERFLOW[dtype] * (p > 0).double()                                # P and dS rounded to storage
        e_ds = (pe * (dp - delta[..., None]).abs() + p * gamma(d) * (dpa + delta_a[..., None]) + (U32 + u) * ds.abs()
                + eta)
        dq[qs] = scale * torch.einsum("hqk,khd->qhd", ds, kt)
        e_dq[qs] = scale * (torch.einsum("hqk,khd->qhd", e_ds, kt.abs())
                            + gamma(n) * torch.einsum("hqk,khd->qhd", ds.abs(), kt.abs()))
        e_dq[qs] += u * dq[qs].abs() + UNDERFLOW[dtype]   # dQ rounded to storage once
        dk[ks] += fold(scale * torch.einsum("hqk,qhd->khd", ds, qt))
        e_dk[ks] += fold(scale * (torch.einsum("hqk,qhd->khd", e_ds, qt.abs())
                                  + gamma(big_m) * torch.einsum("hqk,qhd->khd", ds.abs(), qt.abs())))
        dv[ks] += fold(torch.einsum("hqk,qhd->khd", p, dot))
        e_dv[ks] += fold(torch.einsum("hqk,qhd->khd", pe + eta, dot.abs())
                         + (u + gamma(big_m)) * torch.einsum("hqk,qhd->khd", p, dot.abs()))
    if dkv_rounded:
        touched = (e_dk > 0).double()   # key rows some task reads (others must be exactly 0)
        e_dk += u * dk.abs() + UNDERFLOW[dtype] * touched
        e_dv += u * dv.abs() + UNDERFLOW[dtype] * touched
    return dq, dk, dv, e_dq, e_dk, e_dv


def excess(got, truth, bound) -> dict:
    """`got` against `truth` within SLACK x `bound`: the worst |got - truth| / (SLACK bound) where the
    bound is not 0, the elements beyond it (or not equal where it is 0; an inf where the truth is
    finite counts), the NaNs, and whether -inf sits exactly where the truth has it."""
    got, truth, bound = got.double(), truth.double(), bound.double()
    nan = int(torch.isnan(got).sum())
    at_inf = torch.isinf(truth)
    inf_ok = bool(torch.equal(torch.isinf(got) & ~torch.isnan(got), at_inf) and torch.equal(got[at_inf], truth[at_inf]))
    diff = (got[~at_inf] - truth[~at_inf]).abs()
    limit = SLACK * bound[~at_inf]
    off = int((diff > limit).sum())
    scaled = diff[limit > 0] / limit[limit > 0]
    worst = float(scaled.max()) if scaled.numel() else 0.0
    return {"worst_ratio": worst, "off": off, "nan": nan, "inf_ok": inf_ok, "ok": off == 0 and nan == 0 and inf_ok}


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _native_pass(device, is_forward, *args, kernel: str = "distca"):
    """One native call on NaN-filled outputs (args end with dims, tasks, scale, dtype name), then
    synchronize: an element the kernel does not write stays NaN. `kernel`: the CUDA implementation."""
    from distca.torch.kernels import ops
    if device.type == "cuda":
        native = ops.cuda_native(device.index if device.index is not None else torch.cuda.current_device(), kernel)
        call = native.forward if is_forward else native.backward
        call(*args, torch.cuda.current_stream(device).cuda_stream, **({} if is_forward else {"dkv_fp32": True}))
        torch.cuda.synchronize(device)
    else:
        native = ops.cpu_native(0)
        (native.forward if is_forward else native.backward)(*args)


def check_distca_kernels(device, dtype, head_dim: int, seed: int, target_rows: int, hq: int = 8, hkv: int = 2,
                         lengths=LENGTHS, kernel: str = "distca") -> dict:
    """distca's kernels on `device` (CUDA: CudaAttention; CPU: CpuAttention) on one random server
    against the float64 truth within the derived bounds: the native calls on NaN-filled outputs
    (every element written, finite where the truth is, -inf exactly where a row sees no key), the
    key-split parts merged by the LSE rule and the backward given the merged O and LSE, then the
    same through the `distca` backend (its forward equal to the native one bit for bit). On CUDA,
    `kernel` "cudnn" checks cuDNN's kernel (the `cudnn` backend) the same way; its dK/dV are each
    task's rounded to the dtype and then summed, so their bound is that of a rounded result."""
    from distca.torch.kernels.native import CudnnKernel, DistcaKernel
    rng = np.random.default_rng(seed)
    server = random_server(rng, target_rows, lengths)
    q, k, v, do = server_inputs(server, hq, hkv, head_dim, dtype, device, seed)
    tasks, scale, name = server.tasks, head_dim ** -0.5, _DTYPE_NAMES[dtype]
    dims = (server.num_q, server.num_kv, hq, hkv, head_dim)
    nan = float("nan")
    # 1. Forward on NaN-filled O and LSE.
    o = torch.full(q.shape, nan, dtype=dtype, device=device)
    lse = torch.full(q.shape[:2], nan, dtype=torch.float32, device=device)
    _native_pass(device, True, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), dims, tasks,
                 scale, name, kernel=kernel)
    t_o, t_lse, e_o, e_lse = reference_forward(q, k, v, tasks, scale, dtype)
    results = {"O": excess(o, t_o, e_o), "LSE": excess(lse, t_lse, e_lse)}
    # 2. The backward given the merged O and LSE of every query (its parts merged by the LSE rule).
    m_o, m_lse = merge_by_source(t_o, t_lse, server.source, server.num_sources)
    o_in, lse_in = m_o.to(dtype).contiguous(), m_lse.float().contiguous()
    is_cuda = device.type == "cuda"
    dkv_dtype = torch.float32 if is_cuda else dtype
    dq = torch.full(q.shape, nan, dtype=dtype, device=device)
    dk, dv = (torch.full(k.shape, nan, dtype=dkv_dtype, device=device) for _ in range(2))
    _native_pass(device, False, q.data_ptr(), k.data_ptr(), v.data_ptr(), o_in.data_ptr(), lse_in.data_ptr(),
                 do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dims, tasks, scale, name, kernel=kernel)
    truth = reference_backward(do, q, k, v, o_in, lse_in, tasks, scale, dtype,
                               dkv_rounded=not is_cuda or kernel == "cudnn")
    for key, got, want, bound in zip(("dQ", "dK", "dV"), (dq, dk, dv), truth[:3], truth[3:]):
        results[key] = excess(got, want, bound)
    # 3. The same through the backend (the custom operators).
    backend = CudnnKernel() if kernel == "cudnn" else DistcaKernel()
    b_o, b_lse = backend.forward_tasks(q, k, v, tasks, scale)
    results["backend O, LSE equal native"] = {"ok": bool(torch.equal(b_o, o) and torch.equal(b_lse, lse))}
    b_grads = backend.backward_tasks(do, q, k, v, o_in, lse_in, tasks, scale)
    for key, got, want, bound in zip(("backend dQ", "backend dK", "backend dV"), b_grads, truth[:3], truth[3:]):
        results[key] = excess(got, want, bound)
    return {"device": str(device), "kernel": kernel, "dtype": name, "head_dim": head_dim, "heads": [hq, hkv], "seed": seed,
            "tasks": int(len(tasks)), "q_rows": server.num_q, "kv_rows": server.num_kv, "counts": server.counts,
            "results": results, "ok": all(r["ok"] for r in results.values())}
