"""The HTML report: one file with inline SVG that opens offline."""

from __future__ import annotations

import html
from typing import List, Tuple

from memtide._memtide import format_bytes

from .files import AtomicFile
from .model import COLORS, ENGINES, PHASES, Timeline


def _fmt_bytes(n: float) -> str:
    # memtide's byte formatter with one decimal: the report's labels are short.
    return format_bytes(int(n), 1)


def _svg_phase_bands(tl: Timeline, x, height: int) -> List[str]:
    out = []
    for a, b, name in tl.spans:
        out.append(f'<rect class="phase" x="{x(a):.1f}" y="0" width="{max(x(b) - x(a), 0.5):.1f}" height="{height}" '
                   f'fill="{COLORS.get(name, "#eee")}"><title>{html.escape(name)} {b - a:.4g} s</title></rect>')
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
                           f'height="{row_h - 6}" fill="{COLORS[engine]}" fill-opacity="{opacity:.2f}">'
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
    rows = []
    for r in tl.summary():
        rows.append(f"<tr><td>{r['phase']}</td><td>{r['duration_s']:.4g} s</td><td>{_fmt_bytes(r['peak_allocated'])}</td>"
                    f"<td>{_fmt_bytes(r['h2d_bytes'])} at {r['h2d_gbs']:.1f} GB/s</td>"
                    f"<td>{_fmt_bytes(r['d2h_bytes'])} at {r['d2h_gbs']:.1f} GB/s</td></tr>")
    meta = ", ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in tl.header.items()
                     if k not in ("memtide_trace",) and not isinstance(v, (dict, list)))
    legend = " ".join(f'<span style="background:{COLORS[p]};padding:0 6px">{p}</span>' for p in PHASES[:3])
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
    with AtomicFile(path) as f:
        f.write("\n".join(doc))
