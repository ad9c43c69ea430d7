#!/usr/bin/env bash
# Quick start (2): installs dependencies, builds, installs the Python package, and runs the whole
# test suite: ctest (C++) and pytest (the Python package), then the aarch64 kernels under qemu and
# the parsers under libFuzzer. Each part prints how long it took; the last line sums them.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
timings=()
part() {  # part NAME COMMAND...: runs it and records its wall time
  local name="$1" t0=$SECONDS
  shift
  "$@"
  timings+=("$name $((SECONDS - t0)) s")
  echo "test.sh: $name took $((SECONDS - t0)) s"
}
part install-deps scripts/install-deps.sh
part build scripts/build.sh
part install-python scripts/install-python.sh
part ctest ctest --test-dir build --output-on-failure -j "$(nproc)"
# The Python package's tests (pytest, on every core: pytest-xdist), after the C++ suite: they compare
# with the distca binary.
part pytest .venv/bin/python -m pytest -q -p no:cacheprovider -n "$(nproc)" python/tests
# The CPU kernels' aarch64 build (NEON) against the reference under qemu-user (about 2 minutes).
part aarch64 scripts/test-aarch64.sh --quick
# The file parsers under libFuzzer for a fixed time (about a minute, after its own clang build in build-fuzz/).
part fuzz scripts/fuzz.sh
echo "test.sh: all passed in $((SECONDS - start)) s ($(IFS=,; echo "${timings[*]}" | sed 's/,/, /g'))"
