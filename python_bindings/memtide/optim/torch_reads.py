"""What TieredAdamW's step reads of every param each step, in one native pass where it can.

Each step must know, per param, its data pointer and in-place version (a storage a framework
swapped in, ``model.load_state_dict`` writing the master) and its gradient's (an edit after the
gradient's hook: ``clip_grad_norm_``, a framework's unscale). torch charges Python about 100 ns
for each of those reads even warm, several times that right after backward
(bench/results/step-overhead/). ``libmemtide_torch_reads.so``, compiled against the installed
torch's headers when memtide is installed (torch_bridge/torch_reads.cpp), reads them from the
tensors themselves in one call into four int64 arrays, which the step compares whole. The same
library holds the gradient hooks in C++ (memtide.optim.gradients, torch_bridge/gradient_hooks.cpp).

It is optional: without it (a torch without CUDA, whose bridge is not built; headers that did not
compile; another torch than the one it was built against; ``MEMTIDE_TORCH_READS=false``) the step
reads in Python, the same values. :func:`status` says which and why.
"""

from __future__ import annotations

import array
import ctypes
from typing import Callable, Iterable, List, Optional, Sequence

import torch

from .. import _memtide
from ..torch_bridge import install_status, package_file, why_unusable
from .distributed import DTensor, is_dtensor

LIBRARY = "libmemtide_torch_reads.so"
STATUS_FILE = "torch_reads_status.txt"
#: "Nothing sent" in the step's arrays of what the gradient hooks sent: no address or version is it.
NOT_SENT = -(2 ** 63)
#: What the native read writes for a param without a gradient (never a sent address or version).
NO_GRAD = NOT_SENT + 1

_read: Optional[Callable[..., int]] = None
_lib: Optional[ctypes.PyDLL] = None
_why: Optional[str] = None  # why there is no native read (None: not tried yet, or there is one)


def library_path() -> str:
    """Where the library would be (it may be absent: see :func:`build_status`)."""
    return package_file(LIBRARY)


def build_status() -> str:
    """What the install recorded: "built against torch X", or "not built: why"."""
    return install_status(STATUS_FILE)


def _load() -> Optional[Callable[..., int]]:
    global _read, _lib, _why
    if _read is not None or _why is not None:
        return _read
    if _memtide.options().get("torch_reads", "true") != "true":
        _why = "MEMTIDE_TORCH_READS=false"
    else:
        _why = why_unusable(build_status())
    if _why is None:
        try:
            lib = ctypes.PyDLL(library_path())  # PyDLL: the call keeps the GIL, it reads Python objects
            fn, no_grad = lib.memtide_torch_read, lib.memtide_torch_read_no_grad
        except (OSError, AttributeError) as e:  # not a library, or not this one
            _why = f"{library_path()} does not load: {e}"
            return None
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.py_object] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_long]
        no_grad.restype = ctypes.c_int64
        if no_grad() != NO_GRAD:
            _why = f"{library_path()} marks a missing gradient otherwise than this package"
            return None
        _read, _lib = fn, lib
    return _read


def status() -> str:
    """"native" when the step reads in C++, else "python: " and why."""
    return "native" if _load() is not None else f"python: {_why}"


def reset() -> None:
    """Forgets the loaded state, so that the next use looks again (the tests switch the option)."""
    global _read, _lib, _why
    _read = _lib = _why = None


def int64s(n: int, fill: int = 0) -> array.array:
    """n int64 values, all `fill` (the arrays the step compares whole)."""
    return array.array("q", [fill]) * n


def int64s_of(values: Iterable[int]) -> array.array:
    return array.array("q", values)


class ParamReads:
    """Reads `tensors` (plain tensors, Parameters, DTensors) natively, one call a step: each one's
    data pointer and version into `data` and `version`, its gradient's into `grad_data` and
    `grad_version` (NO_GRAD when it has none); a DTensor's are its local shard's, and its
    gradient's local shard's (what TieredAdamW keeps and steps). Made only where the native read
    exists (:func:`for_params`)."""

    def __init__(self, read: Callable[..., int], tensors: Sequence[torch.Tensor]) -> None:
        self.tensors: List[torch.Tensor] = list(tensors)
        n = len(self.tensors)
        self.data, self.version, self.grad_data, self.grad_version = (int64s(n) for _ in range(4))
        # The arrays never grow, so their addresses hold for the object's life.
        self._args = (self.tensors, DTensor, *(a.buffer_info()[0] for a in (self.data, self.version, self.grad_data,
                                                                              self.grad_version)), n)
        self._read = read

    def read(self) -> bool:
        """Reads every tensor now; False when one cannot be read natively (a tensor subclass, no
        storage, a sparse gradient): the caller reads in Python then."""
        return self._read(*self._args) == 0


def for_params(params: Sequence[torch.Tensor]) -> Optional[ParamReads]:
    """A native reader of `params`, or None where there is none or some param is a subclass of
    torch's tensor other than Parameter and DTensor (a quantized param's class): those answer in
    Python."""
    read = _load()
    if read is None or not all(type(p) in _PLAIN or is_dtensor(p) for p in params):
        return None
    return ParamReads(read, params)


_PLAIN = (torch.nn.Parameter, torch.Tensor)



def library() -> Optional[ctypes.PyDLL]:
    """The loaded library, where it is in use (:func:`status`): the gradient hooks
    (memtide.optim.gradients) are in it too."""
    return _lib if _load() is not None else None
