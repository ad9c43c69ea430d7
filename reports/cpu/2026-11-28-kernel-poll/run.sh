#!/usr/bin/env bash
# run.sh: CAD alone on the demo (12 steps, 2 MPI ranks), interleaved rounds of: ping-pong
# with the server kernel polling MPI (this change), ping-pong without that poll (before it; this
# run's build switched it off with DISTCA_NO_KERNEL_POLL=1, the temporary patch poll-off.diff),
# and ping-pong off; then the means over steps 2-12 of each, per round and over the rounds.
# ROUNDS (default 6) rounds; SUMMARY_ONLY=1: only the summary, from the JSON files here.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
out=$(cd "$(dirname "$0")" && pwd)
rounds=${ROUNDS:-6}
for r in $(seq "$rounds"); do
  [ -z "${SUMMARY_ONLY:-}" ] || break
  for v in "poll:" "nopoll:-x DISTCA_NO_KERNEL_POLL=1" "ppoff:--pingpong off"; do
    n=${v%%:*}; a=${v#*:}; x=""; t=""
    case "$a" in -x*) x=$a ;; *) t=$a ;; esac
    # shellcheck disable=SC2086  # $x and $t: zero or two words
    mpirun -q --allow-run-as-root --oversubscribe --bind-to none $x -np 2 "$root/build/src/tools/distca" train \
      --preset demo --attention cad --steps 12 $t --json "$out/$n-$r.json" >/dev/null
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
for n in ("poll", "nopoll", "ppoff"):
    cells, means, comms = [], [], []
    for r in range(1, int(sys.argv[2]) + 1):
        steps = [s for s in json.load(open(f"{sys.argv[1]}/{n}-{r}.json"))["steps"] if s["step"] >= 2]
        mean = lambda k: statistics.mean(s[k] for s in steps)  # noqa: E731
        means.append(mean("step_seconds"))
        comms.append(mean("comm_seconds"))
        cells.append(f"step {mean('step_seconds'):.3f} comm {mean('comm_seconds'):.3f} "
                     f"attn {mean('attention_seconds'):.3f} linear {mean('linear_seconds'):.3f}")
    print(f"{n:7s}", " | ".join(cells),
          f"| over the rounds: step {statistics.mean(means):.3f}, comm {statistics.mean(comms):.3f}")
PY
