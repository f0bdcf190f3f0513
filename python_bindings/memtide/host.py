"""Pinned host memory from memtide's host arenas.

Buffers come from a few large slabs per device, bound to the NUMA node nearest the GPU
(``MEMTIDE_HOST_NODE`` overrides it), first-touched in parallel and registered with the device
once per slab, so a copy from them runs at pinned-memory bandwidth. A tensor's buffer goes back
to its arena when the tensor (and every view of it) is gone.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _memtide

__all__ = ["empty", "node", "placement", "release_free_slabs", "stats"]

# DLPack type codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4.
_DTYPES: Dict[str, Tuple[int, int]] = {
    "float32": (2, 32),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "float64": (2, 64),
    "int8": (0, 8),
    "int16": (0, 16),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
}


def _dtype_code(dtype: Any) -> Tuple[int, int]:
    import torch  # lazily: torch is optional and slow to import

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"memtide.host.empty: dtype must be a torch.dtype, got {dtype!r}")
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        accepted = ", ".join(f"torch.{n}" for n in _DTYPES)
        raise ValueError(f"memtide.host.empty: dtype {dtype} is not supported; accepted: {accepted}")
    return _DTYPES[name]


def _shape(shape: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    bad = TypeError(f"memtide.host.empty: shape must be an int or a sequence of ints, got {shape!r}")
    if isinstance(shape, (bool, str, bytes)):
        raise bad
    if hasattr(shape, "__index__"):
        dims: Sequence[Any] = (shape,)
    else:
        try:
            dims = tuple(shape)
        except TypeError:
            raise bad from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise bad
        out.append(operator.index(d))
    if any(d < 0 for d in out):
        raise ValueError(f"memtide.host.empty: shape {tuple(out)} has a negative dimension")
    return tuple(out)


def _device(device: Any) -> int:
    """An int, or a CUDA torch.device / "cuda:N" string."""
    if isinstance(device, bool):
        raise TypeError(f"memtide.host.empty: device must be a device index, got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        import torch

        try:
            d = torch.device(device)
        except (TypeError, RuntimeError):
            raise TypeError(f"memtide.host.empty: device must be an index or a CUDA device, got {device!r}") from None
        if d.type != "cuda":
            raise ValueError(f"memtide.host.empty: device must be a CUDA device (the GPU the memory serves), got {d}")
        index = 0 if d.index is None else d.index
    count = _memtide.device_count()
    if not 0 <= index < count:
        raise ValueError(f"memtide.host.empty: device {index} is out of range: memtide sees {count} device(s)")
    return index


def empty(shape: Union[int, Sequence[int]], dtype: Any = None, device: Any = 0,
          numa_node: Optional[int] = None):
    """An uninitialized, contiguous CPU tensor in pinned memory from memtide's host arena.

    ``device`` is the GPU the memory serves (an index, ``torch.device("cuda", i)`` or
    ``"cuda:i"``); its slabs are registered with it. ``numa_node`` places the buffer on that
    node (-1 = not bound); by default the device's node (``memtide.host.node(device)``).
    dtype: torch.float32 (default), float16, bfloat16, float64, int8, int16, int32, int64, uint8.
    """
    import torch

    code, bits = _dtype_code(torch.float32 if dtype is None else dtype)
    dims = _shape(shape)
    index = _device(device)
    if numa_node is not None and (isinstance(numa_node, bool) or not isinstance(numa_node, int)):
        raise TypeError(f"memtide.host.empty: numa_node must be an int or None, got {numa_node!r}")
    array = _memtide.host_empty(list(dims), code, bits, index, numa_node)
    return torch.from_dlpack(array)


def stats(device: int = 0, numa_node: Optional[int] = None) -> Dict[str, Any]:
    """The host arena's statistics: reserved, allocated and peak bytes, slabs, bytes per node,
    and seconds spent mapping and binding, touching and registering."""
    return _memtide.host_stats(device, numa_node)


def release_free_slabs(device: int = 0, numa_node: Optional[int] = None) -> int:
    """Unmaps (and unregisters) the arena's slabs that hold no live buffer; returns the bytes."""
    return _memtide.host_release_free_slabs(device, numa_node)


def node(device: int = 0) -> int:
    """The NUMA node serving ``device``'s pinned host buffers (-1 = not bound)."""
    return _memtide.host_node(device)


def placement(tensor, device: int = 0, numa_node: Optional[int] = None) -> Dict[str, Any]:
    """Where a tensor's pages are: nodes of sampled pages (move_pages), and whether all are on the
    arena's node. ``known`` is False without libnuma."""
    if not callable(getattr(tensor, "untyped_storage", None)) or not callable(getattr(tensor, "data_ptr", None)):
        raise TypeError(f"host.placement: expected a torch tensor on the host, got {type(tensor).__name__}")
    nbytes = tensor.untyped_storage().nbytes()
    return _memtide.host_placement(tensor.data_ptr(), max(nbytes, 1), device, numa_node)
