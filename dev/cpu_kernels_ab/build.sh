#!/usr/bin/env bash
# build.sh KERNELS_DIR OUT: the timing program over the src/kernels tree KERNELS_DIR.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
K=$1
FL="-O3 -DNDEBUG -std=c++20 -DFMT_SHARED -I$K/include -I$root/src/core/include"
objs=()
for f in attention.cc cpu/attention_cpu.cc $(cd "$K" && ls cpu/isa_*.cc); do
  extra="-ffp-contract=fast -Wno-psabi"
  case $f in
    *avx512*) extra="$extra -mavx512f -mavx512vl -mavx512bw -mavx512dq -mfma -mavx2 -mbmi2 -mprefer-vector-width=512";;
    *avx2*) extra="$extra -mavx2 -mfma";;
    cpu/isa_select.cc|cpu/attention_cpu.cc|attention.cc) extra="";;
  esac
  o="$2.$(basename "$f").o"
  g++ $FL $extra -c "$K/$f" -o "$o"
  objs+=("$o")
done
g++ $FL -c "$here/main.cc" -o "$2.main.o"
g++ -o "$2" "$2.main.o" "${objs[@]}" "$root/build/src/core/libdistca_core.a" -lfmt -lpthread
