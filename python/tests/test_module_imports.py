"""Every module of the distca package imports alone, each in a fresh state (so no module leans on
another having been imported first, and no import cycle hides behind the usual order), and no
module file is over 600 lines (the package is split by idea, not grown by accretion).

"Alone" is `python -c "import M"` after only the third-party libraries: one fresh interpreter per
group imports NumPy (and PyTorch for distca.torch) and forks a child per module (import_alone.py),
so the suite pays for one PyTorch import instead of one per module.

Read from the source (import_graph.py), the modules' imports have no cycle, even one that works
in the usual order, and no module takes another's private name (`from .m import _x`, `m._x`): a
helper shared across modules is a public name of the module that owns it."""
import importlib.util
from pathlib import Path

import pytest

from import_alone import ImportChecker
from import_graph import Package, PrivateUse

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


# What each group's interpreter imports before any distca module: all the third-party libraries its
# modules import at the top (the adapters import their frameworks only when used).
PRELOAD = {"planner": ["numpy"], "torch": ["numpy", "torch"]}


@pytest.fixture(scope="module")
def checker():
    """group -> its ImportChecker, started on first use (one interpreter a group per test process)."""
    started = {}

    def get(group: str) -> ImportChecker:
        if group not in started:
            started[group] = ImportChecker("distca", PRELOAD[group])
        return started[group]
    yield get
    for c in started.values():
        c.close()


def test_the_package_has_its_modules():
    assert {"distca", "distca.torch", "distca.torch.train", "distca.torch.adapters.megatron_core"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module, checker):
    if _needs_torch(module) and not HAS_TORCH:
        pytest.skip("PyTorch is not installed: distca.torch needs it")
    group = "torch" if _needs_torch(module) else "planner"
    code, output = checker(group).check(module)
    assert code == 0, f"import {module} alone (after importing {PRELOAD[group]}) exited {code}:\n{output[-4000:]}"


def test_the_checker_finds_modules_that_do_not_import_alone(tmp_path):
    """import_alone.py itself, on a package made here: a module that imports alone passes; one in a
    cycle that works only when its partner is imported first fails, although its partner was checked
    just before it (each child starts afresh); so do one that reads an attribute another import
    sets, and one with a missing import; and a hung import is killed at the timeout. The server
    itself refuses preloaded libraries that import the package, and reports its own failure."""
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        # a -> b -> a: importing a first works (b finds what it needs of a: nothing); b first fails,
        # as a, imported from b's first line, reads b.X before b has set it.
        "a.py": "from cyclic import b\nY = b.X + 1\n",
        "b.py": "from cyclic import a\nX = 1\n",
        "leans.py": "import cyclic\nZ = cyclic.a.Y\n",            # works only after cyclic.a
        "missing.py": "import cyclic_no_such_module\n",
        "hangs.py": "import time\nwhile True:\n    time.sleep(1)\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    c = ImportChecker("cyclic", ["json"], paths=[str(tmp_path)], timeout=3)
    try:
        got = {m: c.check(f"cyclic.{m}") for m in ("a", "b", "leans", "missing", "hangs")}
        again = c.check("cyclic.a")          # after the failures: still a fresh start
    finally:
        c.close()
    assert got["a"] == again == (0, ""), (got["a"], again)
    assert got["b"][0] == 1 and "partially initialized module 'cyclic.b'" in got["b"][1], got["b"]
    assert got["leans"][0] == 1 and "has no attribute 'a'" in got["leans"][1], got["leans"]
    assert got["missing"][0] == 1 and "No module named 'cyclic_no_such_module'" in got["missing"][1], got["missing"]
    assert got["hangs"][0] != 0 and "killed" in got["hangs"][1], got["hangs"]
    # A server whose preloaded libraries pull in the package under test refuses to start; one whose
    # libraries do not import says why.
    with pytest.raises(AssertionError, match=r"loaded modules of cyclic before any check: \['cyclic'"):
        ImportChecker("cyclic", ["cyclic.a"], paths=[str(tmp_path)])
    with pytest.raises(AssertionError, match="gave no answer(.|\n)*No module named 'cyclic_no_such_module'"):
        ImportChecker("cyclic", ["cyclic_no_such_module"], paths=[str(tmp_path)])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_is_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES}): split it by idea"


def test_no_module_takes_another_modules_private_name():
    uses = Package(PACKAGE).private_uses()
    assert not uses, "make the name public in the module that owns it:\n" + "\n".join(map(str, uses))


def test_the_modules_imports_have_no_cycle():
    cycles = Package(PACKAGE).cycles()
    assert not cycles, "import cycles (at import time):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_import_reader_finds_private_names_and_cycles(tmp_path):
    """import_graph.py on a package made here: each form of taking another module's private name is
    found, with its file and line; a private module, a compiled module's stub, a dunder, a module's
    own private names and an object's are not. a <-> b import each other at import time (a cycle,
    although each line alone is harmless); c and d do only through a function and under
    TYPE_CHECKING (no cycle)."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .m import _x\n",                                 # 1: _x of pkg.m
        "m.py": "_x = 1\n__version__ = '1'\n\n\ndef _own():\n    return _x\n",
        "_helpers.py": "",
        "_native.pyi": "",
        "a.py": "from . import b\n",
        "b.py": "import pkg.a\n",
        "c.py": "from typing import TYPE_CHECKING\nfrom . import d\nif TYPE_CHECKING:\n    from . import d as e\n",
        "d.py": "def f():\n    from . import c\n    return c\n",
        "uses.py": ("from pkg.m import _x, __version__\n"                     # 1: _x of pkg.m
                    "from . import _helpers, _native\n"
                    "import pkg.m as mm\n"
                    "from pkg import m\n"
                    "import pkg.sub.n\n"
                    "\n"
                    "\n"
                    "def f(obj):\n"
                    "    from .m import _own\n"                          # 9: _own of pkg.m
                    "    return mm._x, m._own, pkg.sub.n._z, obj._p, _helpers, _native, mm.__name__\n"),  # 10
        "sub/__init__.py": "",
        "sub/n.py": "from ..m import _x\n_z = _x\n\n\ndef g():\n    return _z\n",   # 1: _x of pkg.m
    }
    for name, text in files.items():
        (root / name).write_text(text)
    package = Package(root)
    got = [(u.path.relative_to(root).as_posix(), u.line, u.module, u.name) for u in package.private_uses()]
    assert got == [("__init__.py", 1, "pkg.m", "_x"),
                   ("sub/n.py", 1, "pkg.m", "_x"),
                   ("uses.py", 1, "pkg.m", "_x"),
                   ("uses.py", 9, "pkg.m", "_own"),
                   ("uses.py", 10, "pkg.m", "_own"),
                   ("uses.py", 10, "pkg.m", "_x"),
                   ("uses.py", 10, "pkg.sub.n", "_z")], got
    assert str(PrivateUse(root / "uses.py", 9, "pkg.m", "_own")) == \
        f"{root / 'uses.py'}:9: takes pkg.m._own, a private name of another module"
    assert package.imports("pkg.c") == {"pkg.d"} and package.imports("pkg.d") == set()
    assert package.imports("pkg.uses") == {"pkg.m", "pkg._helpers", "pkg._native", "pkg.sub.n"}
    assert package.cycles() == [["pkg.a", "pkg.b", "pkg.a"]]
