"""How long `memtide simulate` itself takes (wall time on this machine, not simulated time) as the
subgroups get smaller and more numerous: the simulator's own cost per subgroup.

    python bench/sim/bench_sim_runtime.py --out bench/results/sim-runtime/<date>-<machine>.md
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

SIZES = (20_000, 10_000, 5_000, 2_500, 1_000)
MODEL = ["--model", "custom", "--layers", "8", "--hidden", "1024", "--heads", "8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the Markdown report here (default: print it)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    rows = []
    for size in SIZES:
        cmd = [sys.executable, "-m", "memtide.cli", "simulate", *MODEL, "--subgroup-size", str(size)]
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            best = min(best, time.perf_counter() - t0)
        print(f"subgroup size {size:>6}: {best:.2f} s", file=sys.stderr)
        rows.append((size, best))
    shard = (8 * (12 * 1024 * 1024 + 13 * 1024) + 50304 * 1024) / 4
    lines = ["# memtide simulate: its own run time against the subgroup count", "",
             "Command: `python bench/sim/bench_sim_runtime.py` (each row: `memtide simulate " + " ".join(MODEL) +
             " --subgroup-size N`, whole process, best of " + str(args.repeats) + ")", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()}; no GPU (simulated time does "
             "not depend on it, this wall time does)", "",
             "| subgroup size | subgroups per rank | wall s |", "|---:|---:|---:|"]
    lines += [f"| {size:,} | {int(-(-shard // size)):,} | {t:.2f} |" for size, t in rows]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
