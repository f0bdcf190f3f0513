"""memtide as torch's CUDA allocator: the bridge, or the pluggable allocator when it cannot be.

Two ways in (docs/torch_bridge.md says why the first is preferred):

- **the bridge** (``libmemtide_torch.so``): a subclass of torch's C++ ``CUDAAllocator`` compiled
  against the installed torch when memtide was installed. torch then calls memtide for everything
  it asks its own allocator: stats (``torch.cuda.memory_stats``), snapshots, ``record_stream``,
  CUDA graph pools, ``empty_cache``, the memory fraction, cudnn's cache info, and out-of-memory
  raises ``torch.OutOfMemoryError`` with memtide's message.
- **the pluggable allocator** (``torch.cuda.memory.CUDAPluggableAllocator`` over memtide's C
  ABI): malloc and free only; torch's memory functions raise "not supported".

:func:`install` takes the bridge when it was built, matches the running torch and
``MEMTIDE_TORCH_BRIDGE`` is not off; otherwise the pluggable path, and :func:`status` says which
and why.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, Optional

# From the extension, not the package: memtide's __init__ imports this module back.
from ._memtide import backend, options
from ._memtide import library_path as memtide_library

LIBRARY = "libmemtide_torch.so"
STATUS_FILE = "torch_bridge_status.txt"

_here = os.path.dirname(os.path.abspath(__file__))
_lib: Optional[ctypes.CDLL] = None
_active: Optional[Dict[str, Any]] = None


class BridgeUnavailable(RuntimeError):
    """The bridge cannot be used in this process; the message says why."""


def library_path() -> str:
    """Where the bridge would be (it may be absent: see :func:`build_status`)."""
    return os.path.join(_here, LIBRARY)


def build_status() -> str:
    """What the install recorded: "built against torch X", or "not built: why"."""
    try:
        with open(os.path.join(_here, STATUS_FILE), encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return "not built: this memtide was installed without the bridge step (no torch_bridge_status.txt)"


def _base_version(version: str) -> str:
    """2.15.0+cu132 -> 2.15.0: the bridge compiles against headers, which the local tag does not change."""
    return version.split("+", 1)[0]


def load() -> ctypes.CDLL:
    """Loads the bridge (importing torch first, whose libraries it links). Raises BridgeUnavailable."""
    global _lib
    if _lib is not None:
        return _lib
    status = build_status()
    if not status.startswith("built against torch "):
        raise BridgeUnavailable(status)
    built_for = status[len("built against torch "):].strip()
    import torch

    if _base_version(built_for) != _base_version(torch.__version__):
        raise BridgeUnavailable(f"built against torch {built_for}, but torch {torch.__version__} is running; "
                                "reinstall memtide (pip install .) to rebuild the bridge for it")
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise BridgeUnavailable(f"{path} does not load: {e}") from None
    lib.memtide_torch_bridge_install.restype = ctypes.c_int
    lib.memtide_torch_bridge_active.restype = ctypes.c_int
    lib.memtide_torch_bridge_error.restype = ctypes.c_char_p
    lib.memtide_torch_bridge_torch_version.restype = ctypes.c_char_p
    lib.memtide_torch_bridge_selfcheck.restype = ctypes.c_int
    lib.memtide_torch_bridge_selfcheck.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    _lib = lib
    return lib


def _bridge_enabled() -> bool:
    return options().get("torch_bridge", "true") == "true"


def install() -> Dict[str, Any]:
    """Makes memtide torch's CUDA allocator, by the bridge when it can; returns :func:`status`.

    Must run before torch's first CUDA allocation. Raises RuntimeError when torch's allocator is
    already in use (for both paths).
    """
    global _active
    if _active is not None:
        return status()
    import torch.cuda.memory

    if backend() != "cuda" and torch.cuda.is_available():
        # torch would hand the simulated device's addresses to CUDA kernels.
        raise RuntimeError("memtide: torch sees a GPU but memtide runs on its simulated device (MEMTIDE_DEVICE=sim, "
                           "or memtide was built without CUDA: see `memtide info`); torch's tensors need GPU memory")
    why = "MEMTIDE_TORCH_BRIDGE=false" if not _bridge_enabled() else None
    if why is None:
        try:
            lib = load()
            if lib.memtide_torch_bridge_install() != 0:
                raise RuntimeError("memtide: " + lib.memtide_torch_bridge_error().decode())
            _active = {"path": "bridge", "why": build_status(), "allocator": None}
            return status()
        except BridgeUnavailable as e:
            why = str(e)
            import warnings

            warnings.warn(f"memtide: torch bridge unavailable ({why}); using torch's pluggable allocator, without "
                          "torch.cuda.memory_stats, snapshots, record_stream or graph pools", RuntimeWarning, stacklevel=3)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(memtide_library(), "memtide_malloc", "memtide_free")
    torch.cuda.memory.change_current_allocator(alloc)
    _active = {"path": "pluggable", "why": why, "allocator": alloc}
    return status()


def installed() -> bool:
    """Whether :func:`install` made memtide torch's allocator in this process."""
    return _active is not None


def status() -> Dict[str, Any]:
    """Which path makes memtide torch's allocator in this process, and why.

    ``path``: "bridge", "pluggable", or "none" (not installed in this process; ``why`` then says
    what :func:`install` would take). ``built``: the install's record.
    """
    if _active is not None:
        return {"path": _active["path"], "why": _active["why"], "built": build_status()}
    if not _bridge_enabled():
        return {"path": "none", "why": "would be pluggable: MEMTIDE_TORCH_BRIDGE=false", "built": build_status()}
    try:
        load()
        return {"path": "none", "why": "would be the bridge", "built": build_status()}
    except BridgeUnavailable as e:
        return {"path": "none", "why": f"would be pluggable: {e}", "built": build_status()}
    except ImportError:
        return {"path": "none", "why": "torch is not installed", "built": build_status()}


def selfcheck() -> Dict[str, Any]:
    """Drives the bridge's hooks through torch's own C++ entry points (allocation, base
    allocation, cache info, record_stream, stats, free) and returns what they answered. Needs the
    bridge installed; works on the simulated device."""
    import json

    if status()["path"] != "bridge":
        raise BridgeUnavailable("the bridge is not torch's allocator in this process: " + str(status()["why"]))
    lib = load()
    out = ctypes.create_string_buffer(4096)
    if lib.memtide_torch_bridge_selfcheck(out, len(out)) != 0:
        raise RuntimeError("memtide: torch bridge self-check failed: " + lib.memtide_torch_bridge_error().decode())
    return json.loads(out.value.decode())
