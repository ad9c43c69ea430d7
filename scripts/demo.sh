#!/usr/bin/env bash
# Quick start (1): installs dependencies, builds, and runs the main job on a built-in default:
# `distca plan` on the pretrain workload, 64 ranks x 128K tokens, every policy side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh >/dev/null
./build/src/tools/distca plan --ranks 64 --tokens-per-rank 131072 --workload pretrain --policy all --tolerance 0.02 "$@"
