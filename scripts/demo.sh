#!/usr/bin/env bash
# Quick start (1): installs dependencies, builds, and runs the main job on its embedded default:
# `distca train --preset demo --compare` on 2 MPI ranks: the same Llama-style model trained
# with colocated and with CAD core attention, step by step interleaved on the same data, ending
# with a table of step times, straggler waits and the speedup (JSON in build/train-demo.json).
# Extra arguments go to `distca train` (e.g. --steps 10).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh >/dev/null
# OpenBLAS misdetects some AVX-512 CPUs (this one among them) and picks a slower kernel family.
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}; fi
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  ./build/src/tools/distca train --preset demo --compare --json build/train-demo.json "$@"
