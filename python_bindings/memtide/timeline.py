"""memtide's trace format and the memory timeline report.

A trace is JSON Lines, written one event at a time (bounded memory however long the run):

    {"memtide_trace": 1, "source": "simulate", "clock": "virtual", "capacity_bytes": 85899345920, ...}
    {"type": "phase", "t": 0.0, "phase": "forward"}
    {"type": "memory", "t": 0.01, "allocated": 15795, "reserved": 20971520}
    {"type": "op", "engine": "d2h", "start": 1.2, "end": 1.21, "bytes": 16777216}

The first line is the header (`memtide_trace` is the format's version; readers refuse a newer
one). Times are seconds on the trace's clock. Event types:

- ``phase``: a training phase begins (forward, backward, update, other);
- ``memory``: device memory allocated and reserved at time t;
- ``op``: work on one engine from start to end: ``h2d``, ``d2h`` (PCIe), ``compute``, ``link``
  (collectives between GPUs), ``host`` (CPU work), ``nvme``; ``bytes`` moved;
- ``alloc`` / ``free``: one allocation (``bytes``, ``addr``, ``stream``), as the observer logs them;
- ``tiering``: one operation of the update phase for one optimizer subgroup (``what``: prefetch,
  gpu update, flush, cpu update, param upload, grad upload, grad to host; ``subgroup``; ``start``,
  ``end``, ``bytes``).

Unknown event types are skipped by readers, so a newer writer's extra events do not break an
older report. ``memtide timeline TRACE -o report.html`` renders a single HTML file that opens
offline (inline SVG, no script from anywhere), a Chrome trace (chrome://tracing, Perfetto) and,
when matplotlib is importable, a PNG.
"""

from __future__ import annotations

import html
import json
import os
import stat
import sys
import tempfile
from collections import defaultdict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from ._memtide import format_bytes

VERSION = 1
ENGINES = ("compute", "link", "h2d", "d2h", "host", "nvme")
PHASES = ("forward", "backward", "update", "other")
_COLORS = {"forward": "#dbe7f6", "backward": "#fbe3d2", "update": "#dcefdc", "other": "#eeeeee",
           "compute": "#4c72b0", "link": "#8172b3", "h2d": "#dd8452", "d2h": "#c44e52", "host": "#55a868",
           "nvme": "#937860"}


def companions(report: str) -> Dict[str, str]:
    """The files that go with a report: REPORT.html -> REPORT.trace.jsonl, .chrome.json, .png,
    .pickle (a memory_viz snapshot)."""
    base = report[:-5] if report.endswith(".html") else report
    return {"trace": base + ".trace.jsonl", "chrome": base + ".chrome.json", "png": base + ".png",
            "pickle": base + ".pickle"}


# The fields each event type must have, and their types; other fields are free.
_NUMBER = (int, float)
_FIELDS = {
    "phase": (("t", _NUMBER), ("phase", str)),
    "memory": (("t", _NUMBER), ("allocated", _NUMBER), ("reserved", _NUMBER)),
    "op": (("engine", str), ("start", _NUMBER), ("end", _NUMBER)),
    "tiering": (("what", str), ("start", _NUMBER), ("end", _NUMBER)),
    "alloc": (("t", _NUMBER),),
    "free": (("t", _NUMBER),),
}


class TraceError(ValueError):
    """A trace file memtide cannot read, or a target it will not write."""


def check_report_target(report: str) -> None:
    """Refuses a report path (and its companions) that cannot be written, before any work is
    done for it: a missing folder, or a link, device or folder where a file would go."""
    folder = os.path.dirname(os.path.abspath(report))
    if not os.path.isdir(folder):
        raise TraceError(f"cannot write {report}: folder {folder} does not exist")
    for path in [report, *companions(report).values()]:
        _safe_target(path)


def _safe_target(path: str) -> None:
    """Refuses to replace anything but a regular file (a link, a device, a folder)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise TraceError(f"{path} is {kind}; memtide writes only regular files (remove it or choose another path)")


class _AtomicFile:
    """A new file under an unpredictable name beside `path` (0600, never through a link), renamed
    over `path` when closed without error; removed otherwise."""

    def __init__(self, path: str, mode: str = "w"):
        self.path = os.path.abspath(path)
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            raise TraceError(f"cannot write {path}: folder {folder} does not exist")
        _safe_target(self.path)
        fd, self.tmp = tempfile.mkstemp(prefix=".memtide-", dir=folder)
        self.f = os.fdopen(fd, mode, **({"encoding": "utf-8"} if "b" not in mode else {}))

    def __enter__(self):
        return self.f

    def __exit__(self, kind, value, tb):
        try:
            if kind is None:
                self.f.flush()
                os.fsync(self.f.fileno())
        finally:
            self.f.close()
        if kind is None:
            _safe_target(self.path)
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)
        return False


class TraceWriter:
    """Writes a trace event by event. ``with TraceWriter(path, source="run") as w: w.op(...)``."""

    def __init__(self, path: str, **header: Any):
        self._file = _AtomicFile(path)
        self._f = self._file.__enter__()
        self._f.write(json.dumps({"memtide_trace": VERSION, **header}) + "\n")
        self.events = 0

    def event(self, **fields: Any) -> None:
        self._f.write(json.dumps(fields, separators=(",", ":")) + "\n")
        self.events += 1

    def phase(self, t: float, phase: str) -> None:
        self.event(type="phase", t=t, phase=phase)

    def memory(self, t: float, allocated: int, reserved: int) -> None:
        self.event(type="memory", t=t, allocated=int(allocated), reserved=int(reserved))

    def op(self, engine: str, start: float, end: float, nbytes: float) -> None:
        self.event(type="op", engine=engine, start=start, end=end, bytes=nbytes)

    def close(self, error: Optional[BaseException] = None) -> None:
        if error is None:
            self._file.__exit__(None, None, None)
        else:
            self._file.__exit__(type(error), error, None)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self.close(value)
        return False


def read_trace(path: str, progress: bool = False) -> Tuple[Dict[str, Any], Iterator[Dict[str, Any]]]:
    """The header and an iterator over the events. Raises TraceError naming the file and the line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        header = json.loads(f.readline())
    except ValueError:  # not JSON, or not text at all (UnicodeDecodeError is a ValueError)
        f.close()
        raise TraceError(f"{path} is not a memtide trace: line 1 is not JSON") from None
    if not isinstance(header, dict) or "memtide_trace" not in header:
        f.close()
        raise TraceError(f"{path} is not a memtide trace: line 1 has no \"memtide_trace\" version")
    if not isinstance(header["memtide_trace"], int) or header["memtide_trace"] > VERSION:
        f.close()
        raise TraceError(f"{path} is trace format {header['memtide_trace']!r}; this memtide reads up to {VERSION}")
    size = os.fstat(f.fileno()).st_size

    def events() -> Iterator[Dict[str, Any]]:
        with f:
            shown = 0
            n = 1
            try:
                for n, line in enumerate(f, 2):
                    if not line.strip():
                        continue
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        raise TraceError(f"{path}: line {n} is not JSON (a trace cut short?)") from None
                    if not isinstance(ev, dict):
                        continue
                    for field, kind in _FIELDS.get(ev.get("type"), ()):
                        if not isinstance(ev.get(field), kind) or isinstance(ev.get(field), bool):
                            raise TraceError(f"{path}: line {n}: a {ev.get('type')} event needs {field!r} as "
                                             f"{'a number' if kind != str else 'text'}, got {ev.get(field)!r}")
                    yield ev
                    if progress and n % 200_000 == 0:
                        done = f.tell() * 100 // max(size, 1)
                        if done >= shown + 10:
                            shown = done
                            print(f"timeline: read {n:,} events ({done}%)", file=sys.stderr, flush=True)
            except UnicodeDecodeError:
                raise TraceError(f"{path}: line {n + 1} is not text") from None

    return header, events()


# ---- traces from what memtide records ----------------------------------------------------------


def trace_from_allocator(events: Dict[str, Any], path: str, base_allocated: int = 0, base_reserved: int = 0,
                         activities: Iterable[Tuple] = (), **header: Any) -> int:
    """`memtide.allocator_events()` as a trace: the phase marks, every allocation and completed
    free, and the device memory they add up to (from `base_*`, what was in use when recording
    began); plus the device's activities from CUPTI (`device_trace_stop()`: engine, start, end,
    bytes, ...) on the same clock. Returns the number of events written."""
    with TraceWriter(path, clock="steady", capacity_bytes=events.get("limit_bytes"), **header) as w:
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
    with TraceWriter(path, clock="steady", **header) as w, open(log, errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short: the observe summary already reports it
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


# ---- summary --------------------------------------------------------------------------------


class Timeline:
    """What a report needs from a trace, gathered in one pass with bounded memory: events are
    binned into `bins` time columns per engine (busy time) and memory (max), so a trace of
    millions of events draws as fast as a small one. Tiering operations are drawn one by one
    (the update phase's schedule), up to MAX_TIERING of them."""

    MAX_TIERING = 20_000

    def __init__(self, header: Dict[str, Any], events: Iterable[Dict[str, Any]], bins: int = 800):
        self.header = header
        phases: List[Tuple[float, str]] = []
        memory: List[Tuple[float, int, int]] = []
        ops: List[Tuple[str, float, float, float]] = []
        tiering: List[Tuple[str, int, float, float]] = []
        self.counts: Dict[str, int] = defaultdict(int)
        # Two passes over memory would double the reading time: keep the ops compactly, bin later.
        for ev in events:
            kind = ev.get("type")
            self.counts[kind] += 1
            if kind == "phase":
                phases.append((float(ev["t"]), str(ev["phase"])))
            elif kind == "memory":
                memory.append((float(ev["t"]), int(ev["allocated"]), int(ev["reserved"])))
            elif kind == "op":
                ops.append((str(ev["engine"]), float(ev["start"]), float(ev["end"]), float(ev.get("bytes", 0))))
            elif kind == "tiering" and len(tiering) < self.MAX_TIERING:
                tiering.append((str(ev["what"]), int(ev.get("subgroup", -1)), float(ev["start"]), float(ev["end"])))
        phases.sort()
        memory.sort()
        times = [t for t, _ in phases] + [t for t, _, _ in memory] + [o[1] for o in ops] + [o[2] for o in ops]
        self.t0 = min(times) if times else 0.0
        self.t1 = max(times) if times else 1.0
        if self.t1 <= self.t0:
            self.t1 = self.t0 + 1e-9
        self.phases, self.memory, self.bins, self.tiering = phases, memory, bins, tiering
        # Per phase: duration, peak allocated, bytes and busy time per engine.
        spans = []
        for i, (t, name) in enumerate(phases):
            end = phases[i + 1][0] if i + 1 < len(phases) else self.t1
            spans.append((t, end, name))
        self.spans = spans
        per_phase: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.busy = {e: [0.0] * bins for e in ENGINES}
        width = (self.t1 - self.t0) / bins
        starts = [s[0] for s in spans]
        import bisect

        for engine, a, b, nbytes in ops:
            if engine not in self.busy:
                continue
            i = bisect.bisect_right(starts, a) - 1
            phase = spans[i][2] if i >= 0 else "other"
            per_phase[phase][engine + "_bytes"] += nbytes
            per_phase[phase][engine + "_busy"] += b - a
            lo = int((a - self.t0) / width)
            hi = int((b - self.t0) / width)
            row = self.busy[engine]
            for k in range(max(lo, 0), min(hi, bins - 1) + 1):
                c0, c1 = self.t0 + k * width, self.t0 + (k + 1) * width
                row[k] += max(0.0, min(b, c1) - max(a, c0))
        for t, alloc, _ in memory:
            i = bisect.bisect_right(starts, t) - 1
            phase = spans[i][2] if i >= 0 else "other"
            per_phase[phase]["peak_allocated"] = max(per_phase[phase]["peak_allocated"], alloc)
        # Drawn: at most two points per column (its lowest and highest allocation), so the chart's
        # size does not grow with the trace's.
        if len(memory) > 2 * bins:
            columns: Dict[int, List[Tuple[float, int, int]]] = defaultdict(list)
            for m in memory:
                columns[min(int((m[0] - self.t0) / width), bins - 1)].append(m)
            drawn = []
            for k in sorted(columns):
                col = columns[k]
                lo, hi = min(col, key=lambda m: m[1]), max(col, key=lambda m: m[1])
                drawn += sorted({lo, hi})
            self.memory = drawn
        self.samples = len(memory)
        for a, b, name in spans:
            per_phase[name]["duration"] += b - a
        self.per_phase = per_phase
        self.ops = len(ops)

    def summary(self) -> List[Dict[str, Any]]:
        rows = []
        for name in PHASES:
            p = self.per_phase.get(name)
            if not p or (p["duration"] <= 0 and not p["peak_allocated"] and name == "other"):
                continue
            row = {"phase": name, "duration_s": p["duration"], "peak_allocated": int(p["peak_allocated"])}
            for e in ("h2d", "d2h"):
                busy, nbytes = p[e + "_busy"], p[e + "_bytes"]
                row[e + "_bytes"] = nbytes
                row[e + "_busy_s"] = busy
                row[e + "_gbs"] = nbytes / busy / 1e9 if busy > 0 else 0.0
            rows.append(row)
        return rows


# ---- outputs --------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    # memtide's byte formatter with one decimal: the report's labels are short.
    return format_bytes(int(n), 1)


def _svg_phase_bands(tl: Timeline, x, height: int) -> List[str]:
    out = []
    for a, b, name in tl.spans:
        out.append(f'<rect class="phase" x="{x(a):.1f}" y="0" width="{max(x(b) - x(a), 0.5):.1f}" height="{height}" '
                   f'fill="{_COLORS.get(name, "#eee")}"><title>{html.escape(name)} {b - a:.4g} s</title></rect>')
    return out


def write_html(tl: Timeline, path: str, title: str = "memtide timeline") -> None:
    """One HTML file with inline SVG: memory over time, the PCIe lanes, the engines as a Gantt
    chart, and a summary table per phase. No script, no network."""
    W, L = 1100, 90
    width = W - L - 10

    def x(t: float) -> float:
        return L + (t - tl.t0) / (tl.t1 - tl.t0) * width

    cap = tl.header.get("capacity_bytes") or 0
    used = max([m[2] for m in tl.memory] + [m[1] for m in tl.memory] + [1])
    # The scale follows what was used; a capacity far above it is named, not drawn (it would
    # flatten the curves into the axis).
    cap_drawn = bool(cap) and cap <= 1.5 * used
    peak = max(used * 1.1, cap if cap_drawn else 0, 1)
    H = 220

    def y(v: float) -> float:
        return 10 + (1 - v / peak) * (H - 30)

    mem = [f'<svg id="memory" width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg">']
    mem += _svg_phase_bands(tl, x, H - 20)
    for idx, label in ((1, "allocated"), (2, "reserved")):
        pts = " ".join(f"{x(m[0]):.1f},{y(m[idx]):.1f}" for m in tl.memory)
        color = "#1f4e8c" if idx == 1 else "#999999"
        mem.append(f'<polyline class="series" points="{pts}" fill="none" stroke="{color}" stroke-width="1.5">'
                   f'<title>{label}</title></polyline>')
    if cap_drawn:
        mem.append(f'<line class="capacity" x1="{L}" x2="{W - 10}" y1="{y(cap):.1f}" y2="{y(cap):.1f}" stroke="#c00" '
                   f'stroke-dasharray="4 3"><title>capacity {_fmt_bytes(cap)}</title></line>')
    elif cap:
        mem.append(f'<text x="{W - 12}" y="22" font-size="11" text-anchor="end" fill="#c00">capacity '
                   f'{_fmt_bytes(cap)}: far above what was used</text>')
    for frac in (0, 0.5, 1):
        mem.append(f'<text x="4" y="{y(peak * frac) + 4:.1f}" font-size="11">{_fmt_bytes(peak * frac)}</text>')
    mem.append("</svg>")

    def lanes(svg_id: str, engines: Tuple[str, ...]) -> List[str]:
        row_h = 26
        h = row_h * len(engines) + 20
        out = [f'<svg id="{svg_id}" width="{W}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
        out += _svg_phase_bands(tl, x, h - 20)
        col = width / tl.bins
        span = (tl.t1 - tl.t0) / tl.bins
        for r, engine in enumerate(engines):
            top = 5 + r * row_h
            out.append(f'<text x="4" y="{top + 15}" font-size="12">{engine}</text>')
            row = tl.busy[engine]
            k = 0
            while k < tl.bins:  # merge neighbouring columns of similar load into one rect
                if row[k] <= 0:
                    k += 1
                    continue
                j, level = k, min(row[k] / span, 1.0)
                while j + 1 < tl.bins and row[j + 1] > 0 and abs(min(row[j + 1] / span, 1.0) - level) < 0.1:
                    j += 1
                opacity = 0.25 + 0.75 * level
                out.append(f'<rect class="busy" x="{L + k * col:.1f}" y="{top}" width="{(j - k + 1) * col:.1f}" '
                           f'height="{row_h - 6}" fill="{_COLORS[engine]}" fill-opacity="{opacity:.2f}">'
                           f'<title>{engine} {level * 100:.0f}% busy</title></rect>')
                k = j + 1
        out.append("</svg>")
        return out

    schedule: List[str] = []
    if tl.tiering:
        kinds = sorted({t[0] for t in tl.tiering}, key=lambda k: ("cpu update", "prefetch", "gpu update", "flush",
                                                                   "param upload", "grad upload",
                                                                   "grad to host").index(k) if k in (
            "cpu update", "prefetch", "gpu update", "flush", "param upload", "grad upload", "grad to host") else 99)
        a0 = min(t[2] for t in tl.tiering)
        a1 = max(t[3] for t in tl.tiering)
        a1 = a1 if a1 > a0 else a0 + 1e-9

        def xs(t: float) -> float:
            return L + (t - a0) / (a1 - a0) * width

        row_h = 22
        h = row_h * len(kinds) + 10
        colors = {"cpu update": _COLORS["host"], "prefetch": _COLORS["h2d"], "gpu update": _COLORS["compute"],
                  "flush": _COLORS["d2h"], "param upload": "#e5ae38", "grad upload": "#8c8c8c",
                  "grad to host": "#b07aa1"}
        schedule = [f'<svg id="schedule" width="{W}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
        for r_i, k in enumerate(kinds):
            top = 4 + r_i * row_h
            schedule.append(f'<text x="4" y="{top + 13}" font-size="11">{html.escape(k)}</text>')
        for what, sg, a, b in tl.tiering:
            top = 4 + kinds.index(what) * row_h
            schedule.append(f'<rect class="op" x="{xs(a):.1f}" y="{top}" width="{max(xs(b) - xs(a), 0.6):.1f}" '
                            f'height="{row_h - 6}" fill="{colors.get(what, "#999")}"><title>{html.escape(what)} '
                            f'subgroup {sg}: {(b - a) * 1e3:.3f} ms</title></rect>')
        schedule.append("</svg>")
        schedule.insert(0, f"<h2>Update-phase schedule per subgroup ({len(tl.tiering):,} operations, "
                           f"{(a1 - a0) * 1e3:.1f} ms; hover for the subgroup)</h2>")
    rows = []
    for r in tl.summary():
        rows.append(f"<tr><td>{r['phase']}</td><td>{r['duration_s']:.4g} s</td><td>{_fmt_bytes(r['peak_allocated'])}</td>"
                    f"<td>{_fmt_bytes(r['h2d_bytes'])} at {r['h2d_gbs']:.1f} GB/s</td>"
                    f"<td>{_fmt_bytes(r['d2h_bytes'])} at {r['d2h_gbs']:.1f} GB/s</td></tr>")
    meta = ", ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in tl.header.items()
                     if k not in ("memtide_trace",) and not isinstance(v, (dict, list)))
    legend = " ".join(f'<span style="background:{_COLORS[p]};padding:0 6px">{p}</span>' for p in PHASES[:3])
    doc = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px}h2{font-size:15px;margin:18px 0 4px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}</style>",
        "</head><body>", f"<h1 style='font-size:18px'>{html.escape(title)}</h1>",
        f"<p style='font-size:12px'>{meta}; {tl.ops:,} operations, {tl.samples:,} memory samples, "
        f"{tl.t1 - tl.t0:.4g} s. Phases: {legend}</p>",
        "<h2>Device memory (allocated, reserved; dashed: capacity)</h2>", *mem,
        "<h2>PCIe lanes</h2>", *lanes("pcie", ("h2d", "d2h")),
        "<h2>Engines</h2>", *(lanes("gantt", active) if (active := tuple(e for e in ENGINES if any(tl.busy[e])))
                              else [f"<p style='font-size:12px'>No device activity in this trace (CUPTI: "
                                    f"{html.escape(str(tl.header.get('cupti', 'not traced')))}).</p>"]), *schedule,
        "<h2>Per phase</h2>",
        "<table id='summary'><tr><th>phase</th><th>time</th><th>peak allocated</th><th>H2D</th><th>D2H</th></tr>",
        *rows, "</table>", "</body></html>",
    ]
    with _AtomicFile(path) as f:
        f.write("\n".join(doc))


def write_chrome(tl_header: Dict[str, Any], events: Iterable[Dict[str, Any]], path: str) -> int:
    """A Chrome trace (chrome://tracing, Perfetto): engines as threads, memory as a counter, phases
    as instant markers. Streams the events; returns how many were written."""
    tids = {e: i + 1 for i, e in enumerate(ENGINES)}
    n = 0
    with _AtomicFile(path) as f:
        f.write('{"displayTimeUnit":"ms","otherData":' + json.dumps({"memtide_trace": VERSION,
                                                                      "source": tl_header.get("source")}))
        f.write(',"traceEvents":[')
        first = True

        def put(obj: Dict[str, Any]) -> None:
            nonlocal first, n
            f.write(("" if first else ",\n") + json.dumps(obj, separators=(",", ":")))
            first = False
            n += 1

        for engine, tid in tids.items():
            put({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": engine}})
        for ev in events:
            kind = ev.get("type")
            if kind == "op" and ev.get("engine") in tids:
                put({"ph": "X", "pid": 1, "tid": tids[ev["engine"]], "name": ev["engine"],
                     "ts": ev["start"] * 1e6, "dur": (ev["end"] - ev["start"]) * 1e6, "args": {"bytes": ev.get("bytes")}})
            elif kind == "memory":
                put({"ph": "C", "pid": 1, "name": "device memory", "ts": ev["t"] * 1e6,
                     "args": {"allocated": ev["allocated"], "reserved": ev["reserved"]}})
            elif kind == "phase":
                put({"ph": "i", "pid": 1, "tid": 0, "s": "g", "name": ev["phase"], "ts": ev["t"] * 1e6})
        f.write("]}\n")
    return n


def write_memory_viz(events: Iterable[Dict[str, Any]], path: str) -> int:
    """The trace's allocations and frees as a snapshot pickle in the shape torch.cuda.memory.
    _snapshot() returns (device_traces; no segments: a trace does not keep them), for torch's
    _memory_viz and pytorch.org/memory_viz. Returns how many trace entries it holds."""
    import pickle

    def number(v: Any) -> int:
        if isinstance(v, str):
            try:
                return int(v, 0)
            except ValueError:
                return 0
        return int(v or 0)

    entries = []
    for ev in events:
        kind = ev.get("type")
        if kind in ("alloc", "free"):
            entries.append({"action": "alloc" if kind == "alloc" else "free_completed", "addr": number(ev.get("addr")),
                            "size": number(ev.get("bytes")), "stream": number(ev.get("stream")),
                            "time_us": int(float(ev["t"]) * 1e6), "frames": []})
        elif kind == "oom":
            entries.append({"action": "oom", "addr": 0, "size": number(ev.get("bytes")),
                            "stream": number(ev.get("stream")), "time_us": int(float(ev["t"]) * 1e6), "frames": []})
    with _AtomicFile(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [entries]}, f, protocol=4)
    return len(entries)


def write_png(tl: Timeline, path: str) -> bool:
    """Memory over time and the engines' load, with matplotlib; False when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for a, b, name in tl.spans:
        for ax in (ax1, ax2):
            ax.axvspan(a - tl.t0, b - tl.t0, color=_COLORS.get(name, "#eee"), lw=0)
    if tl.memory:
        ts = [m[0] - tl.t0 for m in tl.memory]
        ax1.plot(ts, [m[1] / 2**30 for m in tl.memory], label="allocated")
        ax1.plot(ts, [m[2] / 2**30 for m in tl.memory], label="reserved", color="#999")
    ax1.set_ylabel("GiB")
    ax1.legend(loc="upper right")
    span = (tl.t1 - tl.t0) / tl.bins
    engines = [e for e in ENGINES if any(tl.busy[e])]
    for r, e in enumerate(engines):
        xs = [tl.t0 + (k + 0.5) * span - tl.t0 for k in range(tl.bins)]
        ax2.fill_between(xs, r, [r + min(v / span, 1) * 0.8 for v in tl.busy[e]], color=_COLORS[e], step="mid")
    ax2.set_yticks([r + 0.4 for r in range(len(engines))], engines)
    ax2.set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def render(trace: str, html_path: str, chrome: Optional[str] = None, png: Optional[str] = None,
           progress: bool = False, memory_viz: Optional[str] = None) -> Dict[str, Any]:
    """The report (and the Chrome trace, the PNG and the memory_viz pickle when asked) of a trace."""
    header, events = read_trace(trace, progress=progress)
    tl = Timeline(header, events)
    write_html(tl, html_path, title=f"memtide timeline: {os.path.basename(trace)}")
    out: Dict[str, Any] = {"html": html_path, "events": sum(tl.counts.values()), "summary": tl.summary()}
    if chrome:
        header2, events2 = read_trace(trace)
        out["chrome"] = chrome
        out["chrome_events"] = write_chrome(header2, events2, chrome)
    if png:
        out["png"] = png if write_png(tl, png) else None
    if memory_viz:
        _, events3 = read_trace(trace)
        out["memory_viz"] = memory_viz
        out["memory_viz_entries"] = write_memory_viz(events3, memory_viz)
    return out
