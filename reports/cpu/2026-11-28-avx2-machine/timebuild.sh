#!/usr/bin/env bash
# timebuild.sh DIR ON|OFF: a fresh configure and build of this checkout in DIR (removed first; give
# it a scratch folder), with the flags of scripts/build.sh and DISTCA_PRECOMPILED_HEADERS set, on
# every core. Prints the build's wall and CPU time; the logs are DIR.cfg.log and DIR.build.log, and
# DIR.steps.txt lists each ninja step's seconds, longest first.
set -euo pipefail
[ $# -eq 2 ] && [[ $2 == ON || $2 == OFF ]] || { echo "usage: timebuild.sh DIR ON|OFF" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../../.." && pwd)
rm -rf "$1"
cmake -S "$root" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTCA_BUILD_TESTS=ON -DDISTCA_BUILD_BENCH=ON \
  -DDISTCA_PRECOMPILED_HEADERS="$2" >"$1.cfg.log" 2>&1
/usr/bin/time -f "$1 pch=$2 build %e s wall %U user %S sys" ninja -C "$1" -j "$(nproc)" >"$1.build.log" 2>&1
tail -n 1 "$1.build.log"
awk 'NR > 1 { printf "%.1f %s\n", ($2 - $1) / 1000, $4 }' "$1/.ninja_log" | sort -rn >"$1.steps.txt"
