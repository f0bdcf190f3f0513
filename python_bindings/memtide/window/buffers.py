"""The window's buffers: each block's layout in a flat buffer, its home in host memory, and the
pool of device buffers that blocks are copied into, bound to and evicted from, round robin.

A part of LayerWindow (memtide.window.layer_window), which it is mixed into: the state used here
is made in LayerWindow.__init__.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

_ALIGN = 256  # bytes: every parameter of a block starts on this boundary in its buffer


class _Layout:
    """Where each parameter of one block sits in a flat byte buffer."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.offsets: List[int] = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += (p.numel() * p.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        self.bytes = offset

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's tensor inside `flat` (a uint8 buffer at least self.bytes long)."""
        out = []
        for p, off in zip(self.params, self.offsets):
            n = p.numel() * p.element_size()
            out.append(flat[off:off + n].view(p.dtype).view(p.shape))
        return out


class _Buffers:
    """Moves blocks between their homes and the window's device buffers."""

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            from .. import host

            return host.empty((max(nbytes, 1),), dtype=torch.uint8, device=self.device.index or 0)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def _resize(self, size: int) -> None:
        """Evicts every block and makes size + 1 buffers (size blocks and one coming in)."""
        for b in range(self.n):
            self._evict(b)
        self._slots = []
        self._storage_slot = {}
        buffers = size + 1 if size < self.n else self.n
        try:
            for _ in range(buffers):
                self._slots.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
        except torch.OutOfMemoryError as e:
            self._slots = []
            raise torch.OutOfMemoryError(
                f"LayerWindow: a window of {size} block(s) needs {buffers} buffers of {self.slot_bytes} bytes "
                f"({buffers * self.slot_bytes} bytes) on {self.device}: {e}") from None
        for s, t in enumerate(self._slots):
            self._storage_slot[t.untyped_storage().data_ptr()] = s
        self._owner = [None] * len(self._slots)
        self.size = size

    def _fetch(self, b: int, sync: bool = False, bind: bool = True) -> None:
        """Copies block b into a free buffer (evicting a block that is done with its buffer) and,
        with `bind`, points its parameters there. An unbound block (a prefetch between iterations)
        leaves the parameters at home, where the user may still change them; _bind checks."""
        if self._slot_of[b] is not None:
            if bind:
                self._bind(b)
            return
        slot = self._free_slot(b)
        if slot is None:
            raise RuntimeError(f"LayerWindow: no buffer is free for block {b}: all {len(self._slots)} hold blocks "
                               f"still in use ({self.resident()}). The window follows the stack's order: each block "
                               "called once per forward, 0 to n-1 (blocks may be skipped); a block called again or "
                               "out of order needs a window of every block (size >= its number of blocks)")
        t0 = time.perf_counter_ns()
        self._adopt_homes(b)
        if self._copy_stream is not None:
            # The copy may not start before the buffer's previous block is done with it on the
            # compute stream (its gradients are tensors of their own, copied home on another).
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._copy_in(b, slot, non_blocking=True)
                event = torch.cuda.Event(enable_timing=False)
                event.record(self._copy_stream)
            self._ready[b] = event
            if sync or self._timing():
                event.synchronize()  # a profile needs the copy's time, not its launch's
        else:
            self._copy_in(b, slot, non_blocking=False)
        self._profile[b]["h2d_ns"] = max(self._profile[b]["h2d_ns"], float(time.perf_counter_ns() - t0))
        self._owner[slot] = b
        self._slot_of[b] = slot
        self._staged[b] = [p._version for p in self.layouts[b].params]
        self.stats["fetches"] += 1
        self.stats["sync_fetches"] += int(sync)
        if bind:
            self._bind(b)

    def _bind(self, b: int) -> None:
        """Points block b's parameters at its buffer (the copy was started by _fetch)."""
        staged = self._staged[b]
        if staged is None:
            return
        self._staged[b] = None
        params = self.layouts[b].params
        if any(p._version != v for p, v in zip(params, staged)):
            # Changed at home after the prefetch (a second step, load_state_dict, an EMA): again.
            slot = self._slot_of[b]
            self._owner[slot] = None
            self._slot_of[b] = None
            self._ready[b] = None
            self._fetch(b, sync=False)
            return
        views = self.layouts[b].views(self._slots[self._slot_of[b]])
        for p, v in zip(params, views):
            p.data = v  # a gradient at home stays on p.grad until the block's backward begins
        self._bound[b] = [p._version for p in params]

    def _owned_elsewhere(self, p: torch.Tensor) -> bool:
        on_host = p.device.type == "cpu"
        larger = p.untyped_storage().nbytes() > p.numel() * p.element_size()
        return on_host and larger and (self.device.type != "cpu" or p.is_contiguous())

    def _adopt_homes(self, b: int) -> None:
        """A block out of the window has its parameters at home; if something re-pointed one
        (TieredAdamW makes each parameter a view of its own flat buffer, which its step writes),
        that is the parameter's home from now on."""
        for k, p in enumerate(self.layouts[b].params):
            home = self._home[b][k]
            if p.data.data_ptr() != home.data_ptr() or p.data.device != home.device:
                self._home[b][k] = p.data
                self._flat_home[b] = False
        self._drop_unused_host(b)

    def _drop_unused_host(self, b: int) -> None:
        """Gives back block b's own host buffer once no parameter lives in it (each has an
        optimizer's flat buffer for its home): for a model past the GPU that is all its weights
        again in pinned memory."""
        flat = self._host[b]
        if flat.numel() == 0 or self._flat_home[b]:
            return
        lo = flat.data_ptr()
        hi = lo + flat.numel()
        if not any(home.device == flat.device and lo <= home.data_ptr() < hi for home in self._home[b]):
            self._host[b] = flat.new_empty(0)

    def _copy_in(self, b: int, slot: int, non_blocking: bool) -> None:
        layout = self.layouts[b]
        if self._flat_home[b]:  # one copy for the whole block
            self._slots[slot][:layout.bytes].copy_(self._host[b][:layout.bytes], non_blocking=non_blocking)
            return
        for view, home in zip(layout.views(self._slots[slot]), self._home[b]):
            view.copy_(home, non_blocking=non_blocking)

    def _free_slot(self, incoming: int) -> Optional[int]:
        for s, owner in enumerate(self._owner):
            if owner is None:
                return s
        # The resident block farthest behind the computation that is done with its buffer.
        candidates = []
        for s, owner in enumerate(self._owner):
            if self._in_backward:
                if self._done_backward[owner] and owner > incoming:
                    candidates.append((-owner, s))
            elif owner < incoming:
                candidates.append((owner, s))
        if not candidates:
            return None
        _, s = min(candidates)
        self._evict(self._owner[s])
        return s

    def _evict(self, b: int) -> None:
        slot = self._slot_of[b]
        if slot is None:
            return
        self._staged[b] = None
        params = self.layouts[b].params
        bound, self._bound[b] = self._bound[b], None
        changed = [k for k, p in enumerate(params) if bound is not None and p._version != bound[k]]
        if changed:
            # Written in place while in the window (load_state_dict or an edit after a forward that
            # had no backward): the buffer holds the newest values, and home must have them.
            self._sync()
            with torch.no_grad():
                for k in changed:
                    self._home[b][k].copy_(params[k].data)
        for p, v in zip(params, self._home[b]):
            p.data = v
            g = self._host_grad.get(id(p))
            if g is not None and p.grad is None:
                p.grad = g
        self._owner[slot] = None
        self._slot_of[b] = None
        self._ready[b] = None
        self.stats["evictions"] += 1

    def _wait(self, b: int) -> None:
        self._fetch(b, sync=False)
        event = self._ready[b]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _try_fetch(self, b: int) -> None:
        if self._slot_of[b] is None and self._free_slot(b) is not None:
            # _free_slot evicted one; fetch takes the buffer it freed.
            self._fetch(b)

    def _host_tensor_like(self, p: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            from .. import host

            return host.empty(tuple(p.shape), dtype=p.dtype, device=self.device.index or 0)
        return torch.empty_like(p, device="cpu")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
