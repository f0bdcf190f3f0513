"""torch's memory snapshots (``torch.cuda.memory._dump_snapshot``, or memtide.dump_snapshot, which
writes the same format) read offline and drawn in memtide's report: the segments with their
blocks, allocated and reserved memory over time from the snapshot's trace, and the largest blocks
live at the peak with the stack frames the snapshot kept.

A snapshot is a pickle of plain Python values (dicts, lists, strings, numbers). It is read with an
unpickler that builds nothing else: a pickle that names any class or function (which is how a
pickle runs code) is refused, naming the file, before anything it names is looked up.

The format (torch 2.1 to 2.15, ``torch.cuda.memory._snapshot()``'s docstring):

    {"segments": [{"device", "address", "total_size", "allocated_size", "active_size", "stream",
                   "segment_type", "frames", "blocks": [{"address", "size", "requested_size",
                   "state": "active_allocated" | "active_pending_free" | "inactive", "frames"}]}],
     "device_traces": [[{"action": "alloc" | "free_requested" | "free_completed" | "segment_alloc"
                         | "segment_free" | "segment_map" | "segment_unmap" | "snapshot" | "oom",
                         "addr", "size", "stream", "time_us", "frames"}]],   # one list per device
     "allocator_settings": {...}}

with frames ``{"filename", "line", "name"}``. Only the fields drawn are required (a segment's
``total_size`` and ``blocks``, a block's ``size``, an entry's ``action`` and ``size``); an
entry without ``time_us`` (torch 2.0) is placed by its order.
"""

from __future__ import annotations

import html
import io
import pickle
import reprlib
from typing import Any, Dict, Iterator, List, Tuple

from memtide._files import open_input

from .files import TraceError
from .trace import MAX_BYTES

#: Blocks of the live set at the peak listed in the report, and frames shown per block.
TOP_BLOCKS = 10
TOP_FRAMES = 6
#: Segments drawn one per row (the largest); the rest are counted.
MAX_SEGMENT_ROWS = 120
# A pickle larger than this is not read (a snapshot of a long trace is tens of MiB).
_MAX_BYTES_READ = 4 << 30

_ALLOCATED = ("active_allocated", "active_pending_free")


def looks_like_pickle(path: str) -> bool:
    """True when `path` names a pickle: by its name (.pickle, .pkl) or its first byte (protocol 2
    and later begin with 0x80). A memtide trace begins with '{'."""
    if path.endswith((".pickle", ".pkl")):
        return True
    try:
        with open_input(path, "trace") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes build (dict, list, tuple, set, str, bytes, int, float,
    bool, None). Any class or function a pickle names reaches find_class, which refuses it: nothing
    is imported, constructed or called."""

    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):  # noqa: D401
        raise TraceError(f"{self.path} is not a plain torch memory snapshot: it names {module}.{name}, and memtide "
                         "reads only pickles of plain values (a pickle that names a class or function can run code "
                         "when loaded)")

    def persistent_load(self, pid):
        raise TraceError(f"{self.path} is not a plain torch memory snapshot: it refers to persistent objects")


def _load(path: str) -> Any:
    try:
        with open_input(path, "snapshot") as f:
            data = f.read(_MAX_BYTES_READ + 1)
    except OSError as e:
        raise TraceError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    if len(data) > _MAX_BYTES_READ:
        raise TraceError(f"{path} is larger than {_MAX_BYTES_READ >> 30} GiB: not read as a memory snapshot")
    if data[:1] == b"{":
        raise TraceError(f"{path} is a memtide trace (JSON Lines), not a pickle: give it without the snapshots, or "
                         "render it alone")
    try:
        return _PlainUnpickler(io.BytesIO(data), path).load()
    except TraceError:
        raise
    except RecursionError:
        raise TraceError(f"{path} is not a torch memory snapshot: nested too deeply") from None
    except Exception as e:  # a cut or corrupt pickle raises any of several types
        raise TraceError(f"{path} is not a readable pickle ({type(e).__name__}: {e}); a torch memory snapshot "
                         "is written by torch.cuda.memory._dump_snapshot") from None


# What a message shows of a value the snapshot holds: a few levels and items of it. repr() itself
# recurses once per level, and a pickle can nest a list 100,000 deep.
_shown = reprlib.Repr()
_shown.maxlevel, _shown.maxstring, _shown.maxother = 3, 60, 60


def _int(v: Any, where: str, path: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise TraceError(f"{path}: {where} must be a whole number from {lo} to {hi}, got {_shown.repr(v)}")
    return v


def _frames(v: Any, where: str, path: str) -> List[Tuple[str, int, str]]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise TraceError(f"{path}: {where} must be a list of frames, got {type(v).__name__}")
    out = []
    for i, f in enumerate(v):
        if not isinstance(f, dict):
            raise TraceError(f"{path}: {where}[{i}] must be a frame (a dict), got {type(f).__name__}")
        name, filename, line = f.get("name", "?"), f.get("filename", "?"), f.get("line", 0)
        if type(name) is not str or type(filename) is not str or type(line) is not int:
            raise TraceError(f"{path}: {where}[{i}] must have text name and filename and a whole line number, got "
                             f"{_shown.repr(f):.200}")
        out.append((name, line, filename))
    return out


def _list(v: Any, where: str, path: str) -> list:
    if not isinstance(v, list):
        raise TraceError(f"{path}: {where} must be a list, got {type(v).__name__}")
    return v


def read_snapshot(path: str) -> Dict[str, Any]:
    """The snapshot at `path`, checked: {"segments": [...], "trace": [...] (one device's entries),
    "device": int}. Raises TraceError naming the file and the field for anything else."""
    snap = _load(path)
    try:
        return _checked(snap, path)
    except RecursionError:  # the messages show values through _shown; anything else that recursed
        raise TraceError(f"{path} is not a torch memory snapshot: nested too deeply") from None


def _checked(snap: Any, path: str) -> Dict[str, Any]:
    if not isinstance(snap, dict) or "segments" not in snap:
        keys = ", ".join(sorted(_shown.repr(k) for k in snap)[:6]) if isinstance(snap, dict) else ""
        got = type(snap).__name__ if not isinstance(snap, dict) else f"a dict without 'segments' (keys {keys})"
        raise TraceError(f"{path} is not a torch memory snapshot: expected a dict with 'segments' (from "
                         f"torch.cuda.memory._dump_snapshot), got {got}")
    segments = []
    for i, s in enumerate(_list(snap["segments"], "'segments'", path)):
        where = f"segments[{i}]"
        if not isinstance(s, dict):
            raise TraceError(f"{path}: {where} must be a dict, got {type(s).__name__}")
        blocks = []
        for j, b in enumerate(_list(s.get("blocks", []), where + ".blocks", path)):
            bw = f"{where}.blocks[{j}]"
            if not isinstance(b, dict):
                raise TraceError(f"{path}: {bw} must be a dict, got {type(b).__name__}")
            state = b.get("state", "inactive")
            if type(state) is not str:
                raise TraceError(f"{path}: {bw}.state must be text, got {_shown.repr(state)}")
            blocks.append({"address": _int(b.get("address", 0), bw + ".address", path, hi=2**64 - 1),
                           "size": _int(b.get("size"), bw + ".size", path), "state": state,
                           "frames": _frames(b.get("frames"), bw + ".frames", path)})
        segments.append({"device": _int(s.get("device", 0), where + ".device", path, hi=1 << 16),
                         "address": _int(s.get("address", 0), where + ".address", path, hi=2**64 - 1),
                         "total_size": _int(s.get("total_size"), where + ".total_size", path),
                         "stream": _int(s.get("stream", 0), where + ".stream", path, hi=2**64 - 1),
                         "blocks": blocks})
    traces = _list(snap.get("device_traces", []), "'device_traces'", path)
    # The device drawn: the one with the most trace entries, else the first with segments.
    device = max(range(len(traces)), key=lambda d: len(traces[d]) if isinstance(traces[d], list) else -1,
                 default=None)
    if device is None or not traces[device]:
        device = segments[0]["device"] if segments else 0
    trace = []
    entries = traces[device] if device < len(traces) else []
    for k, e in enumerate(_list(entries, f"device_traces[{device}]", path)):
        where = f"device_traces[{device}][{k}]"
        if not isinstance(e, dict):
            raise TraceError(f"{path}: {where} must be a dict, got {type(e).__name__}")
        action = e.get("action")
        if type(action) is not str:
            raise TraceError(f"{path}: {where}.action must be text, got {_shown.repr(action)}")
        t = e.get("time_us", None)
        trace.append({"action": action, "addr": _int(e.get("addr", 0), where + ".addr", path, hi=2**64 - 1),
                      "size": _int(e.get("size", 0), where + ".size", path),
                      "stream": _int(e.get("stream", 0), where + ".stream", path, hi=2**64 - 1),
                      "t": None if t is None else _int(t, where + ".time_us", path, hi=10**18) / 1e6,
                      "frames": _frames(e.get("frames"), where + ".frames", path)})
    if any(e["t"] is None for e in trace):
        for k, e in enumerate(trace):  # torch 2.0 kept no times: one microsecond per entry, in order
            e["t"] = k * 1e-6
    trace.sort(key=lambda e: e["t"])
    return {"segments": [s for s in segments if s["device"] == device], "trace": trace, "device": device,
            "all_segments": len(segments)}


class SnapshotView:
    """What the report draws of a snapshot: memory over time (as memtide trace events), the
    segments, the peak and the blocks live at it."""

    def __init__(self, snap: Dict[str, Any]):
        self.snap = snap
        segs = snap["segments"]
        self.segment_count = len(segs)
        self.reserved_end = sum(s["total_size"] for s in segs)
        self.allocated_end = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] in _ALLOCATED)
        trace = snap["trace"]
        net_alloc = net_reserved = 0
        for e in trace:
            a = e["action"]
            if a == "alloc":
                net_alloc += e["size"]
            elif a == "free_completed":
                net_alloc -= e["size"]
            elif a in ("segment_alloc", "segment_map"):
                net_reserved += e["size"]
            elif a in ("segment_free", "segment_unmap"):
                net_reserved -= e["size"]
        # What was in use before the trace's first entry (the trace is a ring buffer): the
        # snapshot's own totals less what the trace added.
        self.base_allocated = max(self.allocated_end - net_alloc, 0)
        self.base_reserved = max(self.reserved_end - net_reserved, 0)
        allocated, live, peak, peak_live, peak_t = self.base_allocated, {}, self.base_allocated, {}, None
        for e in trace:
            if e["action"] == "alloc":
                allocated += e["size"]
                live[e["addr"]] = e
                if allocated > peak:
                    peak, peak_t, peak_live = allocated, e["t"], None  # copied lazily: peaks come in runs
            elif e["action"] == "free_completed":
                if peak_live is None:
                    peak_live = dict(live)
                allocated -= e["size"]
                live.pop(e["addr"], None)
        if peak_live is None:
            peak_live = dict(live)
        self.peak_allocated = peak
        self.peak_t = peak_t
        if peak_t is None:
            # No allocation in the trace rose above the start: the snapshot's own live blocks.
            blocks = [{"size": b["size"], "addr": b["address"], "frames": b["frames"]}
                      for s in segs for b in s["blocks"] if b["state"] in _ALLOCATED]
            self.peak_allocated = max(self.peak_allocated, self.allocated_end)
        else:
            blocks = [{"size": e["size"], "addr": e["addr"], "frames": e["frames"]} for e in peak_live.values()]
        blocks.sort(key=lambda b: -b["size"])
        self.peak_blocks = blocks[:TOP_BLOCKS]
        self.peak_block_count = len(blocks)
        self.peak_unattributed = self.peak_allocated - sum(b["size"] for b in blocks)

    def header(self, path: str) -> Dict[str, Any]:
        return {"memtide_trace": 1, "source": "torch memory snapshot", "clock": "the snapshot's (time_us)",
                "snapshot": path, "device": self.snap["device"], "segments": self.segment_count}

    def events(self) -> Iterator[Dict[str, Any]]:
        """The snapshot's trace as memtide trace events: allocations, frees and the memory they add
        up to (from what was in use before the trace began)."""
        trace = self.snap["trace"]
        allocated, reserved = self.base_allocated, self.base_reserved
        if trace:
            yield {"type": "memory", "t": trace[0]["t"], "allocated": allocated, "reserved": reserved}
        for e in trace:
            a = e["action"]
            if a == "alloc":
                allocated += e["size"]
                yield {"type": "alloc", "t": e["t"], "addr": e["addr"], "bytes": e["size"], "stream": e["stream"]}
            elif a == "free_completed":
                allocated -= e["size"]
                yield {"type": "free", "t": e["t"], "addr": e["addr"], "bytes": e["size"], "stream": e["stream"]}
            elif a in ("segment_alloc", "segment_map"):
                reserved += e["size"]
            elif a in ("segment_free", "segment_unmap"):
                reserved -= e["size"]
            elif a == "oom":
                yield {"type": "oom", "t": e["t"], "bytes": e["size"], "stream": e["stream"]}
                continue
            else:
                continue
            yield {"type": "memory", "t": e["t"], "allocated": max(allocated, 0), "reserved": max(reserved, 0)}

    def sections(self, fmt_bytes) -> List[str]:
        """The snapshot's own sections of the report: the segments, the largest blocks at the peak."""
        segs = sorted(self.snap["segments"], key=lambda s: -s["total_size"])
        rows = segs[:MAX_SEGMENT_ROWS]
        W, L, row_h = 1100, 90, 12
        width = W - L - 10
        biggest = max([s["total_size"] for s in rows] + [1])
        h = row_h * len(rows) + 10
        colors = {"active_allocated": "#1f4e8c", "active_pending_free": "#8172b3", "inactive": "#cccccc"}
        out = [f"<h2>Segments ({self.segment_count:,} on device {self.snap['device']}, {fmt_bytes(self.reserved_end)}"
               f" reserved, {fmt_bytes(self.allocated_end)} allocated at the snapshot"
               + (f"; the {len(rows)} largest drawn" if len(rows) < len(segs) else "") + "; "
               + " ".join(f'<span style="color:{c}">&#9632; {n}</span>' for n, c in colors.items()) + ")</h2>",
               f'<svg id="segments" width="{W}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
        for r, s in enumerate(rows):
            top = 5 + r * row_h
            scale = width / biggest
            out.append(f'<rect class="segment" x="{L}" y="{top}" width="{max(s["total_size"] * scale, 0.5):.1f}" '
                       f'height="{row_h - 2}" fill="#f4f4f4" stroke="#999" stroke-width="0.3"><title>segment '
                       f'0x{s["address"]:x}: {fmt_bytes(s["total_size"])}, {len(s["blocks"])} blocks</title></rect>')
            x = L
            for b in s["blocks"]:
                w = b["size"] * scale
                if b["state"] in _ALLOCATED:  # at least half a pixel: a small block is still seen
                    out.append(f'<rect class="block" x="{x:.1f}" y="{top}" width="{max(w, 0.5):.1f}" height="{row_h - 2}" '
                               f'fill="{colors.get(b["state"], "#999")}"><title>{html.escape(b["state"])} '
                               f'{fmt_bytes(b["size"])} at 0x{b["address"]:x}</title></rect>')
                x += w
        out.append("</svg>")
        when = ("at the snapshot (its trace has no allocation above the start)" if self.peak_t is None
                else f"at t = {self.peak_t:.6f} s")
        out.append(f"<h2>Largest blocks live at the peak ({fmt_bytes(self.peak_allocated)} allocated {when}; "
                   f"{self.peak_block_count:,} blocks known"
                   + (f", {fmt_bytes(self.peak_unattributed)} allocated before the trace began" if self.peak_unattributed
                      > 0 else "") + ")</h2>")
        out.append("<table id='peak-blocks'><tr><th>size</th><th>address</th><th>allocated at (innermost first)</th></tr>")
        for b in self.peak_blocks:
            frames = "<br>".join(html.escape(f"{name} ({filename}:{line})") for name, line, filename
                                 in b["frames"][:TOP_FRAMES]) or "(no frames recorded)"
            out.append(f"<tr><td>{fmt_bytes(b['size'])}</td><td>0x{b['addr']:x}</td><td style='font-size:11px'>"
                       f"{frames}</td></tr>")
        out.append("</table>")
        return out


__all__ = ["SnapshotView", "looks_like_pickle", "read_snapshot"]
