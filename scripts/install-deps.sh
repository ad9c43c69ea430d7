#!/usr/bin/env bash
# Installs what distca needs to build and test, from Debian 12's packages. Idempotent: does
# nothing when everything is already installed.
set -euo pipefail
packages=(
  g++ cmake ninja-build pkg-config   # toolchain
  libfmt-dev                         # formatting (g++ 12 has no <format>)
  nlohmann-json3-dev                 # JSON reports, plan files, batch files
  libcli11-dev                       # the distca command line
  libgtest-dev libgmock-dev          # tests
  libbenchmark-dev                   # benchmarks
  libopenblas-dev                    # BLAS: the sgemm ceiling and GEMM-attention baseline, linear layers
  openmpi-bin libopenmpi-dev         # MpiComm: multi-rank runs under mpirun
  python3-venv python3-dev           # the Python package: its virtual environment and headers
  python3-numpy python3-pytest       # the package's arrays and its test suite
  python3-mypy                       # the test that the package and its stubs type-check
  g++-aarch64-linux-gnu qemu-user    # scripts/test-aarch64.sh: the CPU kernels built for aarch64, run under qemu
  clang libclang-rt-14-dev llvm-14   # scripts/fuzz.sh: clang, its libFuzzer and sanitizer runtimes (only
                                     # recommended by clang, so named here), llvm-symbolizer for stack traces
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
