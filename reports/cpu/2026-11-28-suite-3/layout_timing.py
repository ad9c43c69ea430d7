"""distca.Plan.for_rank at 512 ranks from Python: every 8th rank of the shipped prolong batch.
    .venv/bin/python reports/cpu/2026-11-28-suite-3/layout_timing.py [policy]   (default minlink)
"""
import os
import sys
import time

import distca

REFERENCE = os.environ.get("DISTCA_SHARED_DATA", os.path.join(os.path.dirname(__file__), "../../../../shared/data"))
p = os.path.join(REFERENCE, "reference", "batch_prolong_r512.json")
plan = distca.plan(p, policy=sys.argv[1] if len(sys.argv) > 1 else "minlink")
t = time.perf_counter()
for r in range(0, plan.num_ranks, 8):
    plan.for_rank(r)
print(plan.policy, len(plan.tasks), "tasks: ms per layout", (time.perf_counter() - t) * 1e3 / (plan.num_ranks // 8))
