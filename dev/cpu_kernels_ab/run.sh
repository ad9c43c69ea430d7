#!/usr/bin/env bash
# run.sh OLD_KERNELS_DIR NEW_KERNELS_DIR [ISA]: both builds, interleaved, on 4K and 16K-token
# documents, D 64 and 128, 1 and 2 threads (DISTCA_CPU_ISA=ISA for the new tree where given).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mktemp -d)"
"$here/build.sh" "$1" "$out/old"
"$here/build.sh" "$2" "$out/new"
for t in 1 2; do
  for d in 64 128; do
    for n in 4096 16384; do
      reps=$([ "$n" -gt 4096 ] && echo 1 || echo 5)
      for round in 1 2; do
        echo "old: $("$out/old" "$n" "$d" "$t" "$reps")"
        echo "new: $(DISTCA_CPU_ISA=${3:-} "$out/new" "$n" "$d" "$t" "$reps")"
      done
    done
  done
done
rm -rf "$out"
