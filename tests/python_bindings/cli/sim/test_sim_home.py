"""The iteration simulator has one home (tools/simulator/README.md): a piece that calls it from
anywhere else would be missed by whoever changes it there. Read from the source tree, not the
installed package: the layout is the source's."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
# What memtide loads lazily from memtide._sim (memtide/__init__.py's _SIMULATOR).
SIMULATOR_NAMES = {"simulate_iteration", "simulate_node", "simulate_update_sweep", "simulation_defaults"}


def _python_users(folder: Path):
    """The .py files under `folder` that import memtide._sim or use one of the simulator's names
    (comments and strings do not count)."""
    users = set()
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in SIMULATOR_NAMES:
                users.add(path)
            elif isinstance(node, ast.ImportFrom) and (
                    (node.module or "").endswith("_sim") or any(a.name in SIMULATOR_NAMES | {"_sim"} for a in node.names)):
                users.add(path)
            elif isinstance(node, ast.Import) and any(a.name.endswith("._sim") for a in node.names):
                users.add(path)
    return {p.relative_to(ROOT).as_posix() for p in users}


def test_only_the_simulators_cli_glue_calls_it_from_the_package():
    package = ROOT / "python_bindings" / "memtide"
    users = _python_users(package)
    outside = {u for u in users if not u.startswith("python_bindings/memtide/cli/sim/")}
    # memtide/__init__.py: the lazy __getattr__ that loads memtide._sim on first use.
    assert outside == {"python_bindings/memtide/__init__.py"}, outside
    assert "python_bindings/memtide/cli/sim/iteration.py" in users


def test_benches_that_simulate_live_in_bench_sim():
    users = _python_users(ROOT / "bench")
    assert users and all(u.startswith("bench/sim/") for u in users), users


def test_the_simulators_headers_are_included_only_by_its_own_code_and_tests():
    include = re.compile(r'#\s*include\s*[<"]memtide/simulator/')
    allowed = ("tools/simulator/", "tests/tools/simulator/")
    outside = []
    for folder, dirs, files in os.walk(ROOT):
        # Build trees and virtual environments hold copies, not sources.
        dirs[:] = [d for d in dirs if not d.startswith((".", "build", "__pycache__"))]
        for f in files:
            if not f.endswith((".cpp", ".hpp", ".h", ".cu")):
                continue
            path = Path(folder) / f
            rel = path.relative_to(ROOT).as_posix()
            if include.search(path.read_text(errors="replace")) and not rel.startswith(allowed):
                outside.append(rel)
    assert not outside, outside
