#!/usr/bin/env bash
# Fuzzes every file parser for a fixed time (libFuzzer, AddressSanitizer, UndefinedBehaviorSanitizer):
#   1. configures build-fuzz/ with clang (-O1, line tables, sanitizers on all library code) and
#      builds only the fuzz targets of tests/fuzz and the layers they link;
#   2. per target (one per core at a time), replays tests/fuzz/crashes/<name>/ (inputs that once
#      crashed: each must now pass), then fuzzes for --seconds over the committed corpus
#      tests/fuzz/corpus/<name>/ (read only; new inputs go to build-fuzz/fuzz/<name>/corpus/, kept
#      between runs);
#   3. prints per target the executions, coverage and features, and exits 1 if any target
#      crashed, leaked, timed out or ran out of memory, naming the reproducer.
# A reproducer runs again with: build-fuzz/tests/fuzz/fuzz_<name> <file>.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/fuzz.sh [--seconds N] [--targets a,b,...] [--build-only] [--help]

Builds the libFuzzer targets in build-fuzz/ (clang, -O1, ASan + UBSan) and runs each one:
first over tests/fuzz/crashes/<name>/ (past crashes, each run once), then for N seconds over
tests/fuzz/corpus/<name>/. Exits 1 on any crash, leak, timeout or out-of-memory, printing the
reproducer's path (under build-fuzz/fuzz/<name>/).

  --seconds N     fuzzing time per target (default 10)
  --targets LIST  comma-separated targets (default: all of batch,doc_lengths,profile,plan,checkpoint,data)
  --build-only    configure and build, fuzz nothing
  --help          this text
EOF
}

seconds=10
build_only=0
all_targets=(batch doc_lengths profile plan checkpoint data)
targets=("${all_targets[@]}")
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds)
      [ $# -ge 2 ] || { echo "fuzz.sh: --seconds needs a value" >&2; exit 2; }
      seconds="$2"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    --targets)
      [ $# -ge 2 ] || { echo "fuzz.sh: --targets needs a value" >&2; exit 2; }
      IFS=, read -r -a targets <<<"$2"; shift 2 ;;
    --targets=*) IFS=, read -r -a targets <<<"${1#*=}"; shift ;;
    --build-only) build_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: --seconds must be a whole number >= 1, got '$seconds'" >&2
  exit 2
fi
for t in "${targets[@]}"; do
  case " ${all_targets[*]} " in
    *" $t "*) ;;
    *) echo "fuzz.sh: no target '$t' (known: ${all_targets[*]})" >&2; exit 2 ;;
  esac
done
for tool in clang clang++; do
  command -v "$tool" >/dev/null || { echo "fuzz.sh: $tool not found; run scripts/install-deps.sh" >&2; exit 1; }
done

# 1. Configure and build. -O1 keeps the targets fast without the compile time of -O2/-O3; line
# tables (not full -g) give file:line in stack traces at a fraction of the debug-info cost; no
# NDEBUG, so assertions (nlohmann's among them) stay on.
build="build-fuzz"
sanitizers="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
start=$SECONDS
mkdir -p "$build"
if ! CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
    -DCMAKE_CXX_FLAGS="$sanitizers" \
    -DDISTCA_BUILD_FUZZ=ON -DDISTCA_BUILD_TESTS=OFF -DDISTCA_BUILD_BENCH=OFF -DDISTCA_BUILD_PYTHON=OFF \
    >"$build/configure.log" 2>&1; then
  cat "$build/configure.log"
  echo "fuzz.sh: configure failed (log above, also in $build/configure.log)" >&2
  exit 1
fi
cmake --build "$build" --target distca_fuzz -j "$(nproc)"
echo "fuzz.sh: configure and build took $((SECONDS - start)) s"
if [ "$build_only" = 1 ]; then exit 0; fi

# 2. Run. Stack traces name file:line through llvm-symbolizer (llvm-14's, beside clang).
symbolizer="$(dirname "$(readlink -f "$(command -v clang++)")")/llvm-symbolizer"
if [ -x "$symbolizer" ]; then export ASAN_SYMBOLIZER_PATH="$symbolizer"; fi
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
# One target per core at a time (each fuzzes for the whole --seconds on a core of its own; libFuzzer
# runs one process on one thread): 6 targets take 3 x --seconds on 2 cores instead of 6 x.
# fuzz_one writes its summary line to $work/summary and its status to $work/status.
fuzz_one() {
  local t="$1" bin="$build/tests/fuzz/fuzz_$1" work="$build/fuzz/$1"
  mkdir -p "$work/corpus" "$work/artifacts"
  local log="$work/fuzz.log" status=0 f
  : >"$log"
  : >"$work/summary"
  # Past crashes: libFuzzer runs each file given as an argument once.
  local crashes=()
  if [ -d "tests/fuzz/crashes/$t" ]; then
    while IFS= read -r -d '' f; do crashes+=("$f"); done < <(find "tests/fuzz/crashes/$t" -type f ! -name '.*' -print0 | sort -z)
  fi
  # Each file on its own, so that every past crash that crashes again is named, not only the first.
  : >"$work/regress.log"
  for f in "${crashes[@]}"; do
    if ! "$bin" -rss_limit_mb=2048 -timeout=10 "$f" >"$work/regress-one.log" 2>&1; then
      cat "$work/regress-one.log" >>"$work/regress.log"
      tail -n 40 "$work/regress-one.log"
      echo "fuzz.sh: $t: the past crash $f crashes again (log above, all in $work/regress.log)" >&2
      status=1
      printf '%-12s REGRESSION: %s crashes again\n' "$t" "$f" >>"$work/summary"
    fi
  done
  local rc=0
  "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$work/artifacts/" "$work/corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  local execs rate cov ft line reproducer
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  line=$(printf '%-12s %9s execs (%s/s)  cov %s  ft %s  regressions %d' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" \
         "${ft:-?}" ${#crashes[@]})
  if [ "$rc" -ne 0 ]; then
    reproducer=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
    tail -n 60 "$log"
    echo "fuzz.sh: $t FAILED (exit $rc); reproducer: ${reproducer:-none written, see $log}" >&2
    echo "fuzz.sh: rerun it with: $bin ${reproducer:-<file>}; minimise it with: $bin -minimize_crash=1 -runs=10000 ${reproducer:-<file>}" >&2
    status=1
    line="$line  FAILED: ${reproducer:-$log}"
  fi
  echo "$line" >>"$work/summary"
  echo "fuzz.sh: $line"
  echo "$status" >"$work/status"
}

jobs_max=$(nproc)
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs_max" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  mkdir -p "$build/fuzz/$t"
  rm -f "$build/fuzz/$t/status" "$build/fuzz/$t/summary"
  fuzz_one "$t" &
  running=$((running + 1))
done
wait

failed=()
summary=()
for t in "${targets[@]}"; do
  work="$build/fuzz/$t"
  # A target whose job died before writing its status failed.
  if [ "$(cat "$work/status" 2>/dev/null)" != 0 ]; then failed+=("$t"); fi
  if [ -f "$work/summary" ]; then
    while IFS= read -r line; do summary+=("$line"); done <"$work/summary"
  else
    summary+=("$(printf '%-12s FAILED: its job ended before writing a summary' "$t")")
  fi
done

echo "fuzz.sh: summary ($seconds s per target, $jobs_max at a time; logs in $build/fuzz/<target>/fuzz.log)"
printf '  %s\n' "${summary[@]}"
echo "fuzz.sh: total $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: FAILED: $(printf '%s\n' "${failed[@]}" | sort -u | tr '\n' ' ')" >&2
  exit 1
fi
