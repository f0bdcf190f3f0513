"""What a report draws from a trace: the engines, the phases and their colors, and the Timeline
gathered from a trace's events in one pass."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Tuple

ENGINES = ("compute", "link", "h2d", "d2h", "host", "nvme")
PHASES = ("forward", "backward", "update", "other")
COLORS = {"forward": "#dbe7f6", "backward": "#fbe3d2", "update": "#dcefdc", "other": "#eeeeee",
          "compute": "#4c72b0", "link": "#8172b3", "h2d": "#dd8452", "d2h": "#c44e52", "host": "#55a868",
          "nvme": "#937860"}


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
