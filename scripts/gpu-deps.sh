#!/usr/bin/env bash
# Prepares build/gpu-deps: the C++ build's libraries (fmt, nlohmann-json, CLI11, GoogleTest,
# OpenBLAS and its libgfortran) unpacked from Debian's packages, for a device machine that has
# nvcc, CMake and PyTorch but cannot fetch these. A GPU session carries the folder to the device
# (the device tool's carry: ["build/gpu-deps"]), with cudnn-frontend's headers (scripts/cudnn-frontend.sh); scripts/gpu-check.sh uses it when the device's own
# CMake does not find the libraries. The packages are downloaded, never installed here.
#
# usage: scripts/gpu-deps.sh   (about 40 MB unpacked; static archives are left out)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,9p' "$0"
  exit 0
fi
out=build/gpu-deps
packages="libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev libopenblas-dev libopenblas0-pthread
          libopenblas-pthread-dev libgfortran5 libquadmath0"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download $packages >/dev/null 2>&1) || {
  echo "gpu-deps: apt-get download failed (are Debian's package lists current? apt-get update)" >&2
  exit 1
}
rm -rf "$out.new"
mkdir -p "$out.new"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$out.new"; done
# The OpenBLAS archives are not needed (the build links the shared library) and would double the size.
find "$out.new" -name "*.a" -path "*openblas*" -delete
# cudnn-frontend's headers (header-only), for the cuDNN attention kernel: the device cannot fetch them.
scripts/cudnn-frontend.sh "$out.new/cudnn-frontend" >/dev/null
rm -rf "$out"
mv "$out.new" "$out"
echo "gpu-deps: $(du -sh "$out" | cut -f1) in $out ($(echo $packages | wc -w) packages); carry it to the device"
