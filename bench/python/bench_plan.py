#!/usr/bin/env python3
"""How long the PerfModel takes to plan an update phase, by number of subgroups.

    python bench/python/bench_plan.py [--out bench/results/plan-time/DATE-MACHINE.md]

Each row plans `auto` (the search) for n equal subgroups with up to n/4 static residents and 3
slots, the hardest case (every static count may be searched), best of 3, timed around the call
from Python (the list of sizes in and the placement string out are included). The planner runs
every step under `auto`, so its time is overhead on every step. memtide accepts at most
MAX_SUBGROUPS (2^20), which must plan in under 1 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import date

import memtide


def plan_seconds(n: int) -> tuple[float, float]:
    """Best time of 3, and the plan's predicted total over its resource bound."""
    sizes = [max(1, 400_000_000_000 // n)] * n  # a 400B-param state however it is cut
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan = memtide.plan_update(sizes, policy="auto", gpu_slot_limit=3, gpu_static_limit=n // 4)
        best = min(best, time.perf_counter() - t0)
    pred = plan["prediction"]
    return best, pred["total_ns"] / pred["bound_ns"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the table as Markdown here")
    args = ap.parse_args()
    rows = []
    n = 16
    while n <= memtide.MAX_SUBGROUPS:
        s, ratio = plan_seconds(n)
        rows.append((n, s, ratio))
        print(f"{n:8d} subgroups: {s * 1e3:9.2f} ms ({s / n * 1e6:.2f} us per subgroup), "
              f"total/bound {ratio:.5f}", flush=True)
        n *= 4
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# PerfModel planning time ({date.today()})\n\n")
            f.write(f"Command: `python bench/python/bench_plan.py --out {args.out}` on {os.cpu_count()} cores, "
                    f"{platform.processor() or platform.machine()}, memtide {memtide.__version__}. auto policy, "
                    "equal subgroups of a 400B-param state, up to n/4 static residents, 3 slots, best of 3, "
                    "timed from Python.\n\n")
            f.write("| subgroups | plan time | per subgroup | predicted total / bound |\n|---|---|---|---|\n")
            for n, s, ratio in rows:
                f.write(f"| {n} | {s * 1e3:.2f} ms | {s / n * 1e6:.2f} us | {ratio:.5f} |\n")
            last = rows[-1]
            f.write(f"\n{last[0]} subgroups (the most memtide accepts) plan in {last[1]:.2f} s: "
                    f"{'under' if last[1] < 1 else 'NOT under'} the 1 s target.\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
