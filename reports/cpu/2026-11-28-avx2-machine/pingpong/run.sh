#!/usr/bin/env bash
# run.sh: CAD alone on the demo (12 steps), three rounds of ping-pong on (the default, progress
# poll), off, and on with a progress thread, interleaved; then the means over steps 2-12 of each.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../../.." && pwd)
out=$(cd "$(dirname "$0")" && pwd)
for r in 1 2 3; do
  for v in "default:" "ppoff:--pingpong off" "thread:--progress thread"; do
    n=${v%%:*}; a=${v#*:}
    # shellcheck disable=SC2086  # $a: zero or two words
    mpirun -q --allow-run-as-root --oversubscribe --bind-to none -np 2 "$root/build/src/tools/distca" train \
      --preset demo --attention cad --steps 12 $a --json "$out/$n-$r.json" >/dev/null
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
for n in ("default", "ppoff", "thread"):
    cells = []
    for r in (1, 2, 3):
        steps = [s for s in json.load(open(f"{sys.argv[1]}/{n}-{r}.json"))["steps"] if s["step"] >= 2]
        mean = lambda k: statistics.mean(s[k] for s in steps)  # noqa: E731
        cells.append(f"step {mean('step_seconds'):.3f} comm {mean('comm_seconds'):.3f} "
                     f"attn {mean('attention_seconds'):.3f} linear {mean('linear_seconds'):.3f}")
    print(f"{n:8s}", " | ".join(cells))
PY
