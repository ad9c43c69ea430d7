#!/usr/bin/env bash
# Installs the distca Python package into .venv (Debian's Python 3, with its NumPy, pytest and
# PyTorch visible: --system-site-packages; Debian refuses system-wide pip installs). pip builds
# the native module with scikit-build-core and pybind11 from PyPI, in build/python/ (kept, so a
# second install recompiles only what changed). Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check . >build/pip-install.log 2>&1 || {
  cat build/pip-install.log
  echo "install-python.sh: pip install . failed (log above, also in build/pip-install.log)" >&2
  exit 1
}
echo "install-python.sh: distca $(.venv/bin/python -c 'import distca; print(distca.__version__)') installed in .venv"
