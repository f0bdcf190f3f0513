"""LayerWindow: construction and what its user calls; the work is in its parts (buffers, hooks,
sizing), mixed in. See the package's docstring."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .buffers import _Buffers, _Layout
from .hooks import _Hooks
from .sizing import _Sizing


class LayerWindow(_Hooks, _Buffers, _Sizing):
    """A sliding window of `blocks` on `device`; the rest of their parameters in host memory.

    Args:
        blocks: the stack (an ``nn.ModuleList`` or a sequence of modules), each called once per
            forward, in order.
        size: blocks in the window (the buffers number one more, for the block coming in), or
            ``"auto"``.
        device: where the blocks compute; default: where their parameters are now.
        profile_iterations: iterations timed before an automatic size is chosen (default 5).
        available: device bytes the window may use (default: free device memory, or memtide's
            headroom when memtide is torch's allocator; on a CPU device it must be given for
            ``"auto"`` to mean anything and defaults to everything fitting).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], size: Union[int, str] = "auto", *,
                 device: Optional[Union[str, torch.device]] = None, profile_iterations: int = 5,
                 available: Optional[int] = None) -> None:
        self.blocks = list(blocks)
        if not self.blocks:
            raise ValueError("LayerWindow: blocks is empty")
        if len({id(b) for b in self.blocks}) != len(self.blocks):
            raise ValueError("LayerWindow: a block appears twice in blocks")
        if not (size == "auto" or (isinstance(size, int) and not isinstance(size, bool) and size >= 1)):
            raise ValueError(f"LayerWindow: size must be a positive int or 'auto', got {size!r}")
        if not isinstance(profile_iterations, int) or isinstance(profile_iterations, bool) or profile_iterations < 1:
            raise ValueError(f"LayerWindow: profile_iterations must be a positive int, got {profile_iterations!r}")
        if available is not None and (not isinstance(available, int) or available <= 0):
            raise ValueError(f"LayerWindow: available must be a positive number of bytes, got {available!r}")
        for i, b in enumerate(self.blocks):
            if getattr(b, "_memtide_window", None) is not None:
                raise ValueError(f"LayerWindow: block {i} already belongs to a LayerWindow; remove() that one first")
        self.layouts = [_Layout([p for p in b.parameters(recurse=True)]) for b in self.blocks]
        seen: Dict[int, int] = {}
        for i, layout in enumerate(self.layouts):
            if not layout.params:
                raise ValueError(f"LayerWindow: block {i} has no parameters")
            for p in layout.params:
                if id(p) in seen:
                    raise ValueError(f"LayerWindow: a parameter is shared by blocks {seen[id(p)]} and {i}; "
                                     "tied weights cannot leave the device one block at a time")
                seen[id(p)] = i
        for i, layout in enumerate(self.layouts):
            for p in layout.params:
                if p.is_cuda and p.untyped_storage().nbytes() > p.numel() * p.element_size():
                    raise ValueError(
                        f"LayerWindow: a parameter of block {i} is a view of a larger device buffer (an optimizer's "
                        "flat copy of the model, as TieredAdamW keeps CUDA fp16/bf16 params): the window would "
                        "take the parameter to host memory and whatever writes that buffer would no longer reach "
                        "it. Build the LayerWindow before the optimizer")
        first = self.layouts[0].params[0]
        self.device = torch.device(device) if device is not None else first.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        for i, layout in enumerate(self.layouts):
            for p in layout.params:
                if p.device != first.device:
                    raise ValueError(f"LayerWindow: block {i} has parameters on {p.device}, block 0 on {first.device}")
        self.n = len(self.blocks)
        self.profile_iterations = profile_iterations
        self.available = available
        self.requested = size
        self.slot_bytes = max(layout.bytes for layout in self.layouts)

        # Home: one host buffer per block holding its parameters (pinned when the device is a GPU),
        # except for a parameter that is already a view of someone's larger host buffer (an
        # optimizer's flat buffer, as TieredAdamW makes them, which its step writes in place):
        # that stays its home. The window moves blocks in and out of the device.
        self._host: List[torch.Tensor] = []
        self._home: List[List[torch.Tensor]] = []  # where each parameter lives out of the window
        self._flat_home = [True] * len(self.layouts)  # every home is still the block's one buffer
        for b, layout in enumerate(self.layouts):
            flat = self._host_buffer(layout.bytes)
            homes = layout.views(flat)
            for k, p in enumerate(layout.params):
                # The window moves this param between its home and device slots: an optimizer
                # must not take a move for someone replacing its values (TieredAdamW's follow).
                p._memtide_windowed = True
                if self._owned_elsewhere(p):
                    homes[k] = p.data
                    self._flat_home[b] = False
                else:
                    with torch.no_grad():
                        homes[k].copy_(p.data)
                    p.data = homes[k]
            self._host.append(flat)
            self._home.append(homes)
            self._drop_unused_host(b)
        self._host_grad: Dict[int, torch.Tensor] = {}  # id(param) -> its gradient in host memory

        self.size = 0
        self._slots: List[torch.Tensor] = []
        self._slot_of: List[Optional[int]] = [None] * self.n   # block -> slot while resident
        self._owner: List[Optional[int]] = []                  # slot -> block
        self._ready: List[Any] = [None] * self.n               # block -> copy-done event (GPU)
        self._staged: List[Optional[List[int]]] = [None] * self.n  # copied, not bound: param versions
        self._bound: List[Optional[List[int]]] = [None] * self.n   # bound: param versions then
        self._storage_slot: Dict[int, int] = {}                # slot storage data_ptr -> slot
        self._done_backward = [False] * self.n
        self._forwarded = [False] * self.n  # block -> ran in a forward since the last backward
        self._backward_ended = False
        self._grads_pending = [0] * self.n
        self._trainable = [True] * self.n
        self._in_backward = False
        self._iteration = 0
        self._profile: List[Dict[str, float]] = [dict(forward_ns=0.0, backward_ns=0.0, h2d_ns=0.0, d2h_ns=0.0)
                                                 for _ in range(self.n)]
        self._timed_iterations = 0
        self._t_fwd: Dict[int, float] = {}
        self._t_bwd: Dict[int, float] = {}
        self.chosen: Optional[Dict[str, Any]] = None
        self.stats = {"fetches": 0, "sync_fetches": 0, "evictions": 0, "grad_offloads": 0}

        # Parameters come in on one stream and gradients go home on another: PCIe carries both
        # directions at once, as STRONGHOLD overlaps them.
        self._peak_reset = False  # torch's peak statistics were reset for the profiled iterations
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._grad_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._in_flight: List[Tuple[Any, List[torch.Tensor]]] = []  # (copies-done event, their gradients)
        self._resize(self._initial_size())
        self._handles = []
        self._grad_hooks = False  # registered at the first forward (see _register_grad_hooks)
        self._orig_forward = []
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_forward(i)))
            self._handles.append(block.register_forward_hook(self._make_post_forward(i)))
            self._handles.append(block.register_full_backward_pre_hook(self._make_pre_backward(i)))
            self._orig_forward.append(block.forward)
            block.forward = self._make_forward(i, block.forward)
            block._memtide_window = self

    def evict_all(self) -> None:
        """Sends every block home now (their gradients stay where they are), giving the window's
        buffers back to be refilled when blocks are next used: before an evaluation pass, or to
        hand device memory to something else between forward and backward."""
        for b in range(self.n):
            if self._slot_of[b] is not None and self._in_backward and not self._done_backward[b]:
                # Its gradients are not out yet: they would be lost with the buffer.
                raise RuntimeError(f"LayerWindow.evict_all: block {b} is in the middle of its backward")
        self._sync()
        for b in range(self.n):
            self._evict(b)

    def prefetch(self) -> None:
        """Starts copying the first window of the next forward in (the update phase's free device
        memory is the time for it; attach_optimizer calls this after each step)."""
        for b in range(min(self.size, self.n)):
            self._fetch(b, bind=False)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Prefetches the first window whenever `optimizer` finishes a step; returns the handle."""
        handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.prefetch())
        self._handles.append(handle)
        return handle

    def resident(self) -> List[int]:
        """The blocks whose parameters are in device memory now."""
        return [b for b in range(self.n) if self._slot_of[b] is not None]

    def remove(self) -> None:
        """Takes the hooks off; every block's parameters go back to device memory of their own."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for block, forward in zip(self.blocks, self._orig_forward):
            if "forward" in block.__dict__:
                del block.forward
            block._memtide_window = None
        for b in range(self.n):
            self._evict(b)
        for layout in self.layouts:
            for p in layout.params:
                p._memtide_windowed = False
                p.data = p.data.to(self.device, copy=True)
                if p.grad is not None:
                    p.grad = p.grad.to(self.device)
        self._slots = []
        self._storage_slot = {}

    def __repr__(self) -> str:
        return (f"LayerWindow({self.n} blocks, size {self.size} of requested {self.requested!r}, "
                f"{self.slot_bytes} bytes per buffer, on {self.device})")
