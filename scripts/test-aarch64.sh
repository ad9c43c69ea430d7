#!/usr/bin/env bash
# The CPU attention kernels' tests on aarch64: the portable build (NEON there) cross-compiled with
# Debian's g++-aarch64-linux-gnu into build-aarch64/ and run under qemu-aarch64 (qemu-user), so
# the ARM build is checked for correctness on an x86-64 machine. Its speed is not measured here
# (qemu emulates).
#   scripts/test-aarch64.sh           every kernel test (about 8 minutes under emulation on 2 cores)
#   scripts/test-aarch64.sh --quick   the build against the reference on every shape but the largest
#                                     (shards128_mha8_d128: 35 s of emulation; MHA and shards
#                                     sharing K/V stay covered by d32 and the others) and bf16 but on
#                                     primes_gqa4_d128 (20 s of the 78 s left; bf16 stays checked on
#                                     d32, d64 and d256, head dim 128 in fp32), the choice of build
#                                     and bit-identity across threads (what scripts/test.sh runs,
#                                     beside ctest and pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
filter="*"
case "${1:-}" in
  "") ;;
  --quick) filter="CpuVsReference.*:Shapes/CpuVsReference.*:CpuAttention.*:CpuIsa.*-*/shards128_mha8_d128:*Bf16MatchesDoubleReference/primes_gqa4_d128" ;;
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "test-aarch64.sh: unknown argument '$1' (--quick, --help)" >&2; exit 2 ;;
esac
for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
  if ! command -v "$tool" >/dev/null; then
    echo "test-aarch64.sh: $tool is missing: run scripts/install-deps.sh (g++-aarch64-linux-gnu, qemu-user)" >&2
    exit 1
  fi
done
mkdir -p build-aarch64
if ! cmake -S tests/cross -B build-aarch64 -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$PWD/tests/cross/aarch64.cmake" >build-aarch64/configure.log 2>&1; then
  cat build-aarch64/configure.log
  echo "test-aarch64.sh: configure failed (log above, also in build-aarch64/configure.log)" >&2
  exit 1
fi
cmake --build build-aarch64 -j "$(nproc)"
readelf -h build-aarch64/kernels_cpu_test_aarch64 | grep -q "AArch64" || {
  echo "test-aarch64.sh: build-aarch64/kernels_cpu_test_aarch64 is not an aarch64 binary" >&2
  exit 1
}
# The tests in one shard per core (GoogleTest's sharding: each test runs in exactly one shard), so
# the emulation takes every core; each shard's output is printed when it ends.
shards=$(nproc)
pids=()
for ((i = 0; i < shards; ++i)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i qemu-aarch64 build-aarch64/kernels_cpu_test_aarch64 --gtest_brief=1 \
      --gtest_filter="$filter" >"build-aarch64/shard-$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < shards; ++i)); do
  rc=0
  wait "${pids[$i]}" || rc=$?
  sed "s/^/[shard $i] /" "build-aarch64/shard-$i.log"
  if [ "$rc" -ne 0 ]; then
    echo "test-aarch64.sh: shard $i of $shards failed (exit $rc; log build-aarch64/shard-$i.log)" >&2
    failed=1
  fi
done
exit "$failed"
