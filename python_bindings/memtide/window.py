"""The layer window (STRONGHOLD): train a stack of blocks whose parameters do not all fit on the
device. Only a window of blocks holds its parameters in device memory; the others live in host
memory, and each block is copied in one window ahead of the computation, forward and then
backward, into one of a fixed pool of buffers used round robin (the allocator sees no churn).

    window = LayerWindow(model.blocks, size="auto")   # from memtide.window; before the first forward
    for batch in data:
        loss = model(batch).loss
        loss.backward()          # gradients of finished blocks go to host memory as backward goes on
        opt.step()               # the optimizer updates the host copies (the blocks' home)
        opt.zero_grad(set_to_none=True)

Between iterations the windowed parameters and their gradients are host tensors, so any torch
optimizer (on CPU tensors) updates them in place; the first window of the next forward is
fetched as soon as ``window.attach_optimizer(opt)``'s optimizer finishes its step. Modules outside
``blocks`` (embeddings, head) stay where they are.

Correctness does not rest on timing: a block is used only after its copy has completed, a buffer
is reused only after the block that held it is done with it (forward) or has sent its gradients
out (backward), and every tensor autograd saves that lives in a window buffer (a parameter or a
view of one) is saved as a reference that backward resolves against the block's current buffer,
fetching it again if it was evicted. Activation checkpointing works the same way.

Window size: ``size=int`` is used as given; ``size="auto"`` trains the first ``profile_iterations``
iterations with the largest window the memory allows while timing every block's forward,
backward and copies, then takes the knee of STRONGHOLD's model (tiering::choose_window; see
docs/layer_window.md).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import grad_copies

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


class LayerWindow:
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

    # ---- memory ---------------------------------------------------------------------------------

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            from . import host

            return host.empty((max(nbytes, 1),), dtype=torch.uint8, device=self.device.index or 0)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def _available_bytes(self) -> int:
        """Device bytes the window's buffers may hold through every phase of an iteration: the
        window's own buffers plus what the rest of training never used. After the profiled
        iterations that comes from the watermarks: memtide's phase tracker (the headroom over
        forward, backward and update) when memtide is torch's allocator, else torch's peak."""
        if self.available is not None:
            return self.available
        if self.device.type != "cuda":
            return 2 * self.n * self.slot_bytes  # a CPU device: all fits (and gradients) unless told otherwise
        held = len(self._slots) * self.slot_bytes
        index = self.device.index or 0
        from . import _memtide, torch_bridge

        if torch_bridge.installed():
            current = _memtide.phase_report(index)["current"]
            # Until the phase we are in comes round again: every phase of the cycle.
            return int(_memtide.headroom(index, until=current)["bytes"]) + held
        free, _ = torch.cuda.mem_get_info(self.device)
        if self._peak_reset:
            # torch's allocator: what the device has beside torch's cache, less the most the rest
            # of training held at once during the profiled iterations, less a margin.
            margin = _memtide.parse_bytes(_memtide.options()["headroom_margin"].replace(" ", ""))
            reserved = torch.cuda.memory_reserved(self.device)
            others = torch.cuda.max_memory_allocated(self.device) - held
            return max(0, int(free + reserved - others - margin))
        return int(free) + held

    def _initial_size(self) -> int:
        available = self._available_bytes()
        if available < min(2, self.n) * self.slot_bytes:
            what = "one block and the prefetch of the next need" if self.n > 1 else "the one block needs"
            raise ValueError(f"LayerWindow: {what} {min(2, self.n) * self.slot_bytes} bytes of device memory, "
                             f"but {available} are available")
        fit = max(1, available // self.slot_bytes - 1)
        if self.requested != "auto":
            return min(int(self.requested), self.n)
        # Profiling needs no large window (each block is timed on its own, copies apart) and must
        # leave the activations their memory: two blocks, when they fit.
        if self.device.type == "cuda" and self.available is None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._peak_reset = True
        return int(min(fit, self.n, 2))

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

    # ---- hooks ------------------------------------------------------------------------------------

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
            j = i - self.size
            if j >= 0:
                self._try_fetch(j)
            if self._timing():
                self._t_bwd[i] = time.perf_counter_ns()
        return hook

    def _try_fetch(self, b: int) -> None:
        if self._slot_of[b] is None and self._free_slot(b) is not None:
            # _free_slot evicted one; fetch takes the buffer it freed.
            self._fetch(b)

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
        # parameter the forward never used: that one goes home at the end of backward).
        j = max((b for b in range(i) if self._slot_of[b] is None and b >= i - 1 - self.size), default=None)
        if j is not None:
            self._try_fetch(j)

    def _host_tensor_like(self, p: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            from . import host

            return host.empty(tuple(p.shape), dtype=p.dtype, device=self.device.index or 0)
        return torch.empty_like(p, device="cpu")

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
        self._done_backward = [False] * self.n
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
        for b in range(self.n):
            self._evict(b)
        for layout in self.layouts:
            for p in layout.params:
                g = self._host_grad.pop(id(p), None)
                if g is not None:
                    p.grad = g

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

    # ---- sizing -----------------------------------------------------------------------------------

    def _timing(self) -> bool:
        return self.requested == "auto" and self.chosen is None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def profiles(self) -> List[Dict[str, float]]:
        """Per block: mean forward and backward time over the timed iterations, the slowest copy
        each way (ns), and its device bytes (parameters and gradients)."""
        k = max(self._timed_iterations, 1)
        out = []
        for layout, prof in zip(self.layouts, self._profile):
            grads = sum(p.numel() * p.element_size() for p in layout.params if p.requires_grad)
            out.append(dict(forward_ns=prof["forward_ns"] / k, backward_ns=prof["backward_ns"] / k,
                            h2d_ns=prof["h2d_ns"], d2h_ns=prof["d2h_ns"], bytes=self.slot_bytes + grads))
        return out

    def _choose(self) -> None:
        from . import _memtide

        choice = _memtide.choose_window(self.profiles(), self._available_bytes())
        self.chosen = dict(choice, iterations_profiled=self._timed_iterations)
        if choice["blocks"] != self.size:
            self._resize(min(choice["blocks"], self.n))

    # ---- the rest -----------------------------------------------------------------------------------

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
                p.data = p.data.to(self.device, copy=True)
                if p.grad is not None:
                    p.grad = p.grad.to(self.device)
        self._slots = []
        self._storage_slot = {}

    def __repr__(self) -> str:
        return (f"LayerWindow({self.n} blocks, size {self.size} of requested {self.requested!r}, "
                f"{self.slot_bytes} bytes per buffer, on {self.device})")


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
