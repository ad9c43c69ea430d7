#!/usr/bin/env bash
# Quick start (2): installs dependencies, builds, installs the Python package, and runs the whole
# test suite: ctest (C++) and pytest (the Python package), then the aarch64 kernels under qemu and
# the parsers under libFuzzer. Each part prints how long it took; the last line sums them.
#   scripts/test.sh          the suite (what CI runs)
#   scripts/test.sh --long   the soak sizes: more steps and random cases in the matrix tests
#                            (DISTCA_TEST_LONG=1), every aarch64 kernel test, 60 s of fuzzing a parser
set -euo pipefail
cd "$(dirname "$0")/.."
aarch64_args=(--quick)
fuzz_args=()
case "${1:-}" in
  "") ;;
  --long)
    export DISTCA_TEST_LONG=1
    aarch64_args=()
    fuzz_args=(--seconds 60) ;;
  -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "test.sh: unknown argument '$1' (known: --long, --help)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "test.sh: one argument at most, got $#" >&2; exit 2; fi
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
# The packages from PyPI (PyTorch's 3 GB: network and disk more than CPU) install beside the C++
# build; the virtual environment is made first, so that the build's fetch of cudnn-frontend finds
# it whole. distca's own module is built after both, from build/.
scripts/install-python.sh --venv-only
mkdir -p build
scripts/install-python.sh --deps-only >build/install-python-deps.log 2>&1 &
deps_pid=$!
trap 'kill "$deps_pid" 2>/dev/null || true' EXIT  # a failed build leaves no pip behind
python_package() {  # waits for the PyPI packages, then installs distca
  if ! wait "$deps_pid"; then
    cat build/install-python-deps.log
    echo "test.sh: installing the Python packages from PyPI failed (log above, also in build/install-python-deps.log)" >&2
    return 1
  fi
  scripts/install-python.sh
}
part build scripts/build.sh
part install-python python_package
part ctest ctest --test-dir build --output-on-failure -j "$(nproc)"
# The Python package's tests (pytest, on every core: pytest-xdist), after the C++ suite: they compare
# with the distca binary.
part pytest .venv/bin/python -m pytest -q -p no:cacheprovider -n "$(nproc)" python/tests
# The CPU kernels' aarch64 build (NEON) against the reference under qemu-user, a shard per core.
part aarch64 scripts/test-aarch64.sh "${aarch64_args[@]}"
# The file parsers under libFuzzer for a fixed time, a target per core (after its own clang build in build-fuzz/).
part fuzz scripts/fuzz.sh "${fuzz_args[@]}"
echo "test.sh: all passed in $((SECONDS - start)) s ($(IFS=,; echo "${timings[*]}" | sed 's/,/, /g'))"
