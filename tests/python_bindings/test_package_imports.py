"""The memtide package and the Python tools installed beside it (memtide._timeline) have no import
loop: no module imports, at load or lazily inside a function, one that imports it back. Imports
under TYPE_CHECKING never run and are left out."""

from __future__ import annotations

import ast
import os

import memtide
import memtide._timeline  # noqa: F401 - the tools' package, installed inside memtide


def _modules():
    mods = {}
    for package in (memtide,):  # memtide._timeline (tools/timeline) inside it
        root = os.path.dirname(os.path.dirname(package.__file__))
        for folder, _, files in os.walk(os.path.dirname(package.__file__), followlinks=True):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    is_pkg = name.endswith(".__init__")
                    mods[name[: -len(".__init__")] if is_pkg else name] = (path, is_pkg)
    return mods


def _imports(name, path, is_pkg, mods):
    tree = ast.parse(open(path).read())
    type_checking = {id(n) for node in ast.walk(tree)
                     if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                     for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            wanted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = package + ("." + node.module if node.module else "")
            if base.rpartition(".")[2] == "_memtide":
                continue  # the extension module: it imports nothing of the package
            # "from pkg import x": the submodule pkg.x when there is one, else pkg's __init__.
            wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                      for a in node.names if a.name != "_memtide"]
        else:
            continue
        for target in wanted:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_module_imports_one_that_imports_it_back():
    mods = _modules()
    edges = {name: _imports(name, path, is_pkg, mods) for name, (path, is_pkg) in mods.items()}

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(edges[m])
        return False

    loops = sorted(f"{a} -> {b} -> ... -> {a}" for a in edges for b in edges[a] if reaches(b, a))
    assert "memtide.cli" in mods and "memtide.cli.planning" in mods and "memtide._timeline.trace" in mods
    assert not loops, loops


def test_the_library_never_imports_the_command_line():
    # The package by audience: what users import (memtide, optim, window, timeline, host, ...)
    # reaches nothing of memtide.cli, so the CLI's helpers can change without touching them.
    mods = _modules()
    library = [name for name in mods if name.startswith("memtide") and not name.startswith("memtide.cli")
               and not name.startswith("memtide._timeline")]
    reached = {}
    for name in library:
        for target in _imports(name, *mods[name], mods):
            if target.startswith("memtide.cli"):
                reached.setdefault(name, []).append(target)
    assert "memtide.optim.tiered_adamw" in library and "memtide.cli.train_job" in mods
    assert not reached, reached


def test_the_package_init_imports_and_defines_nothing_else():
    # memtide/__init__.py: imports, the version, the lazy simulator names and __all__; what the
    # process needs at import lives in memtide._startup, phases in memtide.phases.
    tree = ast.parse(open(memtide.__file__).read())
    functions = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert functions == ["__getattr__"], functions
    assert all(name in dir(memtide) for name in memtide.__all__ if name not in ("simulate_iteration", "simulate_node",
                                                                                "simulate_update_sweep",
                                                                                "simulation_defaults"))
