"""The other views of a trace (a Chrome trace, a memory_viz pickle, a PNG) and render(), which writes
the report and whichever of them are asked for."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from memtide._files import open_output

from .files import check_outputs
from .html_report import write_html
from .model import (COLORS, ENGINES, NVME_LANES, Timeline, capacity_drawn, host_series, nvme_queues, series_points,
                    spill_samples)
from .snapshot import SnapshotView, looks_like_pickle, read_snapshot
from .trace import VERSION, read_trace


def write_chrome(tl_header: Dict[str, Any], events: Iterable[Dict[str, Any]], path: str) -> int:
    """A Chrome trace (chrome://tracing, Perfetto): engines as threads, memory as a counter, phases
    as instant markers. Streams the events; returns how many were written."""
    return write_chrome_processes(path, tl_header.get("source"), [(1, None, events, 0.0)])


def write_chrome_processes(path: str, source: Any,
                           processes: Sequence[Tuple[int, Optional[str], Iterable[Dict[str, Any]], float]]) -> int:
    """A Chrome trace of one or more processes (the ranks of a job: one process each, named by
    its rank): ``(pid, name or None, events, offset)``, `offset` added to each time before it is
    written (the common time axis). Streams the events; returns how many were written."""
    tids = {e: i + 1 for i, e in enumerate(ENGINES)}
    n = 0
    with open_output(path) as f:
        f.write('{"displayTimeUnit":"ms","otherData":' + json.dumps({"memtide_trace": VERSION, "source": source}))
        f.write(',"traceEvents":[')
        first = True

        def put(obj: Dict[str, Any]) -> None:
            nonlocal first, n
            f.write(("" if first else ",\n") + json.dumps(obj, separators=(",", ":"), allow_nan=False))
            first = False
            n += 1

        for pid, name, events, offset in processes:
            if name is not None:
                put({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
                put({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
            for engine, tid in tids.items():
                put({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": engine}})
            for ev in events:
                kind = ev.get("type")
                if kind == "op" and ev.get("engine") in tids:
                    put({"ph": "X", "pid": pid, "tid": tids[ev["engine"]], "name": ev["engine"],
                         "ts": (ev["start"] + offset) * 1e6, "dur": (ev["end"] - ev["start"]) * 1e6,
                         "args": {"bytes": ev.get("bytes")}})
                elif kind == "memory":
                    put({"ph": "C", "pid": pid, "name": "device memory", "ts": (ev["t"] + offset) * 1e6,
                         "args": {"allocated": ev["allocated"], "reserved": ev["reserved"]}})
                elif kind == "phase":
                    put({"ph": "i", "pid": pid, "tid": 0, "s": "p" if name is not None else "g", "name": ev["phase"],
                         "ts": (ev["t"] + offset) * 1e6})
        f.write("]}\n")
    return n


def write_memory_viz(events: Iterable[Dict[str, Any]], path: str) -> int:
    """The trace's allocations and frees as a snapshot pickle in the shape torch.cuda.memory.
    _snapshot() returns (device_traces; no segments: a trace does not keep them), for torch's
    _memory_viz and pytorch.org/memory_viz. Returns how many trace entries it holds."""
    import pickle

    def number(v: Any) -> int:
        # read_trace has checked addresses and sizes: an integer, or an address's text ("0x7f...").
        return int(v, 0) if isinstance(v, str) else int(v or 0)

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
    with open_output(path, binary=True) as f:
        pickle.dump({"segments": [], "device_traces": [entries]}, f, protocol=4)
    return len(entries)


#: Said on stderr when a PNG was asked for and matplotlib is missing (it is not a dependency).
NO_PNG = "no PNG: matplotlib is not installed (pip install matplotlib); the HTML report has the same charts"


def write_png(tl: Timeline, path: str) -> bool:
    """The report's charts with matplotlib, one axes each (top to bottom): device memory, the host
    tier's memory, the NVMe lanes, the NVMe queues, the state on NVMe (each tier where the trace
    has it) and the engines' load, drawn from the series the HTML report draws (model.py). False
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    charts = ["device memory"]
    if tl.host_samples:
        charts.append("host memory")
    if tl.nvme_transfers:
        charts.append("NVMe lanes")
    queues = nvme_queues(tl)
    if queues:
        charts.append("NVMe queues")
    spill = spill_samples(tl)
    if spill:
        charts.append("state on NVMe")
    charts.append("engines")
    fig, grid = plt.subplots(len(charts), 1, figsize=(11, 2 + 2 * len(charts)), sharex=True, squeeze=False)
    axes = dict(zip(charts, (row[0] for row in grid)))
    for name, ax in axes.items():
        ax.set_title(name, loc="left", fontsize=10)
        for a, b, phase in tl.spans:
            ax.axvspan(a - tl.t0, b - tl.t0, color=COLORS.get(phase, "#eee"), lw=0)

    def memory(ax: Any, samples: List[Tuple], series: List[Tuple[int, str]], cap: float, cap_name: str) -> None:
        used = 0.0
        for idx, name in series:
            pts = series_points(samples, idx)
            if pts:
                ax.plot([t - tl.t0 for t, _ in pts], [v / 2**30 for _, v in pts], label=name, color=COLORS[name])
                used = max(used, max(v for _, v in pts))
        if capacity_drawn(cap, used):
            ax.axhline(cap / 2**30, color="#c00", ls="--", lw=1, label=cap_name)
        ax.set_ylabel("GiB")
        ax.legend(loc="upper right", fontsize=8)

    memory(axes["device memory"], tl.memory, [(1, "allocated"), (2, "reserved")],
           tl.header.get("capacity_bytes") or 0, "capacity")
    if "host memory" in axes:
        memory(axes["host memory"], tl.host, host_series(tl), tl.header.get("host_capacity_bytes") or 0, "host budget")
    if spill:
        memory(axes["state on NVMe"], spill, [(1, "nvme")], tl.header.get("nvme_capacity_bytes") or 0, "reserved")
    span = (tl.t1 - tl.t0) / tl.bins
    xs = [(k + 0.5) * span for k in range(tl.bins)]

    def lanes(ax: Any, names: Sequence[str], busy: Dict[str, List[float]]) -> None:
        for r, e in enumerate(names):
            ax.fill_between(xs, r, [r + min(v / span, 1) * 0.8 for v in busy[e]], color=COLORS[e], step="mid")
        ax.set_yticks([r + 0.4 for r in range(len(names))], names)

    if "NVMe lanes" in axes:
        lanes(axes["NVMe lanes"], NVME_LANES, tl.nvme_busy)
    if queues:
        ax = axes["NVMe queues"]
        for (name, row), color in zip(queues, (COLORS["read"], COLORS["write"])):
            ax.step(xs, row, where="mid", label=name, color=color)
        ax.set_ylabel("subgroups")
        ax.legend(loc="upper right", fontsize=8)
    lanes(axes["engines"], [e for e in ENGINES if any(tl.busy[e])], tl.busy)
    axes["engines"].set_xlabel("s")
    fig.tight_layout()
    try:
        with open_output(path, binary=True) as f:  # matplotlib given a path would open it itself
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return True


def render(trace: str, html_path: str, chrome: Optional[str] = None, png: Optional[str] = None,
           progress: bool = False, memory_viz: Optional[str] = None) -> Dict[str, Any]:
    """The report (and the Chrome trace, the PNG and the memory_viz pickle when asked) of a trace,
    or of a torch memory snapshot (a pickle: see snapshot.py; it is its own memory_viz pickle).
    A PNG asked for without matplotlib is skipped (``"png": None``), saying so on stderr."""
    check_outputs(trace, {"the report": html_path, "the Chrome trace": chrome, "the PNG": png,
                          "the memory_viz pickle": memory_viz})
    if looks_like_pickle(trace):
        return _render_snapshot(trace, html_path, chrome, png)
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
        if out["png"] is None:
            print(f"timeline: {NO_PNG}", file=sys.stderr, flush=True)
    if memory_viz:
        _, events3 = read_trace(trace)
        out["memory_viz"] = memory_viz
        out["memory_viz_entries"] = write_memory_viz(events3, memory_viz)
    return out


def _render_snapshot(path: str, html_path: str, chrome: Optional[str], png: Optional[str]) -> Dict[str, Any]:
    from .html_report import _fmt_bytes

    view = SnapshotView(read_snapshot(path))
    header = view.header(os.path.basename(path))
    tl = Timeline(header, view.events())
    write_html(tl, html_path, title=f"memtide timeline: {os.path.basename(path)} (torch memory snapshot)",
               extra=view.sections(_fmt_bytes))
    out: Dict[str, Any] = {"html": html_path, "events": sum(tl.counts.values()), "summary": tl.summary(),
                           "snapshot": {"segments": view.segment_count, "reserved_bytes": view.reserved_end,
                                        "allocated_bytes": view.allocated_end, "peak_allocated": view.peak_allocated,
                                        "trace_entries": len(view.snap["trace"]), "device": view.snap["device"]},
                           "memory_viz": None}
    if chrome:
        out["chrome"] = chrome
        out["chrome_events"] = write_chrome(header, view.events(), chrome)
    if png:
        out["png"] = png if write_png(tl, png) else None
        if out["png"] is None:
            print(f"timeline: {NO_PNG}", file=sys.stderr, flush=True)
    return out
