"""A package's imports read from its source with `ast` (test_module_imports.py): which of its
modules each module imports at import time (the graph that must have no cycle), and where a module
takes another module's private name (`_x`), which a helper shared across modules must not be:
shared, it is a public name of the module that owns it.

Both read every import statement, however deep; the graph keeps those that run when the module is
imported (at module level, in a class body, under `if`/`try`: not inside a function, nor under
`if TYPE_CHECKING:`). A private name is taken by
    from .m import _x            from pkg.m import _x          (any level of relative import)
    import pkg.m as m; m._x      from pkg import m; m._x       import pkg.m; pkg.m._x
and by the same attribute reads inside functions. A private name that is itself a module (the
compiled `_distca`, a `_helpers.py`) is a module, not a private name, and `_x` of the module
itself is its own. Dunders (`__version__`) are not private.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PrivateUse:
    path: Path       # the file that takes the name
    line: int
    module: str      # the module whose name it takes
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: takes {self.module}.{self.name}, a private name of another module"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class Package:
    """The modules of the package rooted at `root` (a folder with __init__.py): every .py file, and
    every .pyi stub of a compiled module (`_distca.pyi` for `_distca.*.so`)."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, Path] = {}          # module name -> its .py file
        self.modules: set[str] = set()            # those, and the compiled modules
        for path in sorted(root.rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            name = self._name(path)
            self.modules.add(name)
            if path.suffix == ".py":
                self.files[name] = path
        self._trees = {name: ast.parse(path.read_text(), str(path)) for name, path in self.files.items()}

    def _name(self, path: Path) -> str:
        parts = path.relative_to(self.root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def _is_package(self, module: str) -> bool:
        return module in self.files and self.files[module].name == "__init__.py"

    def _resolve(self, module: str, node: ast.ImportFrom) -> str:
        """The absolute name `from <node.module> import ...` reads in `module`."""
        if node.level == 0:
            return node.module or ""
        # A package's own __init__ is level 1's anchor; a plain module's anchor is its package.
        base = module.split(".")
        if not self._is_package(module):
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def _ours(self, name: str) -> bool:
        top = self.root.name
        return name == top or name.startswith(top + ".")

    def imports(self, module: str) -> set[str]:
        """The package's modules that `module` imports when it is imported (see the docstring)."""
        out: set[str] = set()
        for node in _import_time_nodes(self._trees[module]):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if self._ours(a.name))
            elif isinstance(node, ast.ImportFrom):
                source = self._resolve(module, node)
                if not self._ours(source):
                    continue
                submodules = {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in self.modules}
                out.update(submodules)
                if len(submodules) < len(node.names):      # a name of `source` itself
                    out.add(source)
        out.discard(module)
        return out & self.modules

    def cycles(self) -> list[list[str]]:
        """Every cycle of the import-time graph, one per strongly connected part (Tarjan), each as a
        closed path m1 -> m2 -> ... -> m1."""
        graph = {m: sorted(self.imports(m)) for m in self.files}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        parts: list[list[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in graph.get(v, []):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                part = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    parts.append(part)

        for v in sorted(graph):
            if v not in index:
                visit(v)
        return [_closed_path(graph, set(part)) for part in parts]

    def private_uses(self) -> list[PrivateUse]:
        """Every place a module takes another module's private name (see the docstring)."""
        found: list[PrivateUse] = []
        for module, tree in self._trees.items():
            path = self.files[module]
            aliases: dict[str, str] = {}      # a local name -> the package's module it is bound to
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if not self._ours(a.name):
                            continue
                        if a.asname:
                            aliases[a.asname] = a.name
                        else:
                            top = a.name.split(".")[0]
                            aliases[top] = top
                elif isinstance(node, ast.ImportFrom):
                    source = self._resolve(module, node)
                    if not self._ours(source):
                        continue
                    for a in node.names:
                        full = f"{source}.{a.name}"
                        if full in self.modules:
                            aliases[a.asname or a.name] = full
                        elif is_private(a.name) and source != module:
                            found.append(PrivateUse(path, node.lineno, source, a.name))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    use = self._private_attribute(module, node, aliases)
                    if use is not None:
                        found.append(PrivateUse(path, node.lineno, *use))
        return sorted(set(found), key=lambda u: (str(u.path), u.line, u.name))

    def _private_attribute(self, module: str, node: ast.Attribute, aliases: dict) -> "tuple[str, str] | None":
        """(owner, name) where `node` is `<alias>.<sub>..._x` of another of the package's modules."""
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            return None
        chain.reverse()
        owner = aliases[value.id]
        for attr in chain[:-1]:                 # down the submodules named on the way
            if f"{owner}.{attr}" not in self.modules:
                return None                     # an attribute of an object, not a module's name
            owner = f"{owner}.{attr}"
        name = chain[-1]
        if is_private(name) and f"{owner}.{name}" not in self.modules and owner != module:
            return owner, name
        return None


def _import_time_nodes(tree: ast.Module):
    """The import statements that run when the module is imported."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _closed_path(graph: dict, part: set) -> list[str]:
    """A cycle through the smallest module of a strongly connected part, by breadth-first search."""
    start = min(part)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if w in part and w not in came_from and w != start:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(part)}")
