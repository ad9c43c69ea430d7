"""The per-rank metadata is sufficient: a NumPy program that uses only each rank's RankLayout
(gather, an all-to-all simulated by concatenation, a varlen causal / non-causal attention per
server driven by cu_seqlens, return, scatter, LSE merge; the backward the same way) reproduces
whole-document attention and its gradients, in float64, for random batches and every policy."""
from __future__ import annotations

import numpy as np
import pytest

import distca
from sizes import soak

HQ, HKV, D = 4, 2, 8
GROUP = HQ // HKV
SCALE = 1.0 / np.sqrt(D)
# What the planners price: a model wide enough that these short documents' attention outweighs the
# per-task overhead, so that the planners move work and minbytes splits key ranges as they do on
# long documents at real widths. The layout addresses rows only; the data below has HQ x D.
MODEL = {"layers": 1, "hidden": 4096, "heads": 512, "kv_heads": 64, "head_dim": 512, "ffn_hidden": 4096}
NUM_BATCHES = soak(100, 200)   # random batches a policy (the quick ones are the soak's first)
TOLERANCE = 1e-10


# ----- the reference: whole documents -----------------------------------------------------------

def scores(q, k, v, causal):
    """Scaled scores [HQ, Lq, Lk] (masked: -inf; causal is bottom-right aligned) and K, V with
    their heads repeated for GQA."""
    kk, vv = np.repeat(k, GROUP, axis=1), np.repeat(v, GROUP, axis=1)
    s = (q.transpose(1, 0, 2) @ kk.transpose(1, 2, 0)) * SCALE  # [H, Lq, Lk]
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = np.arange(lk)[None, :] > (lk - lq + np.arange(lq))[:, None]
        s = np.where(mask[None], -np.inf, s)
    return s, kk, vv


def attention(q, k, v, causal):
    """q [Lq, HQ, D], k/v [Lk, HKV, D]. Returns o, lse, p."""
    s, _, vv = scores(q, k, v, causal)
    m = s.max(axis=2, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=2, keepdims=True)))[..., 0]  # [H, Lq]
    p = np.exp(s - lse[..., None])
    return (p @ vv.transpose(1, 0, 2)).transpose(1, 0, 2), lse.T, p


def attention_backward(q, k, v, o, lse, d_o, causal):
    """Gradients of one task given the final (merged) O and LSE of its rows: the softmax of a
    key-split row is over all its keys, so P = exp(S - lse) and D = rowsum(dO * O) use the merged
    ones."""
    s, kk, vv = scores(q, k, v, causal)
    p = np.exp(s - lse.T[..., None])
    dp = d_o.transpose(1, 0, 2) @ vv.transpose(1, 2, 0)  # [H, Lq, Lk]
    delta = (d_o * o).sum(axis=2).T[..., None]  # [H, Lq, 1]
    ds = p * (dp - delta)
    dq = (ds @ kk.transpose(1, 0, 2)).transpose(1, 0, 2) * SCALE
    dk = (ds.transpose(0, 2, 1) @ q.transpose(1, 0, 2)).transpose(1, 0, 2) * SCALE
    dv = (p.transpose(0, 2, 1) @ d_o.transpose(1, 0, 2)).transpose(1, 0, 2)
    fold = lambda x: x.reshape(x.shape[0], HKV, GROUP, D).sum(axis=2)  # noqa: E731 (GQA: heads of a kv head)
    return dq, fold(dk), fold(dv)


# ----- the distributed program: only RankLayout arrays ------------------------------------------

def all_to_all(sends, send_splits, recv_splits):
    """sends[r] split by send_splits[r]; rank r receives every rank's chunk for r, in rank order."""
    num = len(sends)
    chunks = [np.split(sends[r], np.cumsum(send_splits[r])[:-1]) for r in range(num)]
    out = []
    for r in range(num):
        parts = [chunks[s][r] for s in range(num)]
        assert [len(p) for p in parts] == list(recv_splits[r]), "send and receive splits disagree"
        out.append(np.concatenate(parts) if parts else sends[r][:0])
    return out


def varlen(meta, q_var, k_var, v_var):
    """The server's two varlen calls: causal tasks, then the non-causal ones."""
    o = np.zeros_like(q_var)
    lse = np.zeros(q_var.shape[:2])
    for group, q_off, k_off, causal in ((meta.causal, 0, 0, True),
                                         (meta.noncausal, meta.causal_q_rows, meta.causal_kv_rows, False)):
        for i in range(group.num_tasks):
            qs = slice(q_off + group.cu_seqlens_q[i], q_off + group.cu_seqlens_q[i + 1])
            ks = slice(k_off + group.cu_seqlens_k[i], k_off + group.cu_seqlens_k[i + 1])
            assert qs.stop - qs.start <= group.max_seqlen_q and ks.stop - ks.start <= group.max_seqlen_k
            o[qs], lse[qs], _ = attention(q_var[qs], k_var[ks], v_var[ks], causal)
    return o, lse


def varlen_backward(meta, q_var, k_var, v_var, o_var, lse_var, do_var):
    dq, dk, dv = np.zeros_like(q_var), np.zeros_like(k_var), np.zeros_like(v_var)
    for group, q_off, k_off, causal in ((meta.causal, 0, 0, True),
                                         (meta.noncausal, meta.causal_q_rows, meta.causal_kv_rows, False)):
        for i in range(group.num_tasks):
            qs = slice(q_off + group.cu_seqlens_q[i], q_off + group.cu_seqlens_q[i + 1])
            ks = slice(k_off + group.cu_seqlens_k[i], k_off + group.cu_seqlens_k[i + 1])
            dq[qs], dk[ks], dv[ks] = attention_backward(q_var[qs], k_var[ks], v_var[ks], o_var[qs], lse_var[qs],
                                                        do_var[qs], causal)
    return dq, dk, dv


def merge(meta, out_ret, lse_ret, o, lse):
    """Owner: copy unsplit rows, LSE-merge the partials of key-split rows."""
    o[meta.copy_rows] = out_ret[meta.copy_entries]
    lse[meta.copy_rows] = lse_ret[meta.copy_entries]
    if len(meta.merge_entries):
        rows, parts, part_lse = meta.merge_rows, out_ret[meta.merge_entries], lse_ret[meta.merge_entries]
        top = np.full(lse.shape, -np.inf)
        np.maximum.at(top, rows, part_lse)
        w = np.exp(part_lse - top[rows])
        total = np.zeros(lse.shape)
        np.add.at(total, rows, w)
        acc = np.zeros(o.shape)
        np.add.at(acc, rows, w[..., None] * parts)
        unique = np.unique(rows)
        o[unique] = acc[unique] / total[unique][..., None]
        lse[unique] = top[unique] + np.log(total[unique])


def run_cad(metas, q, k, v, d_o):
    """Forward and backward over all ranks; q/k/v/d_o are per-rank local arrays."""
    ranks = range(len(metas))
    # Forward dispatch.
    q_recv = all_to_all([q[r][m.q_send_index] for r, m in enumerate(metas)],
                        [m.q_send_splits for m in metas], [m.q_recv_splits for m in metas])
    kv_sends = [np.stack([k[r][m.kv_send_index], v[r][m.kv_send_index]], axis=1) for r, m in enumerate(metas)]
    kv_recv = all_to_all(kv_sends, [m.kv_send_splits for m in metas], [m.kv_recv_splits for m in metas])
    # Servers.
    saved = []
    out_sends, lse_sends = [], []
    for r, m in enumerate(metas):
        q_var, k_var, v_var = q_recv[r][m.q_gather], kv_recv[r][m.kv_gather, 0], kv_recv[r][m.kv_gather, 1]
        o_var, lse_var = varlen(m, q_var, k_var, v_var)
        saved.append((q_var, k_var, v_var))
        out_send, lse_send = np.zeros_like(q_recv[r]), np.zeros(q_recv[r].shape[:2])
        out_send[m.q_gather], lse_send[m.q_gather] = o_var, lse_var
        out_sends.append(out_send)
        lse_sends.append(lse_send)
    # Return and merge.
    back = [m.splits("fwd_return")["out"] for m in metas]
    out_ret = all_to_all(out_sends, [b[0] for b in back], [b[1] for b in back])
    lse_ret = all_to_all(lse_sends, [b[0] for b in back], [b[1] for b in back])
    o = [np.full_like(q[r], np.nan) for r in ranks]
    lse = [np.full(q[r].shape[:2], np.nan) for r in ranks]
    for r, m in enumerate(metas):
        merge(m, out_ret[r], lse_ret[r], o[r], lse[r])

    # Backward dispatch: dO with the merged O and LSE, as Q went.
    pack = [np.concatenate([d_o[r], o[r], lse[r][..., None].repeat(D, axis=2)], axis=1)[m.q_send_index]
            for r, m in enumerate(metas)]
    recv = all_to_all(pack, [m.q_send_splits for m in metas], [m.q_recv_splits for m in metas])
    dq_sends, dkv_sends = [], []
    for r, m in enumerate(metas):
        var = recv[r][m.q_gather]
        do_var, o_var, lse_var = var[:, :HQ], var[:, HQ:2 * HQ], var[:, 2 * HQ:, 0]
        dq_var, dk_var, dv_var = varlen_backward(m, *saved[r], o_var, lse_var, do_var)
        dq_send = np.zeros_like(q_recv[r])
        dq_send[m.q_gather] = dq_var
        dkv_send = np.zeros_like(kv_recv[r])
        np.add.at(dkv_send, m.kv_gather, np.stack([dk_var, dv_var], axis=1))
        dq_sends.append(dq_send)
        dkv_sends.append(dkv_send)
    dq_split = [m.splits("bwd_return")["dq"] for m in metas]
    dkv_split = [m.splits("bwd_return")["dkv"] for m in metas]
    dq_ret = all_to_all(dq_sends, [s[0] for s in dq_split], [s[1] for s in dq_split])
    dkv_ret = all_to_all(dkv_sends, [s[0] for s in dkv_split], [s[1] for s in dkv_split])
    dq, dk, dv = [np.zeros_like(x) for x in q], [np.zeros_like(x) for x in k], [np.zeros_like(x) for x in v]
    for r, m in enumerate(metas):
        np.add.at(dq[r], m.q_send_index, dq_ret[r])
        np.add.at(dk[r], m.kv_send_index, dkv_ret[r][:, 0])
        np.add.at(dv[r], m.kv_send_index, dkv_ret[r][:, 1])
    return o, lse, dq, dk, dv


# ----- random batches ---------------------------------------------------------------------------

def random_batch(rng):
    """Per-rank documents, or documents packed across ranks; short and long ones."""
    num_ranks = int(rng.integers(1, 6))
    if rng.random() < 0.5:
        ranks = []
        for _ in range(num_ranks):
            count = int(rng.integers(1, 6))
            lengths = rng.integers(1, 40, size=count)
            if rng.random() < 0.4:
                lengths[rng.integers(count)] = rng.integers(100, 300)
            ranks.append([int(x) for x in lengths])
        return ranks
    tokens = int(rng.integers(32, 200))
    lengths = [int(x) for x in rng.integers(1, 2 * tokens, size=3 * num_ranks)]
    # More tokens than fit: pack fills the ranks and cuts the rest (overflow="cut"), as a data
    # loader does, so documents span ranks.
    return distca.pack(lengths, num_ranks, tokens, overflow="cut")


def local_rows(batch):
    """Document lengths, and per rank the global row (document offset + position) of each local
    row: the documents' tokens laid end to end."""
    b = batch.to_dict()
    lengths = b["doc_lengths"]
    offset = np.concatenate([[0], np.cumsum(lengths)])
    rows = [[] for _ in range(b["num_ranks"])]
    for doc, begin, end, rank in b["pieces"]:
        rows[rank].append(np.arange(offset[doc] + begin, offset[doc] + end))
    return lengths, offset, [np.concatenate(r) if r else np.zeros(0, np.int64) for r in rows]


def check_batch(rng, batch, policy, stats):
    plan = distca.plan(batch, policy=policy, model=MODEL,
                       **({} if policy in ("none", "distca") else {"granularity": 16}))
    assert plan.verify()
    metas = [plan.for_rank(r) for r in range(plan.num_ranks)]
    lengths, offset, rows = local_rows(plan.batch)
    total = int(offset[-1])
    gq, gdo = rng.standard_normal((total, HQ, D)), rng.standard_normal((total, HQ, D))
    gk, gv = rng.standard_normal((total, HKV, D)), rng.standard_normal((total, HKV, D))
    ranks = range(plan.num_ranks)
    o, lse, dq, dk, dv = run_cad(metas, [gq[rows[r]] for r in ranks], [gk[rows[r]] for r in ranks],
                                 [gv[rows[r]] for r in ranks], [gdo[rows[r]] for r in ranks])

    # Reference, whole documents, laid end to end as the data.
    ref = {name: np.zeros_like(x) for name, x in (("O", gq), ("dQ", gq), ("dK", gk), ("dV", gk))}
    ref["LSE"] = np.zeros((total, HQ))
    for d in range(len(lengths)):
        s = slice(offset[d], offset[d + 1])
        ro, rlse, _ = attention(gq[s], gk[s], gv[s], causal=True)
        ref["O"][s], ref["LSE"][s] = ro, rlse
        ref["dQ"][s], ref["dK"][s], ref["dV"][s] = attention_backward(gq[s], gk[s], gv[s], ro, rlse, gdo[s], causal=True)
    for r in ranks:
        for name, got in (("O", o), ("LSE", lse), ("dQ", dq), ("dK", dk), ("dV", dv)):
            want = ref[name][rows[r]]
            if want.size == 0:
                continue
            err = float(np.abs(got[r] - want).max()) / max(1.0, float(np.abs(want).max()))
            assert err <= TOLERANCE, f"{policy} rank {r} {name}: relative error {err:.3e}"
            stats["max_error"] = max(stats["max_error"], err)

    # The layout moves exactly the bytes the plan counts (self rows excluded: they stay on the rank).
    hq, hkv, d = MODEL["heads"], MODEL["kv_heads"], MODEL["head_dim"]
    q_bytes, kv_bytes, out_bytes = hq * d * 2, 2 * hkv * d * 2, hq * d * 2 + hq * 4
    send = plan.traffic["fwd_dispatch"]["send_bytes"]
    ret = plan.traffic["fwd_return"]["recv_bytes"]
    for r, m in enumerate(metas):
        others = np.arange(plan.num_ranks) != r
        assert send[r] == q_bytes * m.q_send_splits[others].sum() + kv_bytes * m.kv_send_splits[others].sum()
        assert ret[r] == out_bytes * m.q_send_splits[others].sum()
    stats["split_plans"] += any(len(m.merge_entries) for m in metas)
    stats["noncausal_tasks"] += sum(m.noncausal.num_tasks for m in metas)
    stats["cross_rank_plans"] += any((m.q_send_splits[np.arange(plan.num_ranks) != m.rank] > 0).any() for m in metas)


@pytest.mark.parametrize("policy", ["none", "distca", "minmax", "minbytes"])
def test_metadata_reproduces_whole_document_attention(policy):
    rng = np.random.default_rng({"none": 1, "distca": 2, "minmax": 3, "minbytes": 4}[policy])
    batch_rng = np.random.default_rng(2026)  # the same batches for every policy
    stats = {"max_error": 0.0, "split_plans": 0, "noncausal_tasks": 0, "cross_rank_plans": 0}
    for _ in range(NUM_BATCHES):
        check_batch(rng, random_batch(batch_rng), policy, stats)
    print(f"{policy}: {NUM_BATCHES} batches, max relative error {stats['max_error']:.2e}, "
          f"{stats['cross_rank_plans']} plans move work across ranks, {stats['split_plans']} split key ranges")
    # The test is not vacuous: the balancing policies move work, and minbytes splits key ranges.
    if policy != "none":
        assert stats["cross_rank_plans"] > NUM_BATCHES // 4
    if policy == "minbytes":
        assert stats["split_plans"] > NUM_BATCHES // 10 and stats["noncausal_tasks"] > NUM_BATCHES // 10, stats


def test_layout_of_a_rank_outside_the_plan_is_refused():
    plan = distca.plan([[64], [16, 16]], model=MODEL, granularity=16)
    with pytest.raises(ValueError, match="outside"):
        plan.for_rank(2)
