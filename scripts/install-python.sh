#!/usr/bin/env bash
# Installs the distca Python package into .venv (Debian's Python 3, with its NumPy, pytest and mypy
# visible: --system-site-packages; Debian refuses system-wide pip installs), and PyTorch from PyPI
# for distca.torch (Debian's 1.13 is too old: distca.torch needs >= 2.10). pip builds the native
# module with scikit-build-core and pybind11 from PyPI, in build/ beside the C++ build (so the
# libraries compile once, and a second install recompiles only what changed). PyTorch is downloaded once: a .venv that already has torch >= 2.10
# is left as it is. Prints the versions installed.
#   scripts/install-python.sh               all of it
#   scripts/install-python.sh --venv-only   only the virtual environment
#   scripts/install-python.sh --deps-only   the environment and the packages from PyPI, not distca
#                                           (scripts/test.sh runs this beside the C++ build)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
  "") ;;
  --venv-only) mode=venv ;;
  --deps-only) mode=deps ;;
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install-python.sh: unknown argument '$1' (known: --venv-only, --deps-only, --help)" >&2; exit 2 ;;
esac
mkdir -p build
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
[ "$mode" = venv ] && exit 0
if ! .venv/bin/python - 2>/dev/null <<'PY'
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 10) and "site-packages" in torch.__file__ and ".venv" in torch.__file__ else 1)
PY
then
  echo "install-python.sh: installing PyTorch >= 2.10 from PyPI into .venv (3.0 GB to download, 5.3 GB installed with its CUDA libraries; 80 s measured on the development machine)"
  .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off "torch>=2.10" >build/pip-torch.log 2>&1 || {
    tail -30 build/pip-torch.log
    echo "install-python.sh: pip install torch failed (log above, also in build/pip-torch.log)" >&2
    exit 1
  }
fi
# The frameworks distca.torch.adapters plug into, for their tests (python/tests/test_torch_megatron.py,
# test_torch_torchtitan.py, test_torch_transformers.py): megatron-core with NumPy >= 1.25 (it imports
# numpy.dtypes; Debian's is 1.24); Hugging Face transformers and accelerate (its Trainer needs
# accelerate; TRL is not installed: its padding-free batches are the position_ids form the tests
# build themselves); and TorchTitan's model code without its trainer's dependencies (datasets,
# wandb, tensorboard: about 1 GB that the adapter does not use). torch stays the version installed above.
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off "torch==$torch_version" \
    "numpy>=1.25,<2" "megatron-core==0.16.1" "transformers==5.24.0" "accelerate==1.16.0" >build/pip-frameworks.log 2>&1 &&
  .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off --no-deps "torchtitan==0.3.0" \
    "spmd_types==0.2.3" "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1" >>build/pip-frameworks.log 2>&1 || {
  tail -30 build/pip-frameworks.log
  echo "install-python.sh: installing megatron-core, transformers, accelerate and torchtitan failed (log above, also in build/pip-frameworks.log)" >&2
  exit 1
}
# The package's module is built in build/, the tree scripts/build.sh made: its libraries are compiled
# once for the binary, the tests and the module (a separate tree compiled them again: about 3
# minutes here). So pip builds without isolation (its build tools in .venv) and keeps build/'s
# tests and benches configured.
# pytest-xdist: scripts/test.sh runs the Python tests on every core (289 s instead of 389 s here).
.venv/bin/python -m pip install --quiet --disable-pip-version-check "scikit-build-core>=0.10" "pybind11>=2.10" \
    "pytest-xdist==3.6.1" \
    >build/pip-install.log 2>&1 || {
  cat build/pip-install.log
  echo "install-python.sh: pip install of the build tools failed (log above, also in build/pip-install.log)" >&2
  exit 1
}
if [ "$mode" = deps ]; then
  echo "install-python.sh: the packages from PyPI are in .venv (--deps-only: distca itself not installed)"
  exit 0
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --config-settings=build-dir=build \
    --config-settings=cmake.define.DISTCA_BUILD_TESTS=ON --config-settings=cmake.define.DISTCA_BUILD_BENCH=ON . \
    >>build/pip-install.log 2>&1 || {
  cat build/pip-install.log
  echo "install-python.sh: pip install . failed (log above, also in build/pip-install.log)" >&2
  exit 1
}
.venv/bin/python - <<'PY'
from importlib.metadata import version
print("install-python.sh: in .venv: " + ", ".join(f"{p} {version(p)}" for p in ("distca", "torch", "numpy", "megatron-core", "transformers", "accelerate", "torchtitan")))
PY
