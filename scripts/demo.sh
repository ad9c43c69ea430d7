#!/usr/bin/env bash
# Quick start (1): installs dependencies, builds, installs the Python package (.venv), and runs the main job on its embedded default:
# `distca train --preset demo --compare` on 2 MPI ranks: the same Llama-style model trained
# with colocated and with CAD core attention, step by step interleaved on the same data, ending
# with a table of step times, straggler waits and the speedup (JSON in build/train-demo.json).
# Extra arguments go to `distca train` (e.g. --steps 10).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== demo 1/3: dependencies (Debian packages; a first install takes a few minutes)"
scripts/install-deps.sh
echo "== demo 2/3: build (a first build takes 5-7 minutes on 2 cores, then the Python package with PyTorch 2-3 more; later runs seconds)"
scripts/build.sh
scripts/install-python.sh
# OpenBLAS misdetects some AVX-512 CPUs (this one among them); distca re-executes itself with the
# right kernel family, so nothing needs setting here.
echo "== demo 3/3: mpirun -np 2 distca train --preset demo --compare (2-3 minutes on 2 cores)"
# -q: mpirun adds no banner of its own when a rank reports an error (distca prints it once).
exec mpirun -q --allow-run-as-root --oversubscribe --bind-to none -np 2 \
  ./build/src/tools/distca train --preset demo --compare --json build/train-demo.json "$@"
