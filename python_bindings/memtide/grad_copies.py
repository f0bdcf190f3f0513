"""Which gradient tensors are copies of which: how the part of memtide that moves a gradient and the
part that already took it agree that they hold the same values.

The layer window (memtide.window) sends each block's gradients to host memory during backward,
after TieredAdamW's hook has taken the device original into its gradient path; the optimizer then
finds the host copy on ``p.grad``. ``note_copy(copy, source)`` records where the copy came from;
``copy_of(tensor)`` says so again for as long as neither was written since, so the optimizer
knows it need not copy that gradient a second time (memtide.optim.gradients).

The record is kept beside the tensor, not on it, and forgotten when the copy is freed. It is
keyed by identity: a tensor's ``==`` compares elements, which a weakref.WeakKeyDictionary would
call whenever two keys hash alike.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch

# id(copy) -> (a weak reference to the copy, (source address, source version, copy version)).
_copies: Dict[int, Tuple["weakref.ref[torch.Tensor]", Tuple[int, int, int]]] = {}


def note_copy(copy: torch.Tensor, source: torch.Tensor) -> None:
    """Records that `copy` now holds `source`'s values (call it once the copy is made or queued)."""
    key = id(copy)

    def forget(ref: "weakref.ref[torch.Tensor]") -> None:
        # A later tensor may have the same id by now: only this copy's own record goes.
        entry = _copies.get(key)
        if entry is not None and entry[0] is ref:
            del _copies[key]

    _copies[key] = (weakref.ref(copy, forget), (source.data_ptr(), source._version, copy._version))


def copy_of(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """The source `tensor` was copied from, as (its address, its version then), while `tensor` has
    not been written since; else None."""
    entry = _copies.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    address, version, copy_version = entry[1]
    return (address, version) if tensor._version == copy_version else None
