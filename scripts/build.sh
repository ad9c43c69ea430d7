#!/usr/bin/env bash
# Configures and builds distca (Release, Ninja) into build/. Ninja prints one progress line per
# file ([done/total]); the configure summary says which optional parts are built.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
# With nvcc, the CUDA build also compiles the cuDNN attention kernel: it needs cudnn-frontend's headers
# (fetched once into build/cudnn-frontend; without them CMake leaves the kernel out and says so).
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  scripts/cudnn-frontend.sh || echo "build.sh: cudnn-frontend's headers not fetched: the cuDNN kernel is left out" >&2
fi
if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTCA_BUILD_TESTS=ON -DDISTCA_BUILD_BENCH=ON \
    >build/configure.log 2>&1; then
  cat build/configure.log
  echo "build.sh: configure failed (full log above, also in build/configure.log)" >&2
  exit 1
fi
grep -E "^-- (distca|  )" build/configure.log || true
cmake --build build -j "$(nproc)"
