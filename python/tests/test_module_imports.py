"""Every module of the distca package imports alone, each in a fresh interpreter (so no module
leans on another having been imported first, and no import cycle hides behind the usual order),
and no module file is over 600 lines (the package is split by idea, not grown by accretion)."""
import concurrent.futures
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "distca"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = sorted(_module_name(f) for f in FILES)
# distca.torch and everything under it need PyTorch (distca itself needs only NumPy:
# test_import_without_torch.py); without it only the planner package is imported here.
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _needs_torch(module: str) -> bool:
    return module == "distca.torch" or module.startswith("distca.torch.")


@functools.lru_cache(maxsize=None)
def _imports() -> dict:
    """module -> (exit status, output) of `python -c "import module"`, one fresh interpreter each,
    several at a time (each waits mostly on importing PyTorch)."""
    wanted = [m for m in MODULES if HAS_TORCH or not _needs_torch(m)]

    def run(module: str):
        p = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=240)
        return module, (p.returncode, p.stdout + p.stderr)

    with concurrent.futures.ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2))) as pool:
        return dict(pool.map(run, wanted))


def test_the_package_has_its_modules():
    assert {"distca", "distca.torch", "distca.torch.train", "distca.torch.adapters.megatron_core"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module):
    # The adapters import their frameworks (Megatron Core, TorchTitan) only when used, so they
    # import here without them, like every other module.
    if _needs_torch(module) and not HAS_TORCH:
        pytest.skip("PyTorch is not installed: distca.torch needs it")
    code, output = _imports()[module]
    assert code == 0, f"python -c 'import {module}' exited {code}:\n{output[-4000:]}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_is_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES}): split it by idea"
