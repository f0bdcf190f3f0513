"""The HTML report: one file with inline SVG that opens offline."""

from __future__ import annotations

import html
from typing import List, Optional, Sequence, Tuple

from memtide._files import open_output
from memtide._memtide import format_bytes

from .model import (COLORS, ENGINES, HOST_SERIES, NVME_LANES, PHASES, Timeline, capacity_drawn, host_series,
                    nvme_queues, series_points, spill_samples)


def _fmt_bytes(n: float) -> str:
    # memtide's byte formatter with one decimal: the report's labels are short.
    return format_bytes(int(n), 1)


def _svg_phase_bands(tl: Timeline, x, height: float, y0: float = 0) -> List[str]:
    out = []
    for a, b, name in tl.spans:
        out.append(f'<rect class="phase" x="{x(a):.1f}" y="{y0:g}" width="{max(x(b) - x(a), 0.5):.1f}" '
                   f'height="{height:g}" fill="{COLORS.get(name, "#eee")}"><title>{html.escape(name)} {b - a:.4g} s'
                   '</title></rect>')
    return out


W, L = 1100, 90
WIDTH = W - L - 10
ROW_H = 26


def _x(tl: Timeline):
    """Seconds on the trace's clock to the charts' x: its drawn window (tl.t0 to tl.t1) across the
    width. The ranks of one report are binned on one window (Timeline.respan), so one x each."""
    scale = WIDTH / (tl.t1 - tl.t0)
    return lambda t: L + (t - tl.t0) * scale


def _busy_rects(tl: Timeline, engine: str, row: List[float], top: float) -> List[str]:
    """One lane: its busy columns, neighbours of similar load merged into one rect."""
    out = []
    col = WIDTH / tl.bins
    span = (tl.t1 - tl.t0) / tl.bins
    k = 0
    while k < tl.bins:
        if row[k] <= 0:
            k += 1
            continue
        j, level = k, min(row[k] / span, 1.0)
        while j + 1 < tl.bins and row[j + 1] > 0 and abs(min(row[j + 1] / span, 1.0) - level) < 0.1:
            j += 1
        opacity = 0.25 + 0.75 * level
        out.append(f'<rect class="busy" x="{L + k * col:.1f}" y="{top}" width="{(j - k + 1) * col:.1f}" '
                   f'height="{ROW_H - 6}" fill="{COLORS[engine]}" fill-opacity="{opacity:.2f}">'
                   f'<title>{engine} {level * 100:.0f}% busy</title></rect>')
        k = j + 1
    return out


def _lanes(svg_id: str, groups: Sequence[Tuple[Timeline, Tuple[str, ...], dict, Optional[int]]]) -> List[str]:
    """Lanes of busy time, one per engine, in groups: one group (rank None) with the phase bands
    across the chart, or one group per rank (``<g class="rank" data-rank="R">``, lanes named
    "rank R engine") with that rank's phase bands behind its own lanes."""
    h = ROW_H * sum(len(engines) for _, engines, _, _ in groups) + 20
    out = [f'<svg id="{svg_id}" width="{W}" height="{h}" xmlns="http://www.w3.org/2000/svg">']
    r = 0
    for tl, engines, busy, rank in groups:
        x = _x(tl)
        if rank is None:
            out += _svg_phase_bands(tl, x, h - 20)
        else:
            out.append(f'<g class="rank" data-rank="{rank}">')
            out += _svg_phase_bands(tl, x, ROW_H * len(engines) - 2, 3 + r * ROW_H)
        for engine in engines:
            top = 5 + r * ROW_H
            name = engine if rank is None else f"rank {rank} {engine}"
            out.append(f'<text class="lane" x="4" y="{top + 15}" font-size="12">{html.escape(name)}</text>')
            out += _busy_rects(tl, engine, busy[engine], top)
            r += 1
        if rank is not None:
            out.append("</g>")
    out.append("</svg>")
    return out


def _memory_chart(tl: Timeline, x, svg_id: str, samples: List[Tuple], series: List[Tuple[int, str]], cap: float,
                  cap_name: str, H: int = 220, used: Optional[float] = None, label: str = "") -> List[str]:
    """Bytes over time, one polyline per series (`samples`' column, its name; -1 in a sample: not
    recorded), against a capacity (dashed), with the phase bands. `used`: the scale's top (the
    charts of several ranks share one), else the highest sample; `label`: the chart's name, drawn
    in it."""
    used = max([m[i] for m in samples for i, _ in series] + [1]) if used is None else max(used, 1)
    cap_drawn = capacity_drawn(cap, used)
    peak = max(used * 1.1, cap if cap_drawn else 0, 1)

    def y(v: float) -> float:
        return 10 + (1 - v / peak) * (H - 30)

    out = [f'<svg id="{svg_id}" width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg">']
    out += _svg_phase_bands(tl, x, H - 20)
    for idx, name in series:
        pts = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in series_points(samples, idx))
        if not pts:
            continue
        out.append(f'<polyline class="series" points="{pts}" fill="none" stroke="{COLORS[name]}" '
                   f'stroke-width="1.5"><title>{name}</title></polyline>')
    if cap_drawn:
        out.append(f'<line class="capacity" x1="{L}" x2="{W - 10}" y1="{y(cap):.1f}" y2="{y(cap):.1f}" stroke="#c00" '
                   f'stroke-dasharray="4 3"><title>{cap_name} {_fmt_bytes(cap)}</title></line>')
    elif cap:
        out.append(f'<text x="{W - 12}" y="22" font-size="11" text-anchor="end" fill="#c00">{cap_name} '
                   f'{_fmt_bytes(cap)}: far above what was used</text>')
    for frac in (0, 0.5, 1):
        out.append(f'<text x="4" y="{y(peak * frac) + 4:.1f}" font-size="11">{_fmt_bytes(peak * frac)}</text>')
    if label:
        out.append(f'<text class="label" x="{L + 6}" y="22" font-size="12" font-weight="bold">{html.escape(label)}</text>')
    out.append("</svg>")
    return out


def _legend(names) -> str:
    return " ".join(f'<span style="color:{COLORS[n]}">&#9632; {n}</span>' for n in names)


def write_html(tl: Timeline, path: str, title: str = "memtide timeline", extra: Sequence[str] = ()) -> None:
    """One HTML file with inline SVG: memory over time per tier (device, host, NVMe) against each
    tier's capacity, the PCIe lanes, the NVMe lanes, the engines as a Gantt chart, and a summary
    table per phase, the phase bands across all. No script, no network."""
    width = WIDTH
    x = _x(tl)
    mem = _memory_chart(tl, x, "memory", tl.memory, [(1, "allocated"), (2, "reserved")],
                        tl.header.get("capacity_bytes") or 0, "capacity")

    def lanes(svg_id: str, engines: Tuple[str, ...], busy=None) -> List[str]:
        return _lanes(svg_id, [(tl, engines, tl.busy if busy is None else busy, None)])

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
        colors = {"cpu update": COLORS["host"], "prefetch": COLORS["h2d"], "gpu update": COLORS["compute"],
                  "flush": COLORS["d2h"], "param upload": "#e5ae38", "grad upload": "#8c8c8c",
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
    host: List[str] = []
    if tl.host_samples:
        recorded = host_series(tl)
        host = [f"<h2>Host memory ({_legend(s for _, s in recorded)}; dashed: the host budget)</h2>",
                *_memory_chart(tl, x, "host", tl.host, recorded, tl.header.get("host_capacity_bytes") or 0,
                               "host budget")]
    nvme: List[str] = []
    if tl.nvme_transfers:
        t = tl.nvme_totals
        nvme = [f"<h2>NVMe: {t['reads']:,} reads ({_fmt_bytes(t['read_bytes'])}), {t['writes']:,} write-backs "
                f"({_fmt_bytes(t['write_bytes'])}), {t['waits']:,} waits for a read ({t['wait_s'] * 1e3:.3g} ms)</h2>",
                *lanes("nvme", NVME_LANES, tl.nvme_busy)]
        nvme += _queue_chart(tl, x)
    if tl.spill:
        nvme += ["<h2>State on NVMe (dashed: the space reserved on the drive)</h2>",
                 *_memory_chart(tl, x, "nvme-memory", spill_samples(tl), [(1, "nvme")],
                                tl.header.get("nvme_capacity_bytes") or 0, "reserved", H=120)]
    saves: List[str] = []
    if tl.saves:
        last = tl.saves[-1]
        targets = sorted({t[4] for t in tl.saves if t[4]})
        saves = [f"<h2>Checkpoint saves beside training ({html.escape(', '.join(targets)) or 'saves'}): bytes written "
                 f"(dashed: the save's size); steps waited {last[3]:.3g} s for the writer</h2>",
                 *_memory_chart(tl, x, "checkpoint", [(t, w) for t, w, *_ in tl.saves] + [(tl.t1, last[1])],
                                [(1, "written")], last[2], "size", H=120)]
    meta = _meta(tl.header)
    legend = " ".join(f'<span style="background:{COLORS[p]};padding:0 6px">{p}</span>' for p in PHASES[:3])
    body = [
        f"<p style='font-size:12px'>{meta}; {tl.ops:,} operations, {tl.samples:,} memory samples, "
        f"{tl.t1 - tl.t0:.4g} s. Phases: {legend}</p>",
        "<h2>Device memory (allocated, reserved; dashed: capacity)</h2>", *mem,
        *host, "<h2>PCIe lanes</h2>", *lanes("pcie", ("h2d", "d2h")), *nvme, *saves,
        "<h2>Engines</h2>", *_clock_note(tl.header), *(lanes("gantt", active) if (active := tuple(e for e in ENGINES if any(tl.busy[e])))
                              else [f"<p style='font-size:12px'>No device activity in this trace (CUPTI: "
                                    f"{html.escape(str(tl.header.get('cupti', 'not traced')))}).</p>"]), *schedule,
        "<h2>Per phase</h2>", *_summary_table([(None, tl)]), *extra,
    ]
    _write_page(path, title, body)


#: Header fields a report does not list: the format's version, how the clock was anchored (used to
#: align ranks, meaningless to read), and the host lane's clock (said above the engines' lanes).
_UNLISTED = ("memtide_trace", "epoch_offset_s", "host_lane")


def _clock_note(header) -> List[str]:
    """Which clock the engines' lanes are on, where the trace says (``host_lane``: a CPU run's)."""
    note = header.get("host_lane")
    return [f"<p class='clock' style='font-size:12px'>{html.escape(str(note))}</p>"] if note else []


def _meta(header) -> str:
    return ", ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in header.items()
                     if k not in _UNLISTED and not isinstance(v, (dict, list)))


def _write_page(path: str, title: str, body: Sequence[str]) -> None:
    doc = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px}h2{font-size:15px;margin:18px 0 4px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}</style>",
        "</head><body>", f"<h1 style='font-size:18px'>{html.escape(title)}</h1>", *body, "</body></html>",
    ]
    with open_output(path) as f:
        f.write("\n".join(doc))


def _summary_table(timelines: Sequence[Tuple[Optional[int], Timeline]]) -> List[str]:
    """The table per phase: of one trace (rank None), or of several ranks, a row per rank and
    phase with the rank in the first column. Host and NVMe columns where any trace has them."""
    host_cols = [c for c in HOST_SERIES if any(tl.host_samples and tl.host_peak[c] >= 0 for _, tl in timelines)]
    nvme = any(tl.nvme_transfers for _, tl in timelines)
    ranks = any(rank is not None for rank, _ in timelines)
    rows = []
    for rank, tl in timelines:
        for r in tl.summary():
            cells = [str(rank)] if ranks else []
            cells += [r["phase"], f"{r['duration_s']:.4g} s", _fmt_bytes(r["peak_allocated"]),
                      f"{_fmt_bytes(r['h2d_bytes'])} at {r['h2d_gbs']:.1f} GB/s",
                      f"{_fmt_bytes(r['d2h_bytes'])} at {r['d2h_gbs']:.1f} GB/s"]
            cells += [_fmt_bytes(r["host_" + c + "_peak"]) if "host_" + c + "_peak" in r else "" for c in host_cols]
            if nvme:
                cells += ([_fmt_bytes(r["nvme_read_bytes"]), _fmt_bytes(r["nvme_write_bytes"]),
                           f"{r['nvme_wait_s'] * 1e3:.3g} ms"] if "nvme_read_bytes" in r else ["", "", ""])
            rows.append(("<tr>" if rank is None else f'<tr data-rank="{rank}">')
                        + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    heads = (["rank"] if ranks else []) + ["phase", "time", "peak allocated", "H2D", "D2H",
                                           *(f"host {c} peak" for c in host_cols)]
    if nvme:
        heads += ["NVMe read", "NVMe written", "waits for NVMe"]
    return ["<table id='summary'><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr>", *rows, "</table>"]


def _queue_chart(tl: Timeline, x) -> List[str]:
    """The read-ahead (reads queued and not yet taken by the update) and the write-back queue,
    their highest depth per column, as step lines."""
    series = nvme_queues(tl)
    if not series:
        return []
    top = max(max(row) for _, row in series) or 1
    H = 100
    col = WIDTH / tl.bins

    def y(v: float) -> float:
        return 8 + (1 - v / top) * (H - 20)

    out = [f'<svg id="nvme-queues" width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg">']
    out += _svg_phase_bands(tl, x, H - 10)
    for (name, row), color in zip(series, (COLORS["read"], COLORS["write"])):
        pts = " ".join(f"{L + k * col:.1f},{y(v):.1f} {L + (k + 1) * col:.1f},{y(v):.1f}" for k, v in enumerate(row))
        out.append(f'<polyline class="series" points="{pts}" fill="none" stroke="{color}" stroke-width="1.5">'
                   f'<title>{name}: up to {max(row)} subgroups</title></polyline>')
    out.append(f'<text x="4" y="{y(top) + 4:.1f}" font-size="11">{top} subgroups</text>')
    out.append(f'<text x="4" y="{y(0) + 4:.1f}" font-size="11">0</text>')
    out.append("</svg>")
    return ["<h2>NVMe queues (" + " ".join(
        f'<span style="color:{c}">&#9632; {n}</span>' for (n, _), c in zip(series, (COLORS["read"], COLORS["write"])))
        + ")</h2>", *out]


def write_ranks_html(ranks: Sequence[Tuple[int, Timeline]], path: str, title: str, clock_note: str) -> None:
    """One report of a job's ranks, each binned on one common window (Timeline.respan): device
    memory per rank (one scale for all), the host tier per rank, the PCIe, NVMe and engine lanes
    per rank (``<g class="rank">``), each rank's phase bands behind its own charts, and the table
    per phase with a row per rank and phase. `clock_note` says how the time axis was aligned."""
    tls = [tl for _, tl in ranks]
    legend = " ".join(f'<span style="background:{COLORS[p]};padding:0 6px">{p}</span>' for p in PHASES[:3])
    header = tls[0].header
    shared = {k: v for k, v in header.items() if k not in ("rank", "host", "pid")
              and all(tl.header.get(k) == v for tl in tls)}
    world = header.get("world_size")
    body = [f"<p style='font-size:12px'>{len(ranks)} ranks"
            + (f" of {world}" if world is not None else "") + f" ({', '.join(str(r) for r, _ in ranks)}); "
            f"{_meta(shared)}; {sum(tl.ops for tl in tls):,} operations, {sum(tl.samples for tl in tls):,} memory "
            f"samples, {tls[0].t1 - tls[0].t0:.4g} s. {html.escape(clock_note)} Phases: {legend}</p>"]
    top = max((max(m[1], m[2]) for tl in tls for m in tl.memory), default=0)
    body.append("<h2>Device memory per rank (allocated, reserved; dashed: capacity; one scale)</h2>")
    for rank, tl in ranks:
        body += _memory_chart(tl, _x(tl), f"memory-rank{rank}", tl.memory, [(1, "allocated"), (2, "reserved")],
                              tl.header.get("capacity_bytes") or 0, "capacity", H=140, used=top, label=f"rank {rank}")
    hosts = [(rank, tl) for rank, tl in ranks if tl.host_samples]
    if hosts:
        series = [s for s in HOST_SERIES if any(tl.host_peak[s] >= 0 for _, tl in hosts)]
        top = max(tl.host_peak[s] for _, tl in hosts for s in series)
        body.append(f"<h2>Host memory per rank ({_legend(series)}; dashed: the host budget; one scale)</h2>")
        for rank, tl in hosts:
            recorded = [(1 + HOST_SERIES.index(s), s) for s in series if tl.host_peak[s] >= 0]
            body += _memory_chart(tl, _x(tl), f"host-rank{rank}", tl.host, recorded,
                                  tl.header.get("host_capacity_bytes") or 0, "host budget", H=140, used=top,
                                  label=f"rank {rank}")
    body += ["<h2>PCIe lanes per rank</h2>", *_lanes("pcie", [(tl, ("h2d", "d2h"), tl.busy, rank) for rank, tl in ranks])]
    nvme = [(tl, NVME_LANES, tl.nvme_busy, rank) for rank, tl in ranks if tl.nvme_transfers]
    if nvme:
        body += ["<h2>NVMe lanes per rank (reads, write-backs, the update's waits for a read)</h2>", *_lanes("nvme", nvme)]
    active = [(tl, engines, tl.busy, rank) for rank, tl in ranks
              if (engines := tuple(e for e in ENGINES if any(tl.busy[e])))]
    body.append("<h2>Engines per rank</h2>")
    if active:
        body += _lanes("gantt", active)
    else:
        cupti = sorted({str(tl.header.get("cupti", "not traced")) for tl in tls})
        body.append(f"<p style='font-size:12px'>No device activity in these traces (CUPTI: "
                    f"{html.escape(', '.join(cupti))}).</p>")
    body += ["<h2>Per rank and phase</h2>", *_summary_table(list(ranks)),
             "<p style='font-size:12px'>Each rank's own report (memtide timeline on its trace) has its update-phase "
             "schedule and NVMe queues.</p>"]
    _write_page(path, title, body)
