"""TieredAdamW's gradient path: a hook per param hands each gradient to the engine's step protocol
(memtide._memtide.StepProtocol, tiering::StepProtocol) the moment backward finishes it, which sends
it on its way (CUDA gradients through the engine's own path: upcast on the GPU, D2H on its streams,
checked for NaN/Inf on the way; CPU gradients copied into the flat buffer at once, or read where
they lie by the step) and keeps the verdict its kernel gave. What stays here is what only torch
knows: which tensor is a param's gradient now, and whether it changed since its hook ran (torch's
version counters); step() sends again what changed."""

from __future__ import annotations

import array
import ctypes
import functools
import operator
import weakref
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch

from .. import _memtide
from ..grad_copies import copy_of
from . import torch_reads
from .distributed import local
from .torch_reads import NOT_SENT, ParamReads, int64s, int64s_of

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ROUTE = _memtide.GradRoute
_GRAD = operator.attrgetter("grad")
VERSION = operator.attrgetter("_version")  # torch's count of in-place writes to a tensor
_DATA_PTR = torch.Tensor.data_ptr  # torch's own (Accelerate sets an int attribute of that name on some params)
#: The address of a gradient sent before `.grad` holds it (DDP's bucket): record() takes it at the end of backward.
_UNKNOWN = -1


def _hook(path: "weakref.ref[GradientPath]", i: int, p: torch.Tensor) -> None:
    me = path()
    if me is not None:
        me.ready(i, p)


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}  # the engine's


class GradientPath:
    """The hooks of one TieredAdamW over its current layout (made anew with it, with its protocol)."""

    def __init__(self, opt: Any) -> None:
        # A weak reference: the params outlive the optimizer and must not keep it (and its pinned
        # memory) alive through their hooks.
        self._opt = weakref.ref(opt)
        params = opt.layout.params
        #: The CUDA gradients travel the engine's own path (a real GPU); else they are copied here.
        self.device_path = opt.engine is not None and not opt.engine.host_memory
        n = len(params)
        #: What each param's hook sent: the gradient's address and in-place version (NOT_SENT:
        #: nothing; address _UNKNOWN: sent before `.grad` held it), and a CPU gradient the step
        #: reads where it lies, kept alive until then. int64 arrays, so that step() compares them
        #: whole with what it reads (gather).
        self.addresses, self.versions = int64s(n, NOT_SENT), int64s(n, NOT_SENT)
        # reset() copies it over them: no allocation after the step (the first sizable one after
        # backward costs tens of us: glibc consolidates the small blocks backward freed).
        self._unsent = int64s(n, NOT_SENT)
        self.sources: List[Optional[torch.Tensor]] = [None] * n
        self._every = b"\x01" * n  # has_grad when every param has the gradient its hook sent
        self.index = {id(p): i for i, p in enumerate(params)}
        #: Params whose gradients come reduced from DDP's bucket hook (register_ddp), not the hooks.
        self.reduced_by_ddp: Set[int] = set()
        #: Params whose gradient step() had to send itself (changed after its hook ran).
        self.stale: Set[int] = set()
        self._sent_in_backward: List[int] = []  # by the hooks, in the backward now running
        self._direct: Optional[bool] = None  # direct(), once per step: every hook asks it
        me = weakref.ref(self)
        # Frozen params get none (step() gathers whatever gradient they have later). The hooks are
        # C++ where the library is in use (GradientHooks), but for FSDP2's DTensors, whose gradients
        # FSDP2 finalizes itself, and for a LayerWindow's params, whose own hook, registered at its
        # first forward, would take the one slot torch keeps for a C++ hook.
        hooked = [p.requires_grad and p.is_leaf for p in params]
        native = [h and not getattr(p, "_memtide_windowed", False) for h, p in zip(hooked, params)]
        #: The C++ hooks, or None (every hook is Python's).
        self.native: Optional[GradientHooks] = None
        if opt.protocol is not None and not opt.distribution.dtensors and any(native):
            self.native = GradientHooks.make(params, [hi - lo for lo, hi in opt.layout.ranges], native,
                                             functools.partial(_hook, me), opt.protocol, self.addresses, self.versions)
        if self.native is not None:
            hooked = [h and not n for h, n in zip(hooked, native)]
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(params) if hooked[i]]
        self._native_keeps = False  # the C++ hooks keep the gradients they send (read where they lie)
        self.follow_ddp(opt.distribution.ddp)

    def follow_ddp(self, ddp: Any) -> None:
        """The params of DDP's model (a DdpGradients, or None) take their gradients from its
        bucket hook from now on."""
        self.reduced_by_ddp = set() if ddp is None else {i for p, i in self.index.items() if p in ddp.params}
        self._direct = None
        self._route_native()

    def _route_native(self) -> None:
        """Tells the C++ hooks the route a CPU gradient takes, as send() would choose it (Python's
        hook where send() does more than hand it over: updates during backward), and which params'
        hooks do nothing, as ready() does nothing for them (DDP's)."""
        if self.native is None:
            return
        if self.opt.backward_updates is not None:
            route = GradientHooks.PYTHON
        else:
            route = (_ROUTE.in_place if self.direct() else _ROUTE.host_copy).value
        self._native_keeps = route == _ROUTE.in_place.value
        self.native.route(route, skip=self.reduced_by_ddp)

    @property
    def opt(self) -> Any:
        return self._opt()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.native is not None:
            self.native.remove()
            self.native = None

    def reset(self) -> None:
        """The next backward sends its own gradients (the protocol forgets those it holds)."""
        self.addresses[:] = self.versions[:] = self._unsent
        if self._direct:  # only gradients read where they lie are kept
            self.sources = [None] * len(self.sources)
        if self._native_keeps:
            self.native.reset()
        self._sent_in_backward = []
        self._direct = None
        opt = self.opt
        if opt is not None and opt.protocol is not None:
            opt.protocol.reset()

    def ready(self, i: int, p: torch.Tensor) -> None:
        """Backward has finished param i's gradient (a post-accumulate-grad hook): send it on its
        way now, overlapping the rest of backward. With gradient accumulation every micro-batch
        sends the accumulated gradient again: the last, complete one is what step() finds."""
        if i in self.reduced_by_ddp:
            return  # the local gradient, before DDP's all-reduce: the bucket hook sends the reduced one
        grad = p.grad
        g = None if grad is None else local(grad)  # FSDP2: this rank's reduced shard
        self.send(i, g)
        if g is grad:
            # A plain gradient: what it holds at step() is what was sent unless something wrote it
            # since, such as a hook registered after this one (a new version, which step() sends).
            return
        if not self._sent_in_backward:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            except RuntimeError:
                return  # outside backward (FSDP2's manual finalization): step() checks every version
        self._sent_in_backward.append(i)

    def _backward_ended(self) -> None:
        """The sharded gradients the hooks sent in this backward are what `.grad` holds at its end:
        their version counters are taken again. FSDP2's sharded gradients are views of one
        reduce-scatter output and share its counter, so accumulating into one param's gradient (a
        reduce in every micro-batch) counts as a write to the others sent before it; nothing else
        writes them between their hook and the end of backward. (Not so for plain gradients: a hook
        registered after this path's may edit one in place, and the step must send that again.)"""
        sent, self._sent_in_backward = self._sent_in_backward, []
        layout = self.opt.layout if self.opt is not None else None
        if layout is None:
            return
        addresses, versions = self.addresses, self.versions
        for i in sent:
            address, g = addresses[i], layout.params[i].grad
            if address != NOT_SENT and g is not None and local(g).data_ptr() == address:
                versions[i] = local(g)._version

    def reduced(self, i: int, g: torch.Tensor) -> None:
        """DDP has all-reduced param i's gradient (its bucket's hook): send it on its way; what
        `.grad` holds is recorded at the end of backward (record())."""
        self.send(i, g, known=False)

    def record(self, params: List[int]) -> None:
        """Backward has ended and DDP has written these params' `.grad`: it is what was sent."""
        layout = self.opt.layout
        for i in params:
            g = layout.params[i].grad
            if self.addresses[i] == _UNKNOWN and g is not None:
                self.addresses[i], self.versions[i] = g.data_ptr(), g._version

    def send(self, i: int, g: Optional[torch.Tensor], known: bool = True, in_backward: bool = True) -> None:
        """Hands param i's gradient `g` to the protocol: through the engine's device path, copied
        into the flat buffer, or (an all-CPU step that reads it where it lies) kept as it is.
        `known`: `g` is what `.grad` will hold (not DDP's bucket, written there later).
        `in_backward`: the updates during backward may use it (not at step(): they are settled)."""
        opt = self.opt
        lo, hi = opt.layout.ranges[i]
        if g is None or g.is_sparse or hi == lo or g.numel() != hi - lo:
            return  # nothing to send; or a param resized since the layout was made, which step() refuses
        stream, source = 0, None
        if g.is_cuda:
            if not (self.device_path and g.device.index == opt.engine.device and g.is_contiguous()
                    and g.dtype in SUPPORTED_DTYPES):
                return  # gathered by step()
            how, stream = _ROUTE.device_path, torch.cuda.current_stream(g.device).cuda_stream
        elif not (g.is_contiguous() and g.dtype in SUPPORTED_DTYPES and not g.is_conj() and not g.is_neg()):
            with torch.no_grad():  # a gradient of create_graph=True must not make the buffer part of a graph
                opt.buffers.grads[lo:hi].copy_(g.reshape(-1))  # no kernel of memtide reads this layout: torch copies
            opt.protocol.grad_written(i)
            self._sent(i, g, known, None)
            return
        elif known and self.direct():
            how, source = _ROUTE.in_place, g  # read where it lies by the step's own pass (kept alive until then)
        else:
            how = _ROUTE.host_copy
        eager = opt.backward_updates if in_backward and opt.last_micro_batch else None
        if eager is not None:
            eager.watch()
        complete = opt.protocol.grad_ready(i, g.data_ptr(), _DTYPE_NAMES[g.dtype], hi - lo, how, stream,
                                           eager is not None)
        self._sent(i, g, known, source)
        if complete:
            eager.start(complete)

    def direct(self) -> bool:
        """Whether CPU gradients are read where they lie rather than copied: an all-CPU engine in
        host memory (policy "cpu"), without updates during backward, NVMe, DDP or FSDP2 (whose
        paths read the gradient buffer)."""
        if self._direct is None:
            opt = self.opt
            self._direct = (opt.engine is not None and opt.engine.host_memory and opt.policy == "cpu"
                            and opt.backward_updates is None and opt.nvme is None
                            and opt.distribution.kind == "none" and not self.reduced_by_ddp)
        return self._direct

    def _sent(self, i: int, g: torch.Tensor, known: bool, source: Optional[torch.Tensor]) -> None:
        if known:
            self.addresses[i], self.versions[i] = g.data_ptr(), g._version
        else:
            self.addresses[i], self.versions[i] = _UNKNOWN, NOT_SENT
        self.sources[i] = source

    def gather(self, reads: Optional[ParamReads] = None) -> Tuple[bytes, List[bool]]:
        """Makes the protocol hold every gradient: waits for the gradient path, then sends again
        those the hooks did not send or that changed since (an in-place edit between backward and
        step: clip_grad_norm_, a framework's unscale). `reads`: the step's native read of the
        params, made since backward ended (None: read here). Returns which params have a gradient
        (one byte each), and which were sent again (stale; empty when none was)."""
        opt = self.opt
        self.stale = set()
        if reads is not None:
            # Every param with the gradient its hook sent, unchanged since: two array compares.
            fresh = reads.grad_data == self.addresses and reads.grad_version == self.versions
        elif not opt.distribution.dtensors:
            # The same in Python: three C-level passes, each read costing what torch charges for
            # it, about 100 ns warm (bench/results/step-overhead/*-gather.md). A missing gradient
            # (None) or a sparse one raises here and takes the loop below.
            try:
                grads = list(map(_GRAD, opt.layout.params))
                fresh = (int64s_of(map(_DATA_PTR, grads)) == self.addresses and
                         int64s_of(map(VERSION, grads)) == self.versions)
            except (TypeError, RuntimeError):
                fresh = False
        else:
            fresh = False
        if fresh:
            opt.protocol.collect([])
            return self._every, []
        return self._gather_each()

    def _gather_each(self) -> Tuple[bytes, List[bool]]:
        opt = self.opt
        layout = opt.layout
        n = len(layout.params)
        has_grad, stale = bytearray(n), [False] * n
        sharded = opt.distribution.dtensors
        addresses, versions = self.addresses, self.versions
        for i, p in enumerate(layout.params):
            g = p.grad
            if g is None:
                continue
            if sharded:
                g = local(g)
            if g.is_sparse:
                raise RuntimeError("TieredAdamW does not support sparse gradients")
            has_grad[i] = 1
            address = addresses[i]
            if address != NOT_SENT and (address == g.data_ptr() and versions[i] == g._version
                                        or copy_of(g) == (address, versions[i])):
                continue  # the gradient the hook sent, or an unchanged copy of it (the layer window sent it home)
            lo, hi = layout.ranges[i]
            if hi == lo:
                continue  # an empty shard (FSDP2 on more ranks than rows): nothing to send or copy
            addresses[i] = versions[i] = NOT_SENT
            self.sources[i] = None
            stale[i] = True
            self.stale.add(i)
        opt.protocol.collect(stale)
        any_cuda = False
        for i in self.stale:
            g, (lo, hi) = local(layout.params[i].grad), layout.ranges[i]
            if g.is_cuda:
                any_cuda = True
                opt.buffers.grads[lo:hi].copy_(g.reshape(-1), non_blocking=True)
                opt.protocol.grad_written(i)
            else:
                self.send(i, g, in_backward=False)
        if any_cuda:
            torch.cuda.synchronize()
        return bytes(has_grad), stale


class GradientHooks:
    """The gradient hooks in C++ (torch_bridge/gradient_hooks.cpp, in the library of
    memtide.optim.torch_reads): each hooked param's post-accumulate-grad hook hands its gradient to
    the step protocol from autograd's thread, without the GIL, and writes what it sent into the
    path's `addresses` and `versions`. Where it cannot (a GPU, sparse or non-contiguous gradient),
    or while the route is PYTHON, it calls `fallback(i, param)`: the Python hook. A Python hook
    registered on the param later takes its place (torch keeps one C++ hook object per param):
    step() then sends that gradient itself, as it sends any it finds unsent.

    Why: a Python hook runs in the middle of backward, whose kernels have just streamed the layer
    through the caches; each object it touches misses (about 20 us a hook on a 50M-param MLP,
    against 1-2 us warm) and it must take the GIL."""

    #: The route that sends every gradient through the Python hook (the others are GradRoute's values).
    PYTHON = -1
    _declared: Set[int] = set()

    def __init__(self, lib: ctypes.PyDLL, params: Sequence[torch.Tensor], sizes: Sequence[int], hooked: Sequence[bool],
                 fallback: Callable[[int, torch.Tensor], None], protocol: Any,
                 addresses: array.array, versions: array.array) -> None:
        entry, native = protocol.grad_entry
        # The arrays never grow (GradientPath assigns into them), so their addresses hold.
        sizes = torch_reads.int64s_of(sizes)
        handle = lib.memtide_gradient_hooks_make(list(params), bytes(map(bool, hooked)), fallback, protocol, entry,
                                                 native, addresses.buffer_info()[0], versions.buffer_info()[0],
                                                 sizes.buffer_info()[0], (addresses, versions, sizes), len(params))
        self._lib, self._handle, self._n = lib, handle, len(params)
        # Taken off when this object goes, or at exit (the hooks call into Python).
        self._free = weakref.finalize(self, lib.memtide_gradient_hooks_free, handle)

    @classmethod
    def make(cls, params: Sequence[torch.Tensor], sizes: Sequence[int], hooked: Sequence[bool],
             fallback: Callable[[int, torch.Tensor], None], protocol: Any, addresses: array.array,
             versions: array.array) -> Optional["GradientHooks"]:
        """Hooks on the `hooked` params, whose gradients have `sizes` elements (a gradient of
        another size is left to step(), which refuses a resized param), or None where the library is not in use
        (memtide.optim.torch_reads.status()): Python's hooks serve then."""
        lib = torch_reads.library()
        if lib is None:
            return None
        if id(lib) not in cls._declared:
            p = ctypes.c_void_p
            for name, restype, argtypes in (
                    ("make", p, [ctypes.py_object, ctypes.c_char_p, ctypes.py_object, ctypes.py_object, p, p, p, p, p,
                                 ctypes.py_object, ctypes.c_long]),
                    ("route", None, [p, ctypes.c_int]), ("skip", None, [p, ctypes.c_char_p]),
                    ("reset", None, [p]), ("sent", ctypes.c_int64, [p]),
                    ("free", None, [p]), ("depth", ctypes.c_long, [ctypes.py_object])):
                fn = getattr(lib, "memtide_gradient_hooks_" + name)
                fn.restype, fn.argtypes = restype, argtypes
            cls._declared.add(id(lib))
        return cls(lib, params, sizes, hooked, fallback, protocol, addresses, versions)

    def route(self, route: int, skip: Set[int] = frozenset()) -> None:
        """Every gradient from now on takes `route` (a GradRoute's value), or Python's hook (PYTHON),
        but those of the params in `skip`, whose hooks do nothing."""
        if self._free.alive:
            self._lib.memtide_gradient_hooks_route(self._handle, route)
            self._lib.memtide_gradient_hooks_skip(self._handle, bytes(i in skip for i in range(self._n)))

    def reset(self) -> None:
        """The next backward sends its own: the gradients kept for the step to read are let go."""
        if self._free.alive:
            self._lib.memtide_gradient_hooks_reset(self._handle)

    @property
    def sent(self) -> int:
        """How many gradients these hooks handed over themselves (not through Python)."""
        return self._lib.memtide_gradient_hooks_sent(self._handle) if self._free.alive else 0

    def remove(self) -> None:
        self._free()

    @staticmethod
    def depth(param: torch.Tensor) -> int:
        """How many memtide hooks `param` holds now (one per live optimizer over it; 0 where the
        library is not in use)."""
        lib = torch_reads.library()
        return 0 if lib is None or id(lib) not in GradientHooks._declared else lib.memtide_gradient_hooks_depth(param)
