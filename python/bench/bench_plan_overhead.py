#!/usr/bin/env python3
"""What the Python binding adds to a plan call at 512 ranks.

Acceptance criterion: a Python `distca.plan` call at 512 ranks costs <= 1.2x the C++ plan time
plus 1 ms. Each batch is read once into a distca.Batch (file parsing is not timed); then every
call `distca.plan(batch, policy=p)` is timed with time.perf_counter and compared with two C++
baselines the call measures itself:

  native_ms  all of the call's C++ work (request checks, baseline load, planning, verification,
             per-layer times), timed inside C++: the wall time minus native_ms is what Python and
             the binding add;
  plan_ms    the planner alone (a stricter baseline: it leaves out the verification and pricing
             that distca.plan always does).

The criterion python_ms <= 1.2 x C++ + 1 is checked per call and on the medians, against each
baseline. A benchmark, not a test: it exits 0 whatever the numbers.

The batches are the shared reference ones: $DISTCA_SHARED_DATA/reference/batch_*.json (default
<repo>/../shared/data/reference).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import distca

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BATCHES = ["prolong_r512", "wlbllm_r512"]
DEFAULT_POLICIES = ["distca", "minmax", "minbytes"]
FACTOR = 1.2
SLACK_MS = 1.0


def shared_data() -> Path:
    return Path(distca.knobs.get("DISTCA_SHARED_DATA") or REPO.parent / "shared" / "data")


def resolve_batch(name: str) -> tuple[str, Path]:
    """A reference batch by name (prolong, wlbllm: the 512-rank ones; or prolong_r64, batch_wlbllm_r512,
    ...), or a batch file's path."""
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path.stem, path
    stem = name if name.startswith("batch_") else f"batch_{name}"
    if "_r" not in stem[len("batch_"):]:
        stem += "_r512"
    path = shared_data() / "reference" / f"{stem}.json"
    if not path.is_file():
        raise SystemExit(f"bench_plan_overhead: no batch {name!r}: {path} not found "
                         f"(set DISTCA_SHARED_DATA to the shared data folder, or give a batch file's path)")
    return stem[len("batch_"):], path


def meets(python_ms: float, cpp_ms: float) -> bool:
    return python_ms <= FACTOR * cpp_ms + SLACK_MS


def measure(batch: Any, policy: str, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        plan = distca.plan(batch, policy=policy)
        del plan
    python_ms, native_ms, plan_ms = [], [], []
    tasks = None
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        plan = distca.plan(batch, policy=policy)
        wall = (time.perf_counter() - start) * 1e3
        python_ms.append(wall)
        native_ms.append(plan.native_ms)
        plan_ms.append(plan.plan_ms)
        tasks = len(plan.tasks)
        del plan  # freed outside the timed region
    med_python = statistics.median(python_ms)
    med_native = statistics.median(native_ms)
    med_plan = statistics.median(plan_ms)
    per_call_native = [meets(p, n) for p, n in zip(python_ms, native_ms)]
    per_call_plan = [meets(p, q) for p, q in zip(python_ms, plan_ms)]
    return {
        "policy": policy,
        "tasks": tasks,
        "python_ms": python_ms,
        "native_ms": native_ms,
        "plan_ms": plan_ms,
        "median_python_ms": med_python,
        "median_native_ms": med_native,
        "median_plan_ms": med_plan,
        "overhead_ms": [p - n for p, n in zip(python_ms, native_ms)],
        "median_overhead_ms": statistics.median(p - n for p, n in zip(python_ms, native_ms)),
        "median_overhead_vs_plan_ms": statistics.median(p - q for p, q in zip(python_ms, plan_ms)),
        "native_criterion": {
            "baseline": "native_ms",
            "per_call_met": sum(per_call_native),
            "per_call_total": len(per_call_native),
            "all_calls_met": all(per_call_native),
            "median_met": meets(med_python, med_native),
            "median_bound_ms": FACTOR * med_native + SLACK_MS,
        },
        "plan_criterion": {
            "baseline": "plan_ms",
            "per_call_met": sum(per_call_plan),
            "per_call_total": len(per_call_plan),
            "all_calls_met": all(per_call_plan),
            "median_met": meets(med_python, med_plan),
            "median_bound_ms": FACTOR * med_plan + SLACK_MS,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Times distca.plan at 512 ranks against the C++ time the call reports (native_ms: all "
                    "of its C++ work; plan_ms: the planner alone) and checks the acceptance criterion "
                    f"python_ms <= {FACTOR} x C++ ms + {SLACK_MS:g} ms against each.")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per batch and policy (default 9)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls first, per batch and policy (default 1)")
    parser.add_argument("--batch", action="append", metavar="NAME",
                        help="a reference batch (prolong, wlbllm = their 512-rank files; or prolong_r64, ...) "
                             "or a batch file's path; repeatable (default: prolong and wlbllm, 512 ranks)")
    parser.add_argument("--policy", action="append", choices=distca.planner_names(),
                        help="repeatable (default: distca, minmax, minbytes)")
    parser.add_argument("--json", metavar="FILE", help="also write the full report (every call's times) here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    batches = [resolve_batch(b) for b in (args.batch or DEFAULT_BATCHES)]
    policies = args.policy or DEFAULT_POLICIES

    results = []
    for name, path in batches:
        batch = distca._distca.batch_from_file(str(path), 0)  # parsed once, outside the timing
        for policy in policies:
            r = measure(batch, policy, args.repeats, args.warmup)
            results.append({"batch": name, "path": str(path), "ranks": batch.num_ranks,
                            "documents": batch.num_docs, **r})

    criterion = f"python_ms <= {FACTOR} x cpp_ms + {SLACK_MS:g} ms"
    print(f"distca.plan binding overhead: {args.repeats} timed call(s) each after {args.warmup} warm-up; "
          f"medians in ms; criterion {criterion}")
    header = (f"{'batch':<14} {'policy':<9} {'ranks':>5} {'python':>8} {'native':>8} {'plan':>8} "
              f"{'py-nat':>7} {'py-plan':>8} {'vs native: calls/median':>24} {'vs plan: calls/median':>22}")
    print(header)
    print("-" * len(header))
    for r in results:
        n, p = r["native_criterion"], r["plan_criterion"]
        vs_native = f"{n['per_call_met']}/{n['per_call_total']} {'yes' if n['median_met'] else 'NO'}"
        vs_plan = f"{p['per_call_met']}/{p['per_call_total']} {'yes' if p['median_met'] else 'NO'}"
        print(f"{r['batch']:<14} {r['policy']:<9} {r['ranks']:>5} {r['median_python_ms']:>8.3f} "
              f"{r['median_native_ms']:>8.3f} {r['median_plan_ms']:>8.3f} {r['median_overhead_ms']:>7.3f} "
              f"{r['median_overhead_vs_plan_ms']:>8.3f} {vs_native:>24} {vs_plan:>22}")

    def summary(key: str) -> dict:
        return {
            "baseline": results[0][key]["baseline"] if results else key,
            "all_medians_met": all(r[key]["median_met"] for r in results),
            "all_calls_met": all(r[key]["all_calls_met"] for r in results),
            "calls_met": sum(r[key]["per_call_met"] for r in results),
            "calls": sum(r[key]["per_call_total"] for r in results),
        }

    summaries = {"native": summary("native_criterion"), "plan": summary("plan_criterion")}
    print()
    for label, s, what in (("native_ms", summaries["native"], "all of the call's C++ work"),
                           ("plan_ms", summaries["plan"], "the planner alone")):
        verdict = "HOLDS" if s["all_medians_met"] else "DOES NOT HOLD"
        print(f"C++ baseline = {label} ({what}): criterion {verdict} on the medians "
              f"(every batch and policy); per call {s['calls_met']}/{s['calls']} met.")

    if args.json:
        report = {
            "benchmark": "bench_plan_overhead",
            "criterion": criterion,
            "factor": FACTOR,
            "slack_ms": SLACK_MS,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "timer": "time.perf_counter around distca.plan(batch, policy=p); batch parsed beforehand",
            "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                        "cpus": os.cpu_count(), "distca": distca.__version__},
            "results": results,
            "summary": summaries,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
