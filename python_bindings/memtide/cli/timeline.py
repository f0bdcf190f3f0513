"""``memtide timeline``: render a memtide trace (the memtide._timeline package, tools/timeline/) as an
HTML report, a Chrome trace, a PNG and a memory_viz pickle."""

from __future__ import annotations

import argparse
import json

from memtide._memtide import format_bytes

from ._common import UsageError

def _cmd_timeline(args: argparse.Namespace) -> int:
    from memtide import _timeline as timeline

    try:
        inputs = timeline.trace_inputs(args.trace)
    except timeline.TraceError as e:
        raise UsageError(str(e)) from None
    if len(inputs) > 1:
        return _cmd_ranks(args, inputs)
    args.trace = inputs[0]
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


def _cmd_ranks(args: argparse.Namespace, inputs) -> int:
    """Several traces: the ranks of one job in one report (memtide._timeline.ranks)."""
    from memtide import _timeline as timeline

    for flag, given in (("--png", args.png), ("--memory-viz", args.memory_viz)):
        if given:
            raise UsageError(f"{flag}: a report of several ranks is the HTML report and the Chrome trace; {flag} "
                             f"draws one trace (memtide timeline RANK.trace.jsonl {flag} ...)")
    chrome = args.chrome or timeline.companions(args.output)["chrome"]
    try:
        timeline.check_outputs(inputs[0], {"-o/--output": args.output,
                                           "--chrome" + ("" if args.chrome else " (default)"): chrome})
        timeline.check_report_target(args.output)
        report = timeline.render_ranks(inputs, args.output, chrome=chrome, progress=not args.json)
    except timeline.TraceError as e:
        raise UsageError(str(e)) from None
    report.pop("shifts")
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
        return 0
    world = f" of {report['world_size']}" if report["world_size"] is not None else ""
    print(f"wrote {report['html']} ({len(report['ranks'])} ranks{world}, {report['events']:,} events; "
          f"{report['clock_note']})")
    print(f"wrote {report['chrome']} ({report['chrome_events']:,} Chrome trace events, a process per rank)")
    for r in report["ranks"]:
        for row in r["summary"]:
            print(f"  rank {r['rank']:<3} {row['phase']:<9} {row['duration_s']:.4g} s, peak "
                  f"{format_bytes(int(row['peak_allocated']))}, H2D {format_bytes(int(row['h2d_bytes']))}, "
                  f"D2H {format_bytes(int(row['d2h_bytes']))}")
    return 0


def add_parser(sub) -> None:
    tl = sub.add_parser(
        "timeline", help="render a memtide trace: an HTML report that opens offline, a Chrome trace, a PNG, a "
        "memory_viz pickle",
        description="Reads a memtide trace (JSON Lines; see the memtide._timeline package for the format), or a torch "
        "memory snapshot pickle (its segments, allocations over time and the largest blocks at the peak), and writes four "
        "outputs: a single-file HTML report (memory over time per phase, the PCIe lanes, the engines as a Gantt "
        "chart, the update-phase schedule, a summary per phase) that opens offline, a Chrome/Perfetto trace, a PNG "
        "(with matplotlib) and the allocations as a snapshot pickle for torch's memory_viz. Given the traces of a job's "
        "ranks (memtide.timeline.record and --timeline name them REPORT.rank<R>.trace.jsonl), writes one report with "
        "lanes per rank on one time axis and a Chrome trace with a process per rank.")
    tl.add_argument("trace", nargs="+", metavar="TRACE",
                    help="the trace file (e.g. from memtide simulate --timeline), or a torch memory snapshot pickle "
                    "(torch.cuda.memory._dump_snapshot; read without running any code in it); or the traces of a "
                    "job's ranks (files, a folder of *.trace.jsonl, or a quoted pattern such as "
                    "'run.rank*.trace.jsonl'): one report with lanes per rank on one time axis, and a Chrome trace "
                    "with a process per rank")
    tl.add_argument("-o", "--output", default="memtide_timeline.html", metavar="REPORT.html",
                    help="the HTML report (default: memtide_timeline.html)")
    tl.add_argument("--chrome", metavar="FILE.json",
                    help="the Chrome trace (chrome://tracing, Perfetto; default: REPORT.chrome.json)")
    tl.add_argument("--png", metavar="FILE.png", help="the PNG (needs matplotlib; default: REPORT.png)")
    tl.add_argument("--memory-viz", metavar="FILE.pickle",
                    help="the allocations as a snapshot pickle for torch's memory_viz (default: REPORT.pickle)")
    tl.add_argument("--json", action="store_true", help="print what was written as JSON")
    tl.set_defaults(func=_cmd_timeline)

