"""memtide as torch's CUDA allocator: the bridge, or the pluggable allocator when it cannot be.

The bridge also runs memtide's CPU optimizer step on torch's intra-op threads
(:func:`use_torch_threads`, which TieredAdamW calls), so that the step does not share the cores
with torch's OpenMP workers still spinning after backward.

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
from ._memtide import cpu_executor
from ._memtide import log as _log
from ._memtide import library_path as memtide_library

LIBRARY = "libmemtide_torch.so"
STATUS_FILE = "torch_bridge_status.txt"

_here = os.path.dirname(os.path.abspath(__file__))
_lib: Optional[ctypes.CDLL] = None
_active: Optional[Dict[str, Any]] = None


class BridgeUnavailable(RuntimeError):
    """The bridge cannot be used in this process; the message says why."""


_BUILT = "built against torch "  # how a status file starts when its library was built


def package_file(name: str) -> str:
    """A file the install put beside the package's modules: a library compiled against torch, or
    the status file that says how that went."""
    return os.path.join(_here, name)


def install_status(status_file: str) -> str:
    """What the install recorded in `status_file`: "built against torch X", or "not built: why"."""
    try:
        with open(package_file(status_file), encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return f"not built: this memtide was installed without it (no {status_file})"


def why_unusable(status: str) -> Optional[str]:
    """Why a library the install built (`status`, from install_status) cannot serve the torch
    running now; None when it can. It compiled against torch's headers, which the local tag
    (2.15.0+cu132 -> 2.15.0) does not change."""
    if not status.startswith(_BUILT):
        return status
    import torch

    built_for = status[len(_BUILT):].strip()
    if built_for.split("+", 1)[0] != torch.__version__.split("+", 1)[0]:
        return (f"built against torch {built_for}, but torch {torch.__version__} is running; "
                "reinstall memtide (pip install .) to rebuild it for that torch")
    return None


def library_path() -> str:
    """Where the bridge would be (it may be absent: see :func:`build_status`)."""
    return package_file(LIBRARY)


def build_status() -> str:
    """What the install recorded: "built against torch X", or "not built: why"."""
    return install_status(STATUS_FILE)


def load() -> ctypes.CDLL:
    """Loads the bridge (importing torch first, whose libraries it links). Raises BridgeUnavailable."""
    global _lib
    if _lib is not None:
        return _lib
    why = why_unusable(build_status())
    if why is not None:
        raise BridgeUnavailable(why)
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
    if hasattr(lib, "memtide_torch_parallel_install"):  # a bridge built before it had one has not
        lib.memtide_torch_parallel_install.restype = ctypes.c_int
        lib.memtide_torch_parallel_uninstall.restype = ctypes.c_int
        lib.memtide_torch_parallel_active.restype = ctypes.c_int
        lib.memtide_torch_parallel_error.restype = ctypes.c_char_p
        lib.memtide_torch_parallel_counts.restype = None
        lib.memtide_torch_parallel_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
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


_threads_why: Optional[str] = None  # why the CPU step is not on torch's threads, once logged
_threads_choice: Optional[bool] = None  # the last use_torch_threads() call's, which optimizers keep


def default_torch_threads() -> bool:
    """What an optimizer calls when it builds its engine: :func:`use_torch_threads` unless the
    program chose otherwise with ``use_torch_threads(False)``."""
    if _threads_choice is False:
        return False
    return _use_torch_threads(True)


def use_torch_threads(enable: bool = True) -> bool:
    """Runs memtide's CPU kernels (TieredAdamW's CPU step, the adamw_step_cpu family) on torch's
    intra-op threads, through the bridge; returns whether they do now.

    Why: torch's OpenMP workers spin for a while after each parallel region (libgomp's default
    wait policy, unless OMP_WAIT_POLICY=PASSIVE was set before torch started), so a step that
    follows backward on memtide's own pool shares the cores with them; on torch's threads there is
    nobody to fight. The results are the same bits either way. Without the bridge (not built, a
    different torch, or MEMTIDE_TORCH_BRIDGE=false) memtide keeps its own pool and says why once
    in its log. ``enable=False`` goes back to memtide's own pool, and optimizers built later keep
    to it.
    """
    global _threads_choice
    if not isinstance(enable, bool):  # use_torch_threads("no") would otherwise turn it on
        raise TypeError(f"memtide.torch_bridge.use_torch_threads: enable must be True or False, got {enable!r}")
    _threads_choice = enable
    return _use_torch_threads(enable)


def _use_torch_threads(enable: bool) -> bool:
    global _threads_why
    if not enable:
        if _lib is not None and hasattr(_lib, "memtide_torch_parallel_uninstall"):
            _lib.memtide_torch_parallel_uninstall()
        return False
    if cpu_executor() == "torch":
        return True
    if not _bridge_enabled():
        why = "MEMTIDE_TORCH_BRIDGE=false"
    else:
        try:
            lib = load()
            if not hasattr(lib, "memtide_torch_parallel_install"):
                why = "the bridge was built without it; reinstall memtide (pip install .)"
            elif lib.memtide_torch_parallel_install() != 0:
                why = lib.memtide_torch_parallel_error().decode()
            else:
                return True
        except BridgeUnavailable as e:
            why = str(e)
    if why != _threads_why:
        _threads_why = why
        # A bridge that was built but does not work is news; one that was never built is the
        # usual case of a torch without CUDA and only worth a line at info level.
        built = build_status().startswith("built against torch ")
        _log("warn" if built and _bridge_enabled() else "info",
             f"the CPU optimizer step runs on memtide's own threads, not torch's ({why}); with torch's OpenMP "
             "workers spinning after backward it may run slower: OMP_WAIT_POLICY=PASSIVE before torch starts helps")
    return False


def torch_thread_counts() -> Dict[str, int]:
    """What the bridge ran on torch's threads so far: ``jobs`` (kernel calls handed to torch) and
    ``worker_calls`` (shares of them that ran on torch's workers, not on the calling thread)."""
    lib = load()
    jobs, calls = ctypes.c_uint64(0), ctypes.c_uint64(0)
    lib.memtide_torch_parallel_counts(ctypes.byref(jobs), ctypes.byref(calls))
    return {"jobs": jobs.value, "worker_calls": calls.value}


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
