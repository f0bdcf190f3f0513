#!/usr/bin/env python3
"""How long `memtide timeline` takes on a large trace: writes a synthetic trace of N events
(ops on every engine, memory samples, phase marks; default 1e6), then renders the HTML report and
the Chrome trace, and prints the times.

    python bench/python/bench_timeline.py [--events N] [--out bench/results/timeline/DATE-MACHINE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from datetime import date

import memtide
import memtide_timeline as timeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--out")
    args = ap.parse_args()
    engines = ("compute", "link", "h2d", "d2h", "host")
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "big.trace.jsonl")
        t0 = time.perf_counter()
        with timeline.TraceWriter(trace, source="bench", clock="virtual", capacity_bytes=80 << 30) as w:
            n, t = 0, 0.0
            while n < args.events:
                if n % 100_000 == 0:
                    w.phase(t, ("forward", "backward", "update")[(n // 100_000) % 3])
                    n += 1
                w.op(engines[n % 5], t, t + 2e-6, 1 << 20)
                w.memory(t, (20 << 30) + (n % 1000) * (1 << 20), 40 << 30)
                n += 2
                t += 1e-6
        write_s = time.perf_counter() - t0
        size = os.path.getsize(trace)
        t0 = time.perf_counter()
        out = timeline.render(trace, os.path.join(d, "r.html"))
        render_s = time.perf_counter() - t0
        html_size = os.path.getsize(os.path.join(d, "r.html"))
        t0 = time.perf_counter()
        header, events = timeline.read_trace(trace)
        chrome_n = timeline.write_chrome(header, events, os.path.join(d, "r.json"))
        chrome_s = time.perf_counter() - t0
    line = (f"{out['events']:,} events ({size / 2**20:.0f} MiB of trace): written in {write_s:.1f} s; the HTML "
            f"report ({html_size / 2**10:.0f} KiB) rendered in {render_s:.1f} s; the Chrome trace ({chrome_n:,} "
            f"events) in {chrome_s:.1f} s more")
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# memtide timeline on a large trace ({date.today()})\n\n")
            f.write(f"Command: `python bench/python/bench_timeline.py --events {args.events} --out {args.out}` on "
                    f"{os.cpu_count()} cores, {platform.machine()}, memtide {memtide.__version__}, Python "
                    f"{platform.python_version()}.\n\n{line}. Target: 1e6 events in under 10 s.\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
