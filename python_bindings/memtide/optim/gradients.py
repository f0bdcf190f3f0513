"""TieredAdamW's gradient path: a hook per param sends each gradient on its way the moment
backward finishes it (CUDA gradients through the engine's own path: upcast on the GPU, D2H on its
streams, checked for NaN/Inf on the way; CPU gradients copied into the flat buffer at once), and
step() gathers what the hooks did not carry or what changed since."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Set, Tuple

import torch

from .. import _memtide
from ..grad_copies import copy_of
from .distributed import local

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Flushed:
    """A gradient the hook sent on its way: which tensor, at which in-place version, its norm."""

    address: Optional[int]  # None: the tensor is not known yet (DDP writes .grad later)
    version: Optional[int]
    norm: Optional[torch.Tensor]
    on_device: bool  # through the engine's gradient path (with its NaN/Inf verdict)
    finite: Optional[bool] = None  # a CPU gradient copied by copy_grad_cpu: its own NaN/Inf verdict
    source: Optional[torch.Tensor] = None  # a CPU gradient the step reads where it lies (not copied)


def _hook(path: "weakref.ref[GradientPath]", i: int, p: torch.Tensor) -> None:
    me = path()
    if me is not None:
        me.ready(i, p)


class GradientPath:
    """The hooks of one TieredAdamW over its current layout (made anew with it)."""

    def __init__(self, opt: Any) -> None:
        # A weak reference: the params outlive the optimizer and must not keep it (and its pinned
        # memory) alive through their hooks.
        self._opt = weakref.ref(opt)
        params = opt._layout.params
        #: The CUDA gradients travel the engine's own path (a real GPU); else they are copied here.
        self.device_path = opt.engine is not None and not opt.engine.host_memory
        self.flushed: List[Optional[_Flushed]] = [None] * len(params)
        #: How CPU gradients are written into the flat buffer: non-temporal stores when the whole
        #: step's streams are larger than the last-level cache (the step reads them from DRAM anyway).
        self.stores = _memtide.out_stores_for(opt._layout.numel)
        self.index = {id(p): i for i, p in enumerate(params)}
        #: Params whose gradients come reduced from DDP's bucket hook (register_ddp), not the hooks.
        self.reduced_by_ddp: Set[int] = set()
        self.follow_ddp(getattr(opt, "_ddp", None))
        #: Params whose gradient step() had to copy itself (changed after its hook ran).
        self.stale: Set[int] = set()
        self._sent_in_backward: List[int] = []  # by the hooks, in the backward now running
        #: (start, n, address, dtype) of the CPU gradients the step reads where they lie (gather()).
        self.sources: List[Tuple[int, int, int, str]] = []
        self._source_tensors: List[Tuple[int, int, torch.Tensor]] = []
        me = weakref.ref(self)
        # Frozen params get none (step() gathers whatever gradient they have later).
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, me, i))
                       for i, p in enumerate(params) if p.requires_grad and p.is_leaf]

    def follow_ddp(self, ddp: Any) -> None:
        """The params of DDP's model (a DdpGradients, or None) take their gradients from its
        bucket hook from now on."""
        self.reduced_by_ddp = set() if ddp is None else {i for p, i in self.index.items() if p in ddp.params}

    @property
    def opt(self) -> Any:
        return self._opt()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def reset(self) -> None:
        """The next backward sends its own gradients."""
        self.flushed = [None] * len(self.flushed)
        self._sent_in_backward = []

    @torch.no_grad()
    def ready(self, i: int, p: torch.Tensor) -> None:
        """Backward has finished param i's gradient (a post-accumulate-grad hook): send it to the
        host gradient buffer now, overlapping the rest of backward, and take its norm where it is.

        CUDA gradients go through the engine's gradient path (upcast on the GPU, D2H on its own
        streams, checked for NaN/Inf on the way); CPU gradients are copied (upcast) at once. With
        gradient accumulation every micro-batch sends the accumulated gradient again: the last,
        complete one is what step() finds.
        """
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
        layout = self.opt._layout if self.opt is not None else None
        if layout is None:
            return
        for i in sent:
            f, g = self.flushed[i], layout.params[i].grad
            if f is not None and f.address is not None and g is not None and local(g).data_ptr() == f.address:
                f.version = local(g)._version

    def reduced(self, i: int, g: torch.Tensor) -> None:
        """DDP has all-reduced param i's gradient (its bucket's hook): send it on its way; what
        `.grad` holds is recorded at the end of backward (record())."""
        self.send(i, g, known=False)

    def record(self, params: List[int]) -> None:
        """Backward has ended and DDP has written these params' `.grad`: it is what was sent."""
        layout = self.opt._layout
        for i in params:
            f, g = self.flushed[i], layout.params[i].grad
            if f is not None and f.address is None and g is not None:
                f.address, f.version = g.data_ptr(), g._version

    @torch.no_grad()
    def send(self, i: int, g: Optional[torch.Tensor], known: bool = True) -> None:
        lo, hi = self.opt._layout.ranges[i]
        if g is None or g.is_sparse or hi == lo:
            return
        if g.is_cuda:
            if not (self.device_path and g.device.index == self.opt.engine.device and g.is_contiguous()
                    and g.dtype in SUPPORTED_DTYPES):
                return  # gathered by step()
            self.opt.engine.push_grad(lo, g.data_ptr(), str(g.dtype).replace("torch.", ""), hi - lo,
                                  torch.cuda.current_stream(g.device).cuda_stream)
            norm = None if self.opt.max_grad_norm is None else torch.linalg.vector_norm(g, dtype=torch.float32)
            self.flushed[i] = _Flushed(*self._identity(g, known), norm, on_device=True)
        elif known and self.direct() and g.is_contiguous() and g.dtype in SUPPORTED_DTYPES:
            # Read where it lies by the step's own pass: nothing copied, nothing converted. A loss
            # scaler needs the NaN/Inf verdict before the step: a scan (a read, no write) gives it.
            g = g.detach()
            finite = bool(_memtide.grads_finite_cpu(g.reshape(-1))) if self.opt.scaler is not None else None
            norm = None if self.opt.max_grad_norm is None else torch.linalg.vector_norm(g, dtype=torch.float32)
            self.flushed[i] = _Flushed(g.data_ptr(), g._version, norm, on_device=False, finite=finite, source=g)
        else:
            grads = self.opt.buffers.grads
            finite = self.copy_host(grads[lo:hi], g)
            norm = None if self.opt.max_grad_norm is None else torch.linalg.vector_norm(grads[lo:hi])
            self.flushed[i] = _Flushed(*self._identity(g, known), norm, on_device=False, finite=finite)
        if self.opt._eager is not None:
            self.opt._eager.grad_ready(i)

    def direct(self) -> bool:
        """Whether CPU gradients are read where they lie rather than copied: an all-CPU engine in
        host memory (policy "cpu"), without updates during backward, NVMe, DDP or FSDP2 (whose
        paths read the gradient buffer)."""
        opt = self.opt
        return (opt.engine is not None and opt.engine.host_memory and opt.policy == "cpu" and opt._eager is None
                and opt.nvme is None and not opt._shards and opt._ddp is None and not self.reduced_by_ddp)

    def release(self) -> None:
        """Forgets the gradients gather() left where they lie (after the step that read them)."""
        self.sources, self._source_tensors = [], []

    def materialize(self) -> None:
        """Copies the gradients gather() left where they lie into the flat buffer (for a step that
        must scan the buffer); afterwards there are no sources."""
        grads = self.opt.buffers.grads
        for lo, hi, g in self._source_tensors:
            self.copy_host(grads[lo:hi], g)
        self.sources, self._source_tensors = [], []

    def copy_host(self, dst: torch.Tensor, g: torch.Tensor) -> Optional[bool]:
        """dst (a slice of the flat fp32 buffer) = g upcast, for a CPU gradient. One pass that also
        gives the NaN/Inf verdict (so the step needs no scan of its own) and, above the last-level
        cache, writes with non-temporal stores; None where torch copies (an odd layout or dtype)."""
        if g.is_contiguous() and g.dtype in SUPPORTED_DTYPES and not g.is_conj() and not g.is_neg():
            return bool(_memtide.copy_grad_cpu(dst, g.reshape(-1).detach(), self.stores))
        dst.copy_(g.reshape(-1))
        return None

    @staticmethod
    def _identity(g: torch.Tensor, known: bool) -> Tuple[Optional[int], Optional[int]]:
        return (g.data_ptr(), g._version) if known else (None, None)

    def gather(self) -> Tuple[List[bool], Optional[bool]]:
        """Makes the flat fp32 gradient buffer hold every gradient: waits for the gradient path,
        then copies (upcast) those it did not carry or that changed since (an in-place edit
        between backward and step). Returns which params have a gradient, and the gradient path's
        NaN/Inf verdict when it carried all of them (else None: the engine scans the host)."""
        layout, grads = self.opt._layout, self.opt.buffers.grads
        has_grad = [False] * len(layout.params)
        verdict = self.opt.engine.finish_grads() if self.device_path else True
        all_on_device = True  # every gradient came with a verdict (the device path's or its copy's)
        stale = []
        for i, p in enumerate(layout.params):
            g = p.grad
            if g is None:
                continue
            g = local(g)
            if g.is_sparse:
                raise RuntimeError("TieredAdamW does not support sparse gradients")
            has_grad[i] = True
            lo, hi = layout.ranges[i]
            if hi == lo:
                continue  # an empty shard (FSDP2 on more ranks than rows): nothing to send or copy
            f = self.flushed[i]
            if f is not None and (f.address == g.data_ptr() and f.version == g._version
                                  or copy_of(g) == (f.address, f.version)):
                # The gradient the hook sent, or an unchanged copy of it (the layer window sent it home).
                all_on_device &= f.on_device or f.finite is not None
                verdict = verdict and f.finite is not False
                continue
            self.flushed[i] = None
            stale.append(i)
        self.stale = set(stale)
        self._source_tensors = [(*layout.ranges[i], f.source) for i, f in enumerate(self.flushed)
                                if f is not None and f.source is not None]
        self.sources = [(lo, hi - lo, g.data_ptr(), str(g.dtype).replace("torch.", ""))
                        for lo, hi, g in self._source_tensors]
        if stale and self.device_path:
            # Gradients the path kept on the GPU go to the host first, so the copies below win.
            self.opt.engine.grads_to_host()
        any_cuda = False
        for i in stale:
            g, (lo, hi) = local(layout.params[i].grad), layout.ranges[i]
            any_cuda |= g.is_cuda
            if g.is_cuda:
                all_on_device = False
                grads[lo:hi].copy_(g.reshape(-1), non_blocking=True)
            else:
                finite = self.copy_host(grads[lo:hi], g)
                all_on_device &= finite is not None
                verdict = verdict and finite is not False
        if any_cuda:
            torch.cuda.synchronize()
        return has_grad, (verdict if all_on_device and any(has_grad) else None)

    def norm_squares(self, has_grad: List[bool]) -> float:
        """Sum of the squared gradient norms, each taken where its gradient is (in the hook); with
        FSDP2, the sharded params' squares are summed over the ranks (every rank gets the same)."""
        b, shards = self.opt.buffers, self.opt._shards
        sq = [0.0, 0.0]  # replicated or local, sharded
        for i, (lo, hi) in enumerate(self.opt._layout.ranges):
            if has_grad[i] and hi > lo:
                f = self.flushed[i]
                norm = f.norm if f is not None and f.norm is not None else torch.linalg.vector_norm(b.grads[lo:hi])
                sq[bool(shards) and shards.sharded[i]] += float(norm) ** 2
        return sq[0] + (shards.sum(sq[1]) if shards else sq[1])

    def finite(self, has_grad: List[bool], verdict: Optional[bool]) -> bool:
        """Whether every gradient of this rank is finite: the gradient path's verdict when it
        carried them all, else a scan of the host buffer."""
        if verdict is not None:
            return bool(verdict)
        grads = self.opt.buffers.grads
        return all(bool(torch.isfinite(grads[lo:hi]).all())
                   for (lo, hi), g in zip(self.opt._layout.ranges, has_grad) if g and hi > lo)
