"""The native modules, the torch bridge and the optimizer's native reads export nothing of the C++ runtime, and torch imports
after memtide. A compiler that links libstdc++ statically (the GPU machines' GCC did) once made
the nanobind module export libstdc++'s symbols; the system libstdc++.so.6, loaded with it, bound
its own calls to them, and ``import memtide; import torch`` aborted with "free(): invalid pointer".
The link options that prevent it (``--exclude-libs,ALL``) are checked here by reading the exports."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

import memtide

# Definitions that only a copy of the C++ runtime has: the locale machinery, exception raising, and
# operator new. A module that defines one of them exports its own runtime.
RUNTIME_SYMBOLS = ("_ZNSt6localeD1Ev", "_ZNSt6locale5_ImplD1Ev", "__cxa_throw", "_Znwm")


def _native_files():
    folder = os.path.dirname(memtide.__file__)
    return sorted(glob.glob(os.path.join(folder, "_memtide*.so")) + glob.glob(os.path.join(folder, "_sim*.so"))
                  + glob.glob(os.path.join(folder, "libmemtide_torch*.so")))


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_no_module_exports_the_cpp_runtime():
    files = _native_files()
    assert any("_memtide" in os.path.basename(f) for f in files), files
    for path in files:
        out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
        defined = {line.split()[-1] for line in out.splitlines() if line.strip()}
        leaked = sorted(defined.intersection(RUNTIME_SYMBOLS))
        assert not leaked, f"{os.path.basename(path)} exports the C++ runtime's {leaked}"


def test_torch_imports_after_memtide():
    pytest.importorskip("torch")
    code = "import memtide, torch; t = torch.ones(3); print(float((t * 2).sum()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "6.0"
