"""The window's size: the device memory it may use, the size it starts with, and (for
``size="auto"``) the profiled iterations whose timings choose it (tiering::choose_window).

A part of LayerWindow (memtide.window.layer_window), which it is mixed into: the state used here
is made in LayerWindow.__init__.
"""

from __future__ import annotations

from typing import Dict, List

import torch


class _Sizing:
    """How many blocks the window holds, from the memory available and the blocks' timings."""

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
        from .. import _memtide, torch_bridge

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

    def _timing(self) -> bool:
        return self.requested == "auto" and self.chosen is None

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
        from .. import _memtide

        choice = _memtide.choose_window(self.profiles(), self._available_bytes())
        self.chosen = dict(choice, iterations_profiled=self._timed_iterations)
        if choice["blocks"] != self.size:
            self._resize(min(choice["blocks"], self.n))
