"""memtide: a CUDA-aware caching allocator and memory-tiering runtime.

The native module wraps libmemtide.so, the same library torch loads through
CUDAPluggableAllocator, so stats, phases and snapshots seen here are those of the
allocator serving torch's tensors.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _memtide, host
from ._memtide import (
    ConfigError,
    adamw_step_cpu,
    backend,
    cpu_isa,
    cpu_threads,
    cuda_status,
    device_count,
    dump_snapshot,
    empty_cache,
    headroom,
    library_path,
    mark_phase,
    option_table,
    options,
    phase_report,
    record_history,
    replay_transformer,
    reset_peak_stats,
    resolve_backend,
    stats,
    version,
)

__version__ = version()

__all__ = [
    "ConfigError",
    "__version__",
    "adamw_step_cpu",
    "backend",
    "cpu_isa",
    "cpu_threads",
    "cuda_status",
    "device_count",
    "dump_snapshot",
    "empty_cache",
    "headroom",
    "host",
    "library_path",
    "mark_phase",
    "option_table",
    "options",
    "phase",
    "phase_report",
    "record_history",
    "replay_transformer",
    "reset_peak_stats",
    "resolve_backend",
    "stats",
    "torch_allocator",
    "use_with_torch",
    "version",
]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks training phase `name` for the body of a ``with`` block.

    Nothing is marked on exit: the next phase's mark ends this one, and marking
    "other" between phases would split them in the watermark history.
    """
    mark_phase(name)
    yield


def torch_allocator():
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` backed by memtide."""
    import torch.cuda.memory  # lazily: torch is optional and slow to import

    return torch.cuda.memory.CUDAPluggableAllocator(library_path(), "memtide_malloc", "memtide_free")


def use_with_torch():
    """Makes memtide torch's CUDA allocator and returns the allocator object.

    Must run before the first CUDA allocation of the process: torch refuses to
    swap an allocator that has already handed out memory.
    """
    import torch.cuda.memory

    alloc = torch_allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc
