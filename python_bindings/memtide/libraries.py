"""Where memtide's libraries reach other programs: torch's CUDA allocator (the bridge, or torch's
pluggable allocator over the C ABI; :mod:`memtide.torch_bridge` chooses) and the LD_PRELOAD
observer for any CUDA program."""

from __future__ import annotations

import os

from ._memtide import library_path


def preload_library_path() -> str:
    """The LD_PRELOAD observer shipped with the package (``memtide observe`` uses it).

    ``LD_PRELOAD=<this> MEMTIDE_PRELOAD_LOG=t.jsonl ./app`` records every cudaMalloc/cudaFree
    (and their Async forms) of an unmodified CUDA program that uses the shared CUDA runtime.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmemtide_preload.so")
    if not os.path.isfile(path):
        raise RuntimeError(f"memtide: the LD_PRELOAD observer is missing ({path}); reinstall memtide "
                           "(pip install .) or build it with CMake (build/<preset>/allocator/preload)")
    return path


def torch_allocator():
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` backed by memtide's C ABI (malloc and free
    only; :func:`use_with_torch` prefers the bridge, which gives torch everything)."""
    import torch.cuda.memory  # lazily: torch is optional and slow to import

    return torch.cuda.memory.CUDAPluggableAllocator(library_path(), "memtide_malloc", "memtide_free")


def use_with_torch() -> dict:
    """Makes memtide torch's CUDA allocator; returns which path did it and why.

    The bridge (memtide as torch's own C++ allocator, built against torch at install time) when
    it can, else torch's pluggable allocator: ``{"path": "bridge" | "pluggable", "why": ...,
    "built": ...}``; see :mod:`memtide.torch_bridge`. Must run before the first CUDA allocation
    of the process: torch refuses to swap an allocator that has already handed out memory.
    """
    from . import torch_bridge

    return torch_bridge.install()


def torch_allocator_installed() -> bool:
    """Whether use_with_torch() (or ``backend:memtide`` in PYTORCH_CUDA_ALLOC_CONF) made memtide
    torch's CUDA allocator in this process."""
    from . import torch_bridge

    return torch_bridge.installed()
