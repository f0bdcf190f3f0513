"""The window's hooks into torch: forward and backward pre/post hooks that fetch blocks ahead of
the computation, gradient hooks that send each finished block's gradients home, and the
saved-tensor hooks that keep what autograd saves from a window buffer as a reference to the block.

A part of LayerWindow (memtide.window.layer_window), which it is mixed into: the state used here
is made in LayerWindow.__init__.
"""

from __future__ import annotations

import time
from typing import Tuple

import torch

from .. import grad_copies


class _Hooks:
    """What the window does at each step of forward and backward."""

    def _make_forward(self, i: int, forward):
        def run(*args, **kwargs):
            # Hooks already active (activation checkpointing's) keep every tensor that is not in a
            # window buffer; the window keeps the ones that are, the same way in the recomputation.
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if outer is None:
                pack, unpack = self._pack, self._unpack
            else:
                outer_pack, outer_unpack = outer

                def pack(t):
                    saved = self._pack(t)
                    return saved if isinstance(saved, _Saved) else (_Outer, outer_pack(t))

                def unpack(saved):
                    if isinstance(saved, tuple) and len(saved) == 2 and saved[0] is _Outer:
                        return outer_unpack(saved[1])
                    return self._unpack(saved)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return forward(*args, **kwargs)
        return run

    def _make_pre_forward(self, i: int):
        def hook(module, args):
            recompute = torch._C._current_graph_task_id() != -1  # checkpoint recomputing in backward
            if not self._grad_hooks:
                self._register_grad_hooks()
            if i == 0 and not recompute:
                self._start_forward()
            self._forwarded[i] = True
            self._wait(i)
            if not recompute and i + self.size < self.n:
                self._fetch(i + self.size)
            if not recompute and self._timing():
                self._sync()
                self._t_fwd[i] = time.perf_counter_ns()
        return hook

    def _make_post_forward(self, i: int):
        def hook(module, args, output):
            if i in self._t_fwd and self._timing():
                self._sync()
                self._profile[i]["forward_ns"] += float(time.perf_counter_ns() - self._t_fwd.pop(i))
            if i == self.n - 1 and not torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                # A pass no backward can follow (evaluation): every parameter goes home, as
                # between iterations, so the optimizer and state_dict see host tensors again.
                for b in range(self.n):
                    if self._bound[b] is not None:
                        self._evict(b)
        return hook

    def _make_pre_backward(self, i: int):
        def hook(module, grad_output):
            if not self._in_backward:
                self._start_backward()
            for j in range(i + 1, self.n):
                if not self._trainable[j]:
                    self._done_backward[j] = True  # no gradients to wait for: done once below it
            for p in self.layouts[i].params:
                g = p.grad
                if g is not None and id(p) not in self._host_grad:
                    # Accumulated by earlier micro-batches (and not cleared since: zero_grad may come
                    # between forward and backward): kept at home; this backward's gradient is added.
                    self._host_grad[id(p)] = g
                    p.grad = None
            self._wait(i)
            below = self._forwarded_below(i)
            if len(below) >= self.size:
                self._try_fetch(below[self.size - 1])
            if self._timing():
                self._t_bwd[i] = time.perf_counter_ns()
        return hook

    def _make_grad_ready(self, i: int):
        def hook(param):
            self._grads_pending[i] -= 1
            if self._grads_pending[i] == 0:
                self._send_grads_home(i)
        return hook

    def _send_grads_home(self, i: int, fetch_next: bool = True) -> None:
        """Every gradient of block i is final: to host memory, and its buffer may be reused (by the
        next block down, with `fetch_next`)."""
        params = [p for p in self.layouts[i].params if p.requires_grad]
        t0 = time.perf_counter_ns()
        stream = self._grad_stream
        if stream is not None:
            # The copies home wait for the kernels that made the gradients, not the host:
            # backward's next kernels are queued meanwhile. Each gradient is held here until
            # its copy is done (whatever the allocator does with record_stream); _end_backward
            # waits for the rest.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            sent = []
        for p in params:
            g = p.grad
            home = self._host_grad.get(id(p))
            if g is None or g is home:  # none, or already home (its block left the window)
                continue
            if home is None:
                home = self._host_tensor_like(p)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        home.copy_(g, non_blocking=True)
                    sent.append(g)
                else:
                    home.copy_(g)
                self._host_grad[id(p)] = home
                # An optimizer whose hook took the original (TieredAdamW) then knows it already
                # has this gradient (memtide.grad_copies).
                grad_copies.note_copy(home, g)
            else:
                # Accumulating into a gradient at home (an earlier micro-batch's, complete
                # since that backward ended): this one comes over first, synchronously.
                home.add_(g.to(home.device))
            p.grad = None
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            self._in_flight.append((done, sent))
            while self._in_flight and self._in_flight[0][0].query():
                self._in_flight.pop(0)
            if self._timing():
                stream.synchronize()  # the profile needs the copy's time, not its launch's
        self._profile[i]["d2h_ns"] = max(self._profile[i]["d2h_ns"], float(time.perf_counter_ns() - t0))
        if i in self._t_bwd and self._timing():
            self._profile[i]["backward_ns"] += float(time.perf_counter_ns() - self._t_bwd.pop(i))
        self._done_backward[i] = True
        self.stats["grad_offloads"] += 1
        if not fetch_next:
            return
        # The nearest block down not yet in, which may be waiting for this buffer (normally the one
        # m + 1 below; nearer when a block still holds its buffer, waiting for a gradient of a
        # parameter the forward never used: that one goes home at the end of backward). Blocks
        # the forward skipped have no backward: they are not counted.
        j = next((b for b in self._forwarded_below(i)[:self.size + 1] if self._slot_of[b] is None), None)
        if j is not None:
            self._try_fetch(j)

    def _forwarded_below(self, i: int):
        """The blocks below i that ran in a forward since the last backward, nearest first."""
        return [b for b in range(i - 1, -1, -1) if self._forwarded[b]]

    def _register_grad_hooks(self) -> None:
        """The hooks that send a block's gradients home. Registered at the first forward, not at
        construction: post-accumulate hooks run in the order they were registered, so an optimizer
        built after the window (TieredAdamW: its hook sends each gradient to its own path at once)
        still sees every gradient before the window takes it off p.grad."""
        self._grad_hooks = True
        for i, layout in enumerate(self.layouts):
            for p in layout.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_ready(i)))

    def _start_forward(self) -> None:
        self._in_backward = False
        if self._backward_ended:
            # Micro-batches' forwards before one backward add up; a backward's record ends here.
            self._forwarded = [False] * self.n
            self._backward_ended = False
        for b in range(self.n):
            if self._bound[b] is not None:
                # Left by a forward that had no backward (its loss dropped): its blocks go home;
                # a backward through that graph would fetch them again.
                self._evict(b)
        if self.requested == "auto" and self.chosen is None and self._timed_iterations >= self.profile_iterations:
            self._choose()

    def _start_backward(self) -> None:
        """The first backward pre-hook of a backward (each backward through a retained graph too)."""
        self._in_backward = True
        # A block the forward skipped gets no backward: done from the start, so its buffer (a
        # prefetch's) is free for the blocks that do.
        self._done_backward = [not ran for ran in self._forwarded]
        self._trainable = [any(p.requires_grad for p in layout.params) for layout in self.layouts]
        self._grads_pending = [sum(1 for p in layout.params if p.requires_grad) for layout in self.layouts]
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Autograd's callback at the end of backward: every block goes home, with its gradients."""
        self._in_backward = False
        for b in range(self.n):
            if any(p.grad is not None and p.grad is not self._host_grad.get(id(p)) for p in self.layouts[b].params):
                # Not sent yet (a param of block 0 got no gradient), or arrived after its block
                # was sent: home now, added to what is there.
                self._send_grads_home(b, fetch_next=False)
        if self._grad_stream is not None:
            self._grad_stream.synchronize()  # the gradients at home are read on the host from here
            self._in_flight.clear()
        if self._timing():
            self._timed_iterations += 1
        self._iteration += 1
        # The next forward starts a new record (not before: a second backward through a retained
        # graph has the same blocks to go through).
        self._backward_ended = True
        for b in range(self.n):
            self._evict(b)
        for layout in self.layouts:
            for p in layout.params:
                g = self._host_grad.pop(id(p), None)
                if g is not None:
                    p.grad = g

    # ---- saved tensors ----------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        slot = self._storage_slot.get(ptr)
        if slot is None or self._owner[slot] is None:
            return t
        # A parameter (or a view of one) in a window buffer: saved as where it is in its block.
        return _Saved(self._owner[slot], t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        b = saved.block
        if self._slot_of[b] is None:
            self._fetch(b, sync=True)
        self._wait(b)
        storage = self._slots[self._slot_of[b]].untyped_storage()
        out = torch.empty(0, dtype=saved.dtype, device=self.device)
        out.set_(storage, saved.offset, saved.shape, saved.stride)
        return out


class _Outer:
    """Marks a tensor the enclosing saved-tensor hooks packed."""


class _Saved:
    """A saved tensor that lives in a window buffer: found again by block and layout."""

    __slots__ = ("block", "dtype", "offset", "shape", "stride")

    def __init__(self, block: int, dtype: torch.dtype, offset: int, shape: Tuple[int, ...],
                 stride: Tuple[int, ...]) -> None:
        self.block = block
        self.dtype = dtype
        self.offset = offset
        self.shape = shape
        self.stride = stride
