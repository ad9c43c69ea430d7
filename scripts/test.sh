#!/usr/bin/env bash
# Quick start (2): installs dependencies, builds, installs the Python package, and runs the whole
# test suite: ctest (C++) and pytest (the Python package).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
scripts/install-python.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
# The Python package's tests (pytest), after the C++ suite: they compare with the distca binary.
.venv/bin/python -m pytest -q -p no:cacheprovider python/tests
# The CPU kernels' aarch64 build (NEON) against the reference under qemu-user (about 2 minutes).
scripts/test-aarch64.sh --quick
# The file parsers under libFuzzer for a fixed time (about a minute, after its own clang build in build-fuzz/).
scripts/fuzz.sh
