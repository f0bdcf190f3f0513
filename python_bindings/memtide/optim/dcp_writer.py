"""torch.distributed.checkpoint writes TieredAdamW's state while training goes on, with no
second copy of it: ``dcp.async_save(state, storage_writer=StateWriter(path, opt))``.

DCP's own stager copies every tensor of the state dict into host memory before its writer thread
starts, so that the steps after the save cannot change what it writes: for optimizer state that
already fills host memory, that copy does not fit. StateWriter stages the tensors that are views
of TieredAdamW's host arrays (the moments, the fp32 masters, the params of a CPU model) as they
are, frozen by the engine (memtide._memtide.FrozenState): each later step keeps what it changes,
in a bounded buffer, until DCP's writer has read it. Everything else in the state dict (a bf16
model's params, the steps, a scheduler's state) is copied as DCP's stager would. The files are
DCP's own: ``dcp.load`` reads them with its FileSystemReader, onto any ranks, into TieredAdamW or
torch.optim.AdamW.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from . import checkpoint
from .distributed import is_dtensor

Span = Tuple[int, int, int]  # (array: 0 params, 1 exp_avg, 2 exp_avg_sq; first element; end)


class StateWriter(FileSystemWriter):
    """A FileSystemWriter whose staging for ``dcp.async_save`` makes no copy of `optimizer`'s state.

    ``dcp.async_save(state_dict, storage_writer=StateWriter(path, optimizer))``: async_save stages
    through its storage writer when it is a stager, as this one is. The save returns once the
    state is frozen; until DCP's writer has read a subgroup, a step that changes it first copies
    it into a buffer of at most `buffer_bytes` (0: two of the largest subgroup) or, when that is
    full, waits for the writer. A writer that reads nothing for `stall_s` while a step waits is
    given up on: the steps go on and that save fails (its future raises). Other keyword
    arguments go to FileSystemWriter; ``single_file_per_rank`` is False by default here (one file
    per tensor), since FileSystemWriter holds every tensor it wrote to a file until the file is
    done, which with one file per rank is a copy of the whole state. ``dcp.save`` (blocking) writes through it as through
    FileSystemWriter. One save at a time per optimizer: a second waits for the first to be read.

    Under DDP or FSDP2 pass async_save a gloo group of its own (``process_group=``): its planning
    runs collectives from a thread beside training's. With an NVMe tier the optimizer cannot be
    frozen this way (a spilled subgroup's host range is let go between steps): use
    TieredAdamW.save_checkpoint, which reads the spill file.
    """

    def __init__(self, path: Any, optimizer: Any, *, buffer_bytes: int = 0, stall_s: float = 300.0, **kwargs: Any) -> None:
        who = "memtide.optim.StateWriter"
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"{who}: path must be a non-empty path of the checkpoint folder, got {path!r}")
        if not hasattr(optimizer, "engine") or not hasattr(optimizer, "buffers"):
            raise ValueError(f"{who}: optimizer must be a memtide TieredAdamW, got {type(optimizer).__name__}")
        if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 0:
            raise ValueError(f"{who}: buffer_bytes must be an int >= 0 (0: two of the largest subgroup), got {buffer_bytes!r}")
        if isinstance(stall_s, bool) or not isinstance(stall_s, (int, float)) or not 0 < stall_s < 3e7:
            raise ValueError(f"{who}: stall_s must be a finite number of seconds > 0, got {stall_s!r}")
        if kwargs.get("cache_staged_state_dict"):
            raise ValueError(f"{who}: cache_staged_state_dict keeps a copy of the state, which this writer exists not to make")
        # One file per tensor: torch's FileSystemWriter keeps every tensor it wrote into a file
        # until that file is done (for its safetensors format), so one file per rank would hold
        # a copy of everything read from the frozen state until the end.
        kwargs.setdefault("single_file_per_rank", False)
        super().__init__(path, **kwargs)
        self.optimizer = optimizer
        self.buffer_bytes = buffer_bytes
        self.stall_s = float(stall_s)
        self._frozen: Any = None  # staged, not yet taken by the save's thread
        self._last: Any = None  # the last save's, for progress()
        self._thread = threading.local()  # the save's thread: the FrozenState it writes
        self._arrays: List[Tuple[int, int]] = []  # each host array's address and element count

    # ---- AsyncStager --------------------------------------------------------------------------

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Freezes the optimizer's host state under the state dict's views of it and copies the
        rest; returns the state dict DCP's writer thread writes."""
        opt = self.optimizer
        buffers = opt.buffers if opt.engine is not None else None
        self._arrays = [] if buffers is None else [(t.data_ptr(), t.numel()) for t in
                                                     (buffers.params, buffers.exp_avg, buffers.exp_avg_sq)]
        needed: List[Span] = []

        def staged(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: staged(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
                return type(value)(staged(v) for v in value)
            if isinstance(value, torch.Tensor):
                span = self._span(value.to_local() if is_dtensor(value) else value)
                if span is not None:
                    needed.append(span)
                    return value  # frozen below: read through the FrozenState
                return value.detach().to("cpu", copy=True)
            return copy.deepcopy(value)

        out = staged(state_dict)
        if needed:
            self._frozen = self._last = checkpoint.freeze(opt, needed, self.buffer_bytes, self.stall_s, os.fspath(self.path))
        return out

    def progress(self) -> Dict[str, Any]:
        """The last async save's, as AsyncSave.progress(): bytes_written is what DCP's writer has
        read of the frozen state, waited_s and copied_bytes what the steps paid for it; committed
        once the writer read it all without error (DCP's metadata is written after)."""
        if self._last is None:
            return checkpoint.AsyncSave(None, os.fspath(self.path)).progress()
        return dict(self._last.progress())

    def synchronize_staging(self) -> None:
        pass  # stage() returns once the state is frozen

    # ---- StorageWriter ------------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._take()

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> Any:
        self._take()
        return super().set_up_storage_writer(*args, **kwargs)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        self._take()
        frozen, self._thread.frozen = getattr(self._thread, "frozen", None), None
        if frozen is None:
            return super().write_data(plan, planner)
        try:
            self._keep_only_planned(plan, planner, frozen)
            result = super().write_data(plan, _FrozenPlanner(planner, self, frozen))
        except BaseException as e:
            frozen.close(f"DCP's writer failed: {type(e).__name__}: {e}")
            raise
        frozen.close()  # every read is over: nothing is kept any longer
        return result

    def _keep_only_planned(self, plan: SavePlan, planner: SavePlanner, frozen: Any) -> None:
        """Lets go what this rank will not write: DCP has one rank write each tensor that every
        rank holds (DDP), so the others' steps need not keep it. Only with a planner that says
        where an item's tensor is without reading it (DefaultSavePlanner's lookup_object)."""
        lookup = getattr(planner, "lookup_object", None)
        if lookup is None:
            return
        spans = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            t = lookup(item.index)
            span = self._span(t) if isinstance(t, torch.Tensor) else None
            if span is not None:
                spans.append(span)
        frozen.keep_only(spans)

    def _take(self) -> None:
        """In the save's thread, at the first of its calls: the state staged for it. The thread
        ends with the save (async_save's executor is shut down then), so a save that fails
        before write_data (its planning, on this rank or another) lets the steps go then."""
        frozen, self._frozen = self._frozen, None
        if frozen is None:
            return
        self._thread.frozen = frozen
        thread = threading.current_thread()
        if thread is not threading.main_thread():
            threading.Thread(target=_close_after, args=(thread, frozen), name="memtide-dcp-save", daemon=True).start()

    def __getstate__(self) -> Any:
        raise TypeError("memtide.optim.StateWriter writes from the process that trains: use async_save with "
                        "async_checkpointer_type=AsyncCheckpointerType.THREAD (the default)")

    def __del__(self) -> None:
        frozen = getattr(self, "_frozen", None)  # staged, and no save ever took it
        if frozen is not None:
            frozen.close("the save ended before its writer read the state")

    # ---- where a tensor lies in the optimizer's arrays ----------------------------------------

    def _span(self, t: torch.Tensor) -> Optional[Span]:
        """(array, first, end) when `t` is a float32 CPU view of one of the host arrays."""
        if not self._arrays or t.device.type != "cpu" or t.dtype != torch.float32 or t.numel() == 0:
            return None
        if any(s < 0 for s in t.stride()):
            return None
        start = t.data_ptr()
        end = start + 4 * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
        for k, (base, n) in enumerate(self._arrays):
            if base <= start and end <= base + 4 * n and (start - base) % 4 == 0:
                return (k, (start - base) // 4, (end - base) // 4)
        return None


def _close_after(thread: threading.Thread, frozen: Any) -> None:
    thread.join()
    if not frozen.progress()["done"]:
        frozen.close("the save ended before DCP's writer read the state (its planning failed)")


class _FrozenPlanner:
    """DCP's planner, except that a tensor over the optimizer's arrays is read as it was frozen."""

    def __init__(self, planner: SavePlanner, writer: StateWriter, frozen: Any) -> None:
        self._planner, self._writer, self._frozen = planner, writer, frozen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = self._planner.resolve_data(write_item)
        if not isinstance(data, torch.Tensor):
            return data
        span = self._writer._span(data)
        if span is None:
            return data
        k, first, end = span
        out = torch.empty(end - first, dtype=torch.float32)
        self._frozen.read(k, first, end, out.data_ptr())
        return out.as_strided(data.shape, data.stride())
