#!/usr/bin/env python3
"""Writes tiny_forward.json: a small Llama-style model, packed documents, and the logits and mean
loss of an independent NumPy implementation (dense masked attention per document, no task
lists). The C++ model must reproduce them (tests/model/model_test.cc). Needs numpy.

    python3 tests/model/make_golden.py   # from the repository root
"""
import json
import os

import numpy as np

cfg = dict(vocab_size=13, d_model=12, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=6,
           ffn_dim=20, rope_base=10000.0, norm_eps=1e-5, init_std=0.3, init_seed=1, parameters=0)
V, d, L, Hq, Hkv, D, F = (cfg[k] for k in ("vocab_size", "d_model", "num_layers", "num_q_heads",
                                          "num_kv_heads", "head_dim", "ffn_dim"))
rng = np.random.default_rng(2026)
params = {"embed": rng.normal(0, 0.3, (V, d))}
for l in range(L):
    p = f"layers.{l}."
    params[p + "attn_norm"] = 1 + 0.2 * rng.normal(size=d)
    params[p + "wq"] = rng.normal(0, 0.3, (d, Hq * D))
    params[p + "wk"] = rng.normal(0, 0.3, (d, Hkv * D))
    params[p + "wv"] = rng.normal(0, 0.3, (d, Hkv * D))
    params[p + "wo"] = rng.normal(0, 0.3, (Hq * D, d))
    params[p + "mlp_norm"] = 1 + 0.2 * rng.normal(size=d)
    params[p + "w_gate"] = rng.normal(0, 0.3, (d, F))
    params[p + "w_up"] = rng.normal(0, 0.3, (d, F))
    params[p + "w_down"] = rng.normal(0, 0.3, (F, d))
params["final_norm"] = 1 + 0.2 * rng.normal(size=d)
params["lm_head"] = rng.normal(0, 0.3, (d, V))
cfg["parameters"] = int(sum(v.size for v in params.values()))

doc_lengths = [6, 1, 9, 4]
tokens = rng.integers(0, V, sum(doc_lengths))


def rmsnorm(x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg["norm_eps"]) * g


def rope(x, pos):  # x [L, H, D]; rotate halves by pos * base^(-2j/D)
    j = np.arange(D // 2)
    ang = pos[:, None] * cfg["rope_base"] ** (-2.0 * j / D)  # [L, D/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(q, k, v):  # one document: q [n, Hq, D], k/v [n, Hkv, D]
    n = q.shape[0]
    rep = Hq // Hkv
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v)


x = params["embed"][tokens]
starts = np.cumsum([0] + doc_lengths)
pos = np.concatenate([np.arange(n) for n in doc_lengths]).astype(float)
for l in range(L):
    p = lambda name: params[f"layers.{l}.{name}"]
    h = rmsnorm(x, p("attn_norm"))
    q = rope((h @ p("wq")).reshape(-1, Hq, D), pos)
    k = rope((h @ p("wk")).reshape(-1, Hkv, D), pos)
    v = (h @ p("wv")).reshape(-1, Hkv, D)
    o = np.concatenate([attention(q[a:b], k[a:b], v[a:b]) for a, b in zip(starts[:-1], starts[1:])])
    x = x + o.reshape(-1, Hq * D) @ p("wo")
    h = rmsnorm(x, p("mlp_norm"))
    g = h @ p("w_gate")
    x = x + ((g / (1 + np.exp(-g))) * (h @ p("w_up"))) @ p("w_down")
logits = rmsnorm(x, params["final_norm"]) @ params["lm_head"]
losses = []
for a, b in zip(starts[:-1], starts[1:]):
    for i in range(a, b - 1):  # no target for a document's last token
        z = logits[i]
        losses.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[tokens[i + 1]])

out = dict(model=cfg, doc_lengths=doc_lengths, tokens=tokens.tolist(), loss=float(np.mean(losses)),
           logits=logits.ravel().tolist(), params={k: v.ravel().tolist() for k, v in params.items()},
           made_by="tests/model/make_golden.py")
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_forward.json")
with open(path, "w") as f:
    json.dump(out, f)
    f.write("\n")
print(f"wrote {path}: {len(tokens)} tokens, loss {out['loss']:.6f}")
