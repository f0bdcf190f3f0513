"""TieredAdamW's gradient path: a hook per param hands each gradient to the engine's step protocol
(memtide._memtide.StepProtocol, tiering::StepProtocol) the moment backward finishes it, which sends
it on its way (CUDA gradients through the engine's own path: upcast on the GPU, D2H on its streams,
checked for NaN/Inf on the way; CPU gradients copied into the flat buffer at once, or read where
they lie by the step) and keeps the verdict its kernel gave. What stays here is what only torch
knows: which tensor is a param's gradient now, and whether it changed since its hook ran (torch's
version counters); step() sends again what changed."""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, List, Optional, Set, Tuple

import torch

from .. import _memtide
from ..grad_copies import copy_of
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
        self.follow_ddp(opt.distribution.ddp)
        #: Params whose gradient step() had to send itself (changed after its hook ran).
        self.stale: Set[int] = set()
        self._sent_in_backward: List[int] = []  # by the hooks, in the backward now running
        self._direct: Optional[bool] = None  # direct(), once per step: every hook asks it
        me = weakref.ref(self)
        # Frozen params get none (step() gathers whatever gradient they have later).
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(params) if p.requires_grad and p.is_leaf]

    def follow_ddp(self, ddp: Any) -> None:
        """The params of DDP's model (a DdpGradients, or None) take their gradients from its
        bucket hook from now on."""
        self.reduced_by_ddp = set() if ddp is None else {i for p, i in self.index.items() if p in ddp.params}
        self._direct = None

    @property
    def opt(self) -> Any:
        return self._opt()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def reset(self) -> None:
        """The next backward sends its own gradients (the protocol forgets those it holds)."""
        self.addresses[:] = self.versions[:] = self._unsent
        if self._direct:  # only gradients read where they lie are kept
            self.sources = [None] * len(self.sources)
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
        g = None if p.grad is None else local(p.grad)  # FSDP2: this rank's reduced shard
        self.send(i, g)
        if not self._sent_in_backward:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            except RuntimeError:
                return  # outside backward (FSDP2's manual finalization): step() checks every version
        self._sent_in_backward.append(i)

    def _backward_ended(self) -> None:
        """The gradients the hooks sent in this backward are what `.grad` holds at its end: their
        version counters are taken again. FSDP2's sharded gradients are views of one reduce-scatter
        output and share its counter, so accumulating into one param's gradient (a reduce in every
        micro-batch) counts as a write to the others sent before it; nothing else writes them
        between their hook and the end of backward."""
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
        if g is None or g.is_sparse or hi == lo:
            return
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
