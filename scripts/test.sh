#!/usr/bin/env bash
# Quick start (2): installs dependencies, builds, installs the Python package, and runs the whole
# test suite: ctest (C++) and pytest (the Python package), with the aarch64 kernels under qemu beside
# them, then the parsers under libFuzzer. Each part prints how long it took; the last line sums them
# (the aarch64+fuzz-build part is what was left of that background work when pytest ended).
#   scripts/test.sh          the suite (what CI runs)
#   scripts/test.sh --long   the soak sizes: more steps and random cases in the matrix tests
#                            (DISTCA_TEST_LONG=1), every aarch64 kernel test, 60 s of fuzzing a parser
set -euo pipefail
cd "$(dirname "$0")/.."
aarch64_args=(--quick)
fuzz_args=(--seconds 5)
case "${1:-}" in
  "") ;;
  --long)
    export DISTCA_TEST_LONG=1
    aarch64_args=()
    fuzz_args=(--seconds 60) ;;
  -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "test.sh: unknown argument '$1' (known: --long, --help)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "test.sh: one argument at most, got $#" >&2; exit 2; fi
start=$SECONDS
kill_tree() {  # a process and everything it started (none: nothing)
  local child
  [ -n "$1" ] || return 0
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
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
# it whole (python-deps: what was left of it when the build ended). distca's own module is built
# after both, from build/.
scripts/install-python.sh --venv-only
mkdir -p build
scripts/install-python.sh --deps-only >build/install-python-deps.log 2>&1 &
deps_pid=$!
trap 'kill_tree "$deps_pid"' EXIT  # a failed part leaves nothing running
python_deps() {  # waits for the PyPI packages
  local rc=0
  wait "$deps_pid" || rc=$?
  deps_pid=""  # reaped: its number may be reused
  if [ "$rc" -ne 0 ]; then
    cat build/install-python-deps.log
    echo "test.sh: installing the Python packages from PyPI failed (log above, also in build/install-python-deps.log)" >&2
    return 1
  fi
}
part build scripts/build.sh
# Work that counts work, not time, runs at the lowest priority beside install-python, ctest and
# pytest, on the CPU time they leave idle (install-python builds the module on one core, ranks wait
# on each other, test hosts wait on timeouts): the aarch64 kernels' build and tests (qemu-user, a
# shard per core) and the fuzz targets' clang build. At nice 19 it yields to the tests; ctest took about 45 s longer beside it (210-214 s against 165 s alone),
# where the work took about 150 s after pytest before, and 28-54 s now. Fuzzing runs for a fixed
# time, so it runs last, alone.
background_log=build/test-background.log
(
  nice -n 19 scripts/test-aarch64.sh "${aarch64_args[@]}" && echo "test.sh: aarch64 passed" &&
    nice -n 19 scripts/fuzz.sh --build-only
) >"$background_log" 2>&1 &
background_pid=$!
trap 'kill_tree "$deps_pid"; kill_tree "$background_pid"' EXIT
# distca's own package installs beside ctest (pip builds the module in build/, on one core, target
# _distca only: nothing ctest runs is relinked), so ctest does not wait for it; pytest does. Its
# part below is what was left of it when ctest ended.
part python-deps python_deps
python_log=build/install-python.log
(
  t0=$SECONDS
  rc=0
  scripts/install-python.sh || rc=$?
  echo "test.sh: the Python package's install took $((SECONDS - t0)) s, beside ctest"
  exit "$rc"
) >"$python_log" 2>&1 &
python_pid=$!
trap 'kill_tree "$deps_pid"; kill_tree "$background_pid"; kill_tree "$python_pid"' EXIT
python_wait() {  # what is left of the package's install, then its output
  local rc=0
  wait "$python_pid" || rc=$?
  python_pid=""
  cat "$python_log"
  return "$rc"
}
part ctest ctest --test-dir build --output-on-failure -j "$(nproc)"
part install-python python_wait
# The Python package's tests (pytest, on every core: pytest-xdist), after the C++ suite: they compare
# with the distca binary.
part pytest .venv/bin/python -m pytest -q -p no:cacheprovider -n "$(nproc)" --dist loadgroup python/tests
background() {  # what is left of the background work, then its output
  local rc=0
  wait "$background_pid" || rc=$?
  background_pid=""
  cat "$background_log"
  if [ "$rc" -ne 0 ]; then
    echo "test.sh: the aarch64 tests or the fuzz build failed (exit $rc; log above, also in $background_log)" >&2
  fi
  return "$rc"
}
part aarch64+fuzz-build background
# The file parsers under libFuzzer for a fixed time, a target per core.
part fuzz scripts/fuzz.sh "${fuzz_args[@]}"
echo "test.sh: all passed in $((SECONDS - start)) s ($(IFS=,; echo "${timings[*]}" | sed 's/,/, /g'))"
