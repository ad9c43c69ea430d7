#!/usr/bin/env bash
# Configures and builds distca (Release, Ninja) into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTCA_BUILD_TESTS=ON -DDISTCA_BUILD_BENCH=ON
cmake --build build -j "$(nproc)"
