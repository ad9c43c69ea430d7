"""One CAD (core attention disaggregation) attention layer in PyTorch, driven only by distca's
per-rank metadata, forward and backward, checked against whole-document attention.

Run (2 processes, gloo on CPU), from the repository root:

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 --redirects 2 --tee 2 \
        examples/torch_cad_attention.py

(Debian's torch 1.13 installs no `torchrun` script and spells its flags with underscores; under
Python 3.11 its launcher cannot parse the default --redirects/--tee value 0 and stops with
"AttributeError: 'NoneType' object has no attribute 'get'", so pass a nonzero one: 2 tees the
workers' stderr to the console through a log file and leaves stdout as it is. A newer torch
takes `torchrun --nproc-per-node 2 examples/torch_cad_attention.py`.)

Each rank owns the rows of its documents (or document pieces). distca.plan() decides which rank
(the "server") computes which (query rows x key rows) block of each document; Plan.for_rank(rank)
turns that into index arrays and split sizes for torch.distributed.all_to_all_single. The layer:
  owner:  gather Q and K/V rows to send        -> all_to_all (dispatch)
  server: gather each task's rows, run causal and non-causal attention, keep O and LSE
          -> all_to_all back (return)
  owner:  copy rows computed whole, LSE-merge rows whose keys were split over several tasks.
Backward is autograd through the same graph: the all_to_all's gradient is the all_to_all with
the splits swapped. Every rank builds the same global data, so each can check its own rows.
"""
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distca

# Query heads, kv heads (GQA: query head h reads kv head h // (HQ // HKV)), head dim. The planner
# prices a task with a fixed overhead besides its FLOPs, so with much smaller heads minbytes would
# never find a key split worth its cost at these lengths.
HQ, HKV, D = 8, 2, 64
MODEL = {"heads": HQ, "kv_heads": HKV, "head_dim": D, "layers": 1, "hidden": HQ * D, "ffn_hidden": 4 * HQ * D}
TOLERANCE = 1e-4  # max relative error (max abs error / max abs reference), fp32
warnings.filterwarnings("ignore", message="scatter_reduce\\(\\) is in beta")  # torch 1.13


def exchange(splits, tensors):
    """all_to_all_single over dim 0 of each tensor, with its (input, output) split sizes."""
    outs = []
    for x, (send, recv) in zip(tensors, splits):
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send)
        outs.append(out)
    return tuple(outs)


class AllToAll(torch.autograd.Function):
    """Differentiable exchange(): the gradient goes back by the reverse exchange (splits swapped).
    One autograd node moves all its tensors, so every rank runs the backward collectives in the
    same order (separate nodes could become ready in a different order on different ranks)."""

    @staticmethod
    def forward(ctx, splits, *tensors):
        ctx.back = [(recv, send) for send, recv in splits]
        return exchange(splits, tensors)

    @staticmethod
    def backward(ctx, *grads):  # unused outputs arrive as zeros (materialized grads)
        return (None,) + exchange(ctx.back, grads)


def attention(q, k, v, causal):
    """q [Lq, HQ, D], k/v [Lk, HKV, D] -> (o [Lq, HQ, D], lse [Lq, HQ]); causal is bottom-right
    aligned: query j sees keys [0, Lk - Lq + j]. Plain differentiable ops (what a varlen kernel does)."""
    k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                       # [HQ, Lq]
    o = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v)
    return o, lse.transpose(0, 1)


def server_attention(meta, q_var, k_var, v_var):
    """Runs the rank's causal tasks, then its non-causal ones, over the gathered rows."""
    # Starting from empty slices of q_var keeps a server with no tasks in the autograd graph,
    # so every rank takes part in the backward all-to-alls.
    outs, lses = [q_var[:0]], [q_var[:0, :, 0]]
    for group, q0, k0, causal in ((meta.causal, 0, 0, True),
                                  (meta.noncausal, meta.causal_q_rows, meta.causal_kv_rows, False)):
        cq, ck = group.cu_seqlens_q.tolist(), group.cu_seqlens_k.tolist()
        for i in range(group.num_tasks):
            o, lse = attention(q_var[q0 + cq[i]:q0 + cq[i + 1]], k_var[k0 + ck[i]:k0 + ck[i + 1]],
                               v_var[k0 + ck[i]:k0 + ck[i + 1]], causal)
            outs.append(o)
            lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def cad_attention(meta, q, k, v):
    """q [N, HQ, D], k/v [N, HKV, D]: this rank's rows -> o [N, HQ, D] for its rows."""
    t = lambda a: torch.from_numpy(a)  # noqa: E731 (distca's index arrays are int64 NumPy)
    q_splits = (meta.q_send_splits.tolist(), meta.q_recv_splits.tolist())
    kv_splits = (meta.kv_send_splits.tolist(), meta.kv_recv_splits.tolist())
    # Owner: pick the rows each server needs (a row may go to several servers), K and V stacked.
    q_send = q[t(meta.q_send_index)]
    kv_send = torch.stack((k, v), dim=1)[t(meta.kv_send_index)]   # [rows, 2, HKV, D]
    q_recv, kv_recv = AllToAll.apply([q_splits, kv_splits], q_send, kv_send)
    # Server: lay the received rows out task by task and compute.
    q_var = q_recv[t(meta.q_gather)]
    kv_var = kv_recv[t(meta.kv_gather)]
    o_var, lse_var = server_attention(meta, q_var, kv_var[:, 0], kv_var[:, 1])
    # Return: results go back to the rank that sent the query rows (the Q splits swapped).
    gather = t(meta.q_gather)
    o_send = q_recv.new_zeros(q_recv.shape).index_copy(0, gather, o_var)
    lse_send = q_recv.new_zeros(q_recv.shape[:2]).index_copy(0, gather, lse_var)
    back = (q_splits[1], q_splits[0])
    o_ret, lse_ret = AllToAll.apply([back, back], o_send, lse_send)  # entry m answers q_send_index[m]
    # Owner: rows computed by one task are copied; partial results of key-split rows are merged
    # by the LSE rule: lse = logsumexp_m lse_m, o = sum_m exp(lse_m - lse) * o_m.
    out = q.new_zeros(q.shape).index_add(0, t(meta.copy_rows), o_ret[t(meta.copy_entries)])
    if len(meta.merge_entries):
        rows, entries = t(meta.merge_rows), t(meta.merge_entries)
        part_o, part_lse = o_ret[entries], lse_ret[entries]      # [entries, HQ, D], [entries, HQ]
        idx = rows[:, None].expand(-1, HQ)
        # A per-row shift keeps exp() in range (detached: the result does not depend on it).
        shift = part_lse.new_full((q.shape[0], HQ), -float("inf")).scatter_reduce(
            0, idx, part_lse.detach(), "amax", include_self=False)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        lse = torch.log(torch.zeros_like(shift).index_add(0, rows, torch.exp(part_lse - shift[rows]))) + shift
        weight = torch.exp(part_lse - lse[rows])                  # [entries, HQ]
        out = out.index_add(0, rows, weight[..., None] * part_o)
    return out


def reference(q, k, v, do):
    """Whole-document causal attention and its gradients (PyTorch's SDPA where available)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    kr, vr = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))  # GQA: kv head per query head
    qh, kh, vh = (x.transpose(0, 1) for x in (q, kr, vr))              # [H, L, D]
    if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)
    else:  # torch 1.13: the same math, written out
        mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
        p = torch.softmax((qh @ kh.transpose(1, 2) / D ** 0.5).masked_fill(mask, float("-inf")), dim=-1)
        o = (p @ vh).transpose(0, 1)
    return (o.detach(),) + torch.autograd.grad(o, (q, k, v), do)


def run_case(rank, batch, policy, data, ref):
    granularity = 16 if policy in ("minmax", "minbytes") else None  # none/distca take no granularity
    plan = distca.plan(batch, policy=policy, tolerance=0.05, granularity=granularity, model=MODEL)
    meta = plan.for_rank(rank)
    # This rank's rows: its pieces (doc, begin, end, rank), in order, concatenated.
    pieces = [p for p in plan.batch.to_dict()["pieces"].tolist() if p[3] == rank]
    local = lambda ts: torch.cat([ts[d][b:e] for d, b, e, _ in pieces])  # noqa: E731
    q, k, v = (local(x).requires_grad_() for x in data[:3])
    assert q.shape[0] == meta.num_local_rows
    copies, merges = (np.bincount(a, minlength=q.shape[0]) for a in (meta.copy_rows, meta.merge_rows))
    assert (((copies == 1) & (merges == 0)) | ((copies == 0) & (merges > 0))).all(), \
        "every local row is either copied once or merged"
    out = cad_attention(meta, q, k, v)
    out.backward(local(data[3]))
    errors, merged = [], torch.tensor([float(len(meta.merge_entries))])
    for got, want in zip((out, q.grad, k.grad, v.grad), ref):
        want = local(want)
        stats = torch.tensor([(got - want).abs().max().item(), want.abs().max().item()])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        errors.append(stats[0].item() / stats[1].item())
    dist.all_reduce(merged)
    return errors, int(merged.item())


def fmt(errors):
    return ", ".join(f"{name} {e:.1e}" for name, e in zip(("O", "dQ", "dK", "dV"), errors))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "the batches below are laid out for 2 ranks"
    batches = {
        "long+short [[1024], [64]]": [[1024], [64]],                    # minbytes splits keys on rank 0
        "spanning pack([1800, 100])": distca.pack([1800, 100], 2, 1024),  # doc 0 on both ranks
    }
    if rank == 0:
        sdpa = hasattr(F, "scaled_dot_product_attention")
        print("reference:", "torch.nn.functional.scaled_dot_product_attention" if sdpa
              else f"softmax attention written out (torch {torch.__version__} has no SDPA)")
    worst, cases, merged_total = [0.0] * 4, 0, 0
    for b, (name, batch) in enumerate(batches.items()):
        doc_lengths = (batch.to_dict()["doc_lengths"].tolist() if isinstance(batch, distca.Batch)
                       else [n for r in batch for n in r])
        gen = torch.Generator().manual_seed(1234 + b)  # the same global data on every rank
        data = [[torch.randn(n, h, D, generator=gen) for n in doc_lengths] for h in (HQ, HKV, HKV, HQ)]
        refs = [reference(*(x[d] for x in data)) for d in range(len(doc_lengths))]
        ref = [[r[i] for r in refs] for i in range(4)]  # O, dQ, dK, dV per document
        for policy in distca.planner_names():
            errors, merged = run_case(rank, batch, policy, data, ref)
            worst = [max(a, e) for a, e in zip(worst, errors)]
            cases, merged_total = cases + 1, merged_total + merged
            if rank == 0:
                print(f"{name:28s} {policy:9s} merged entries {merged:5d}  relative error {fmt(errors)}", flush=True)
    assert merged_total > 0, "no plan split a row's keys: the LSE merge went untested"
    summary = f"max relative error {fmt(worst)} (tolerance {TOLERANCE:.0e})"
    if max(worst) > TOLERANCE:
        raise SystemExit(f"torch_cad_attention: FAILED: {summary}")
    if rank == 0:
        print(f"torch_cad_attention: ok: {cases} cases, {summary}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
