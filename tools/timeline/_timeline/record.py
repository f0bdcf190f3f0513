"""Traces from what memtide records: the allocator's events (with CUPTI's activities) and the
LD_PRELOAD observer's log."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Tuple

from memtide._files import json_value, open_input

from .trace import TraceWriter


def trace_from_allocator(events: Dict[str, Any], path: str, base_allocated: int = 0, base_reserved: int = 0,
                         activities: Iterable[Tuple] = (), extra: Iterable[Dict[str, Any]] = (), **header: Any) -> int:
    """`memtide.allocator_events()` as a trace: the phase marks, every allocation and completed
    free, and the device memory they add up to (from `base_*`, what was in use when recording
    began); plus the device's activities from CUPTI (`device_trace_stop()`: engine, start, end,
    bytes, ...) and `extra` events (the host and NVMe tiers' from memtide.timeline.record) on the
    same clock. Returns the number of events written."""
    with TraceWriter(path, clock="steady", capacity_bytes=events.get("limit_bytes"), **header) as w:
        for ev in extra:
            w.event(**ev)
        for t, phase in events["phases"]:
            w.phase(t, phase)
        for engine, start, end, nbytes, *_ in activities:
            w.op(engine, start, end, nbytes)
        allocated, reserved = int(base_allocated), int(base_reserved)
        for action, t, addr, size, stream in events["trace"]:
            if action == "alloc":
                allocated += size
                w.event(type="alloc", t=t, addr=addr, bytes=size, stream=stream)
            elif action == "free_completed":
                allocated -= size
                w.event(type="free", t=t, addr=addr, bytes=size, stream=stream)
            elif action in ("segment_alloc", "segment_map"):
                reserved += size
            elif action in ("segment_free", "segment_unmap"):
                reserved -= size
            elif action == "oom":
                w.event(type="oom", t=t, bytes=size, stream=stream)
                continue
            else:
                continue  # free_requested: the block still waits for its streams
            w.memory(t, max(allocated, 0), max(reserved, 0))
        return w.events


def trace_from_observer(log: str, path: str, **header: Any) -> int:
    """`memtide observe`'s log (the LD_PRELOAD observer's JSON Lines) as a trace: every
    cudaMalloc and cudaFree, and the memory of all observed processes together."""
    current: Dict[Any, int] = {}
    with open_input(log, "observer log", binary=False, errors="replace") as f, \
            TraceWriter(path, clock="steady", **header) as w:
        for line in f:
            try:
                rec = json_value(line)
            except ValueError:
                continue  # a line cut short (or nested too deeply): the observe summary already reports it
            if not isinstance(rec, dict) or rec.get("type") != "event":
                continue
            t = rec["t_ns"] / 1e9
            op = str(rec.get("op", ""))
            kind = "free" if "free" in op.lower() else "alloc"
            w.event(type=kind, t=t, addr=rec.get("ptr"), bytes=rec.get("size", 0), stream=rec.get("stream"))
            current[rec.get("pid")] = int(rec.get("current", 0))
            total = sum(current.values())
            w.memory(t, total, total)  # cudaMalloc'ed bytes: reserved, as the program's allocator sees it
        return w.events
