"""What a report draws from a trace: the engines, the phases and their colors, and the Timeline
gathered from a trace's events in one pass."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Tuple

ENGINES = ("compute", "link", "h2d", "d2h", "host", "nvme")
PHASES = ("forward", "backward", "update", "other")
#: The NVMe tier's lanes: its reads, its write-backs and the update's waits for a read.
NVME_LANES = ("read", "write", "wait")
#: The host tier's series (a ``host`` event's fields): the HostArena's reserved and allocated bytes,
#: the pinned staging in use, the process's resident memory.
HOST_SERIES = ("reserved", "allocated", "staging", "rss")
COLORS = {"forward": "#dbe7f6", "backward": "#fbe3d2", "update": "#dcefdc", "other": "#eeeeee",
          "compute": "#4c72b0", "link": "#8172b3", "h2d": "#dd8452", "d2h": "#c44e52", "host": "#55a868",
          "nvme": "#937860", "read": "#937860", "write": "#c44e52", "wait": "#e5ae38",
          "reserved": "#999999", "allocated": "#1f4e8c", "staging": "#dd8452", "rss": "#55a868",
          "written": "#8c613c"}


def _bin_busy(intervals, t0: float, width: float, bins: int) -> List[float]:
    """Busy seconds per column of `intervals` ((start, end), ...)."""
    row = [0.0] * bins
    for a, b in intervals:
        lo = int((a - t0) / width)
        hi = int((b - t0) / width)
        for k in range(max(lo, 0), min(hi, bins - 1) + 1):
            c0 = t0 + k * width
            row[k] += max(0.0, min(b, c0 + width) - max(a, c0))
    return row


def _thin(samples: List[Tuple], keys: Tuple[int, ...], t0: float, width: float, bins: int) -> List[Tuple]:
    """At most two samples per column and series (its lowest and highest by each of `keys`), so
    that a chart's size does not grow with the trace's and no peak is lost; every sample when
    there are few."""
    if len(samples) <= 2 * bins:
        return samples
    columns: Dict[int, List[Tuple]] = defaultdict(list)
    for m in samples:
        columns[min(int((m[0] - t0) / width), bins - 1)].append(m)
    drawn: List[Tuple] = []
    for k in sorted(columns):
        col = columns[k]
        kept = {id(m): m for key in keys for m in (min(col, key=lambda m: m[key]), max(col, key=lambda m: m[key]))}
        drawn += sorted(kept.values())
    return drawn


def _depth(changes: List[Tuple[float, int]], t0: float, width: float, bins: int) -> List[int]:
    """The highest level per column of a count that changes by +1 or -1 at the given times."""
    changes.sort()
    out = [0] * bins
    level, i, n = 0, 0, len(changes)
    for k in range(bins):
        c1 = t0 + (k + 1) * width
        top = level
        while i < n and (changes[i][0] < c1 or k == bins - 1):
            level += changes[i][1]
            top = max(top, level)
            i += 1
        out[k] = top
    return out


def series_points(samples: List[Tuple], idx: int) -> List[Tuple[float, float]]:
    """A chart's series: (t, value) of column `idx` of `samples`, where it was recorded (-1: not)."""
    return [(m[0], m[idx]) for m in samples if m[idx] >= 0]


def capacity_drawn(cap: float, used: float) -> bool:
    """Whether a chart draws a capacity line: the scale follows what was used, and a capacity far
    above it is named, not drawn (it would flatten the curves into the axis)."""
    return bool(cap) and cap <= 1.5 * max(used, 1)


def host_series(tl: "Timeline") -> List[Tuple[int, str]]:
    """The host tier's series the trace recorded: (column of tl.host, name)."""
    return [(1 + j, s) for j, s in enumerate(HOST_SERIES) if tl.host_peak[s] >= 0]


def spill_samples(tl: "Timeline") -> List[Tuple[float, int]]:
    """The state on NVMe: the spill file's bytes, the last held to the drawn window's end."""
    return [(t, b) for t, b in tl.spill] + [(tl.t1, tl.spill[-1][1])] if tl.spill else []


def nvme_queues(tl: "Timeline") -> List[Tuple[str, List[int]]]:
    """The NVMe queues drawn: (name, highest depth per column) of the read-ahead and the
    write-back queue, those the trace has."""
    return [(name, row) for name, row in (("read-ahead", tl.nvme_ahead), ("write-back queue", tl.nvme_behind)) if row]


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
        host: List[Tuple[float, int, int, int, int]] = []  # t and HOST_SERIES (-1: not recorded)
        nvme: List[Tuple[str, int, float, float, float, float]] = []  # what, subgroup, queued, start, end, bytes
        spill: List[Tuple[float, int]] = []
        saves: List[Tuple[float, int, int, float, str]] = []  # t, written, total, waited s, target
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
            elif kind == "host":
                host.append((float(ev["t"]), int(ev.get("reserved", -1)), int(ev.get("allocated", -1)),
                             int(ev.get("staging", -1)), int(ev.get("rss", -1))))
            elif kind == "nvme":
                start = float(ev["start"])
                nvme.append((str(ev["what"]), int(ev.get("subgroup", -1)), float(ev.get("queued", start)), start,
                             float(ev["end"]), float(ev.get("bytes", 0))))
            elif kind == "spill":
                spill.append((float(ev["t"]), int(ev["bytes"])))
            elif kind == "checkpoint":
                saves.append((float(ev["t"]), int(ev["written"]), int(ev["total"]), float(ev.get("waited", 0.0)),
                              str(ev.get("target", ""))))
        phases.sort()
        memory.sort()
        host.sort()
        spill.sort()
        saves.sort()
        #: Checkpoint saves running beside training: (t, bytes written, the save's bytes, seconds
        #: steps waited for the writer so far, the target folder), sampled.
        self.saves = saves
        # The span: the ends of the sorted lists, and each interval's start (queued) and end.
        times = [v for lst in (phases, memory, host, spill, saves) if lst for v in (lst[0][0], lst[-1][0])]
        if ops:
            times += [min(o[1] for o in ops), max(o[2] for o in ops)]
        if nvme:
            times += [min(n[2] for n in nvme), max(n[4] for n in nvme)]
        t0 = min(times) if times else 0.0
        t1 = max(times) if times else 1.0
        #: The first and last time of this trace's events, on its own clock (0 to 1 without any).
        self.extent = (t0, t1 if t1 > t0 else t0 + 1e-9)
        self.timed = bool(times)
        self.bins, self.tiering = bins, tiering
        # Kept for respan(): a report of several ranks bins each rank's events on a common axis.
        self._raw = (phases, memory, ops, host, nvme, spill)
        self._layout(*self.extent)

    def respan(self, t0: float, t1: float) -> None:
        """Bins the events again over [t0, t1] (on this trace's clock): the drawn window of a report
        of several traces. Phases and the table per phase still end where this trace ends."""
        self._layout(t0, t1 if t1 > t0 else t0 + 1e-9)

    def _layout(self, t0: float, t1: float) -> None:
        phases, memory, ops, host, nvme, spill = self._raw
        bins = self.bins
        self.t0, self.t1 = t0, t1
        self.phases = phases
        # Per phase: duration, peak allocated, bytes and busy time per engine.
        spans = []
        for i, (t, name) in enumerate(phases):
            end = phases[i + 1][0] if i + 1 < len(phases) else self.extent[1]
            spans.append((t, end, name))
        self.spans = spans
        per_phase: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.busy = {e: [0.0] * bins for e in ENGINES}
        width = (self.t1 - self.t0) / bins
        starts = [s[0] for s in spans]
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
        # The host tier: per series its peak, overall and per phase.
        self.host_peak = {s: max((h[1 + j] for h in host), default=-1) for j, s in enumerate(HOST_SERIES)}
        # Samples are sorted: each phase's are one run of them, its peaks taken per series at once.
        bounds = [bisect.bisect_left(host, (a,)) for a in starts] + [len(host)]
        runs = [(0, bounds[0], "other")] if starts else [(0, len(host), "other")]
        runs += [(bounds[i], bounds[i + 1], spans[i][2]) for i in range(len(spans))]
        for lo, hi, name in runs:
            if hi <= lo:
                continue
            p = per_phase[name]
            for j, s in enumerate(HOST_SERIES):
                top = max(h[1 + j] for h in host[lo:hi])
                if top > p["host_" + s]:
                    p["host_" + s] = top
        self.host = _thin(host, (1, 2, 3, 4), self.t0, width, bins)
        self.host_samples = len(host)
        # The NVMe tier: busy time per lane, bytes per phase (by when each transfer began), the
        # read-ahead (reads queued and not yet taken by the update) and the write-back queue.
        by_lane: Dict[str, List[Tuple[float, float]]] = {lane: [] for lane in NVME_LANES}
        self.nvme_totals = {"read_bytes": 0.0, "write_bytes": 0.0, "reads": 0, "writes": 0, "wait_s": 0.0, "waits": 0}
        ahead: List[Tuple[float, int]] = []
        behind: List[Tuple[float, int]] = []
        for what, sg, queued, a, b, nbytes in nvme:
            if what not in by_lane:
                continue
            by_lane[what].append((a, b))
            i = bisect.bisect_right(starts, a) - 1
            p = per_phase[spans[i][2] if i >= 0 else "other"]
            if what == "wait":
                self.nvme_totals["wait_s"] += b - a
                self.nvme_totals["waits"] += 1
                p["nvme_wait_s"] += b - a
                ahead.append((b, -1))  # taken by the update
            else:
                self.nvme_totals[what + "_bytes"] += nbytes
                self.nvme_totals[what + "s"] += 1
                p["nvme_" + what + "_bytes"] += nbytes
                if what == "read":
                    ahead.append((queued, 1))
                else:
                    behind += [(queued, 1), (b, -1)]
        self.nvme_busy = {lane: _bin_busy(iv, self.t0, width, bins) for lane, iv in by_lane.items()}
        self.nvme_ahead = _depth(ahead, self.t0, width, bins) if ahead else []
        self.nvme_behind = _depth(behind, self.t0, width, bins) if behind else []
        self.nvme_transfers = len(nvme)
        self.spill = spill
        # Drawn: at most two points per column (its lowest and highest allocation).
        self.memory = _thin(memory, (1,), self.t0, width, bins)
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
            if self.host_samples:
                for s in HOST_SERIES:
                    if self.host_peak[s] >= 0:
                        row["host_" + s + "_peak"] = int(p["host_" + s])
            if self.nvme_transfers:
                row["nvme_read_bytes"] = p["nvme_read_bytes"]
                row["nvme_write_bytes"] = p["nvme_write_bytes"]
                row["nvme_wait_s"] = p["nvme_wait_s"]
            rows.append(row)
        return rows
