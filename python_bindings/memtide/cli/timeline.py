"""``memtide timeline``: render a memtide trace (the memtide_timeline package, tools/timeline/) as an
HTML report, a Chrome trace, a PNG and a memory_viz pickle."""

from __future__ import annotations

import argparse
import json

from memtide._memtide import format_bytes

from ._common import UsageError

def _cmd_timeline(args: argparse.Namespace) -> int:
    import memtide_timeline as timeline

    # Four outputs by default, beside the report: the Chrome trace, the PNG, the memory_viz pickle.
    files = timeline.companions(args.output)
    chrome = args.chrome or files["chrome"]
    png = args.png or files["png"]
    snapshot = timeline.looks_like_pickle(args.trace)
    if snapshot and args.memory_viz:
        raise UsageError(f"--memory-viz: {args.trace} is a torch memory snapshot already (memory_viz reads it as it is)")
    viz = None if snapshot else args.memory_viz or files["pickle"]
    try:
        # Named by their flags: the defaults are the report's companions, given or not.
        timeline.check_outputs(args.trace, {"-o/--output": args.output,
                                            "--chrome" + ("" if args.chrome else " (default)"): chrome,
                                            "--png" + ("" if args.png else " (default)"): png,
                                            "--memory-viz" + ("" if args.memory_viz else " (default)"): viz})
        timeline.check_report_target(args.output)
        report = timeline.render(args.trace, args.output, chrome=chrome, png=png, progress=not args.json,
                                 memory_viz=viz)
    except timeline.TraceError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))  # strict JSON: the reader refused NaN and Infinity
        return 0
    print(f"wrote {report['html']} ({report['events']:,} events)")
    print(f"wrote {report['chrome']} ({report['chrome_events']:,} Chrome trace events)")
    if report.get("png"):
        print(f"wrote {report['png']}")  # without matplotlib render() has said so on stderr
    if report.get("memory_viz"):
        print(f"wrote {report['memory_viz']} ({report['memory_viz_entries']:,} allocations and frees for memory_viz)")
    snap = report.get("snapshot")
    if snap:
        print(f"  torch memory snapshot, device {snap['device']}: {snap['segments']:,} segments, "
              f"{format_bytes(snap['reserved_bytes'])} reserved, {format_bytes(snap['allocated_bytes'])} allocated; "
              f"{snap['trace_entries']:,} trace entries, peak allocated {format_bytes(snap['peak_allocated'])}")
    for r in report["summary"]:
        print(f"  {r['phase']:<9} {r['duration_s']:.4g} s, peak {format_bytes(int(r['peak_allocated']))}, "
              f"H2D {format_bytes(int(r['h2d_bytes']))} at {r['h2d_gbs']:.1f} GB/s, "
              f"D2H {format_bytes(int(r['d2h_bytes']))} at {r['d2h_gbs']:.1f} GB/s")
    return 0


def add_parser(sub) -> None:
    tl = sub.add_parser(
        "timeline", help="render a memtide trace: an HTML report that opens offline, a Chrome trace, a PNG, a "
        "memory_viz pickle",
        description="Reads a memtide trace (JSON Lines; see the memtide_timeline package for the format), or a torch "
        "memory snapshot pickle (its segments, allocations over time and the largest blocks at the peak), and writes four "
        "outputs: a single-file HTML report (memory over time per phase, the PCIe lanes, the engines as a Gantt "
        "chart, the update-phase schedule, a summary per phase) that opens offline, a Chrome/Perfetto trace, a PNG "
        "(with matplotlib) and the allocations as a snapshot pickle for torch's memory_viz.")
    tl.add_argument("trace", help="the trace file (e.g. from memtide simulate --timeline), or a torch memory "
                    "snapshot pickle (torch.cuda.memory._dump_snapshot; read without running any code in it)")
    tl.add_argument("-o", "--output", default="memtide_timeline.html", metavar="REPORT.html",
                    help="the HTML report (default: memtide_timeline.html)")
    tl.add_argument("--chrome", metavar="FILE.json",
                    help="the Chrome trace (chrome://tracing, Perfetto; default: REPORT.chrome.json)")
    tl.add_argument("--png", metavar="FILE.png", help="the PNG (needs matplotlib; default: REPORT.png)")
    tl.add_argument("--memory-viz", metavar="FILE.pickle",
                    help="the allocations as a snapshot pickle for torch's memory_viz (default: REPORT.pickle)")
    tl.add_argument("--json", action="store_true", help="print what was written as JSON")
    tl.set_defaults(func=_cmd_timeline)

