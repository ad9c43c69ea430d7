#!/usr/bin/env bash
# Puts cudnn-frontend's C++ headers (header-only; NVIDIA's nvidia-cudnn-frontend wheel on PyPI ships
# them) into build/cudnn-frontend/include, where CMake looks for them, so that a build with nvcc and
# cuDNN also builds the cuDNN attention kernel (kernels::CudnnAttention). The wheel is downloaded,
# never installed; the version is pinned so every build compiles the same frontend.
#
# usage: scripts/cudnn-frontend.sh [OUT_DIR]   (default build/cudnn-frontend; about 3 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,7p' "$0"
  exit 0
fi
version=1.32.0
out="${1:-build/cudnn-frontend}"
if [ "$(cat "$out/VERSION" 2>/dev/null)" = "$version" ] && [ -f "$out/include/cudnn_frontend.h" ]; then
  exit 0  # already there
fi
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Any platform's wheel has the same headers; the one for this Python and machine is the one pip finds.
if ! "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "nvidia-cudnn-frontend==$version" -d "$work" >"$work/pip.log" 2>&1; then
  cat "$work/pip.log" >&2
  echo "cudnn-frontend: pip download nvidia-cudnn-frontend==$version failed (log above)" >&2
  exit 1
fi
"$python" -m zipfile -e "$work"/nvidia_cudnn_frontend-*.whl "$work/wheel"
if [ ! -f "$work/wheel/include/cudnn_frontend.h" ]; then
  echo "cudnn-frontend: the wheel has no include/cudnn_frontend.h" >&2
  exit 1
fi
rm -rf "$out.new"
mkdir -p "$out.new"
cp -r "$work/wheel/include" "$out.new/include"
echo "$version" >"$out.new/VERSION"
rm -rf "$out"
mv "$out.new" "$out"
echo "cudnn-frontend: headers $version in $out/include"
