"""Ping-pong's bytes and balance on batches drawn from ../shared/data: the split before this change
(git show fe49ffe:python/distca/torch/nanobatch.py, rows kept together, passed as OLD) against
distca.torch.split_plan, both on the same plans. Bytes: what every rank sends to the others in one
layer (llama-8b's Hq 32, Hkv 8, D 128, bf16 inputs, stateful, fp32 dK/dV return), all phases,
counted from each nano-batch's layout (the C++ route every PartLayout is built from).

    .venv/bin/python reports/cpu/2026-11-27-bench-link-torch/split_bytes.py OLD.py > split_bytes.json
"""
import importlib.util
import json
import sys

import numpy as np

import distca
from distca import _distca
from distca.torch import split_plan
from distca.torch.nanobatch import _task_pairs

HQ, HKV, D, E = 32, 8, 128, 2
Q_ROW = HQ * D * E + (HQ * D * E + HQ * 4) + (2 * HQ * D * E + HQ * 4) + HQ * D * E   # per Q entry, 4 phases
KV_ROW = 2 * HKV * D * E + 2 * HKV * D * 4                                            # per K/V entry


def layer_bytes(batch, parts) -> int:
    total = 0
    for tasks in parts:
        m = np.ascontiguousarray(tasks).view(np.int64).reshape(-1, 6)
        for r in range(batch.num_ranks):
            d = _distca.partial_layout(batch, m, r)
            q, kv = np.asarray(d["q_send_splits"]), np.asarray(d["kv_send_splits"])
            total += int(q.sum() - q[r]) * Q_ROW + int(kv.sum() - kv[r]) * KV_ROW
    return total


def stages(plan_tasks, parts, num_ranks) -> float:
    """Each nano-batch's busiest server's pairs, summed, over the whole plan's busiest."""
    whole = np.bincount(plan_tasks["server"], weights=_task_pairs(plan_tasks), minlength=num_ranks).max()
    return float(sum(np.bincount(p["server"], weights=_task_pairs(p), minlength=num_ranks).max() for p in parts) / whole)


spec = importlib.util.spec_from_file_location("distca.torch._old_nanobatch", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
rows = []
for seed in range(3):
    rng = np.random.default_rng(seed)
    for family in ("wlbllm", "prolong"):
        lengths = json.load(open(f"../shared/data/dist_{family}.json"))
        for ranks, tokens in ((4, 131072), (8, 65536), (16, 32768), (32, 16384)):
            batch = distca.pack([int(x) for x in rng.choice(lengths, size=4000)], ranks, tokens, overflow="cut")
            plan = distca.plan(batch)
            tasks = plan.tasks
            whole = layer_bytes(batch, [tasks])
            old_parts = [tasks[i] for i in old.split_tasks(tasks, ranks)]
            split = split_plan(tasks, batch, tolerance=plan.tolerance)
            rows.append({"family": family, "seed": seed, "ranks": ranks, "tokens_per_rank": tokens,
                         "tolerance": plan.tolerance, "whole_bytes": whole,
                         "old_bytes_ratio": layer_bytes(batch, old_parts) / whole,
                         "old_stages_over_whole": stages(tasks, old_parts, ranks),
                         "new_bytes_ratio": layer_bytes(batch, split.parts) / whole,
                         "new_stages_over_whole": stages(tasks, split.parts, ranks),
                         "new_cuts": split.num_cuts, "new_level_over_cap": split.level / split.cap,
                         "new_extra_kv_rows": split.extra_kv_rows, "new_remote_kv_rows": split.remote_kv_rows})
            r = rows[-1]
            print(f"{family:8s} seed {seed} {ranks:3d} ranks: bytes old {r['old_bytes_ratio']:.3f} new "
                  f"{r['new_bytes_ratio']:.3f}; stages old {r['old_stages_over_whole']:.3f} new "
                  f"{r['new_stages_over_whole']:.3f}; level {r['new_level_over_cap']:.3f}", file=sys.stderr)
summary = {k: max(r[k] for r in rows) for k in ("old_bytes_ratio", "new_bytes_ratio", "old_stages_over_whole",
                                                 "new_stages_over_whole")}
summary["batches"] = len(rows)
summary["new_reaching_cap"] = sum(r["new_level_over_cap"] == 1.0 for r in rows)
print(json.dumps({"what": "ping-pong split: bytes and attention stages, old split against split_plan",
                  "max": summary, "batches": rows}, indent=1))
