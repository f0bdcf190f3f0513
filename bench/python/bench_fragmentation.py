"""Fragmentation of the transformer trace replay with and without expandable segments.

Replays GPT-style training (allocator/transformer_trace.cpp) through a fresh CachingAllocator on
the simulated device, once with MEMTIDE_EXPANDABLE_SEGMENTS=false and once with true, each in its
own process (the options table is read once per process), and reports peak reserved / peak
allocated. Target (issue: expandable segments): <= 1.02 with them on.

    python bench/python/bench_fragmentation.py [--layers 24 --hidden 2048 ...] [--out bench/results/fragmentation/DATE-MACHINE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date

CHILD = """
import json, sys, memtide
shape = json.loads(sys.argv[1])
r = memtide.replay_transformer(backend="sim", sim_capacity=shape.pop("capacity"), **shape)
print(json.dumps({k: r[k] for k in ("peak_allocated", "peak_reserved", "reserved_over_allocated", "ops")}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 24), ("hidden", 2048), ("heads", 16), ("seq", 2048), ("batch", 4),
                          ("vocab", 50304), ("iterations", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--capacity-gib", type=int, default=80, help="simulated device memory (default 80)")
    ap.add_argument("--out", help="Markdown file to write")
    args = ap.parse_args()
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "iterations")}
    for k, v in shape.items():
        if v <= 0:
            ap.error(f"--{k} must be positive")
    shape["capacity"] = args.capacity_gib << 30
    rows = {}
    for on in ("false", "true"):
        env = dict(os.environ, MEMTIDE_EXPANDABLE_SEGMENTS=on, MEMTIDE_DEVICE="sim")
        print(f"replaying with expandable segments {on} ...", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shape)], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr, file=sys.stderr)
            return 1
        rows[on] = json.loads(p.stdout.strip().splitlines()[-1])
    gib = 1 << 30
    lines = [f"# Fragmentation: expandable segments, {date.today().isoformat()}", "",
             f"Command: `python bench/python/bench_fragmentation.py {' '.join(sys.argv[1:])}`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; simulated device of {args.capacity_gib} GiB "
             "(the replay's allocations and frees through memtide's CachingAllocator; no timing involved). "
             f"Model: {shape['layers']} layers, hidden {shape['hidden']}, seq {shape['seq']}, batch {shape['batch']}, "
             f"{shape['iterations']} iterations.", "",
             "| expandable segments | ops | peak allocated (GiB) | peak reserved (GiB) | reserved / allocated |",
             "|---|---|---|---|---|"]
    for on, r in rows.items():
        lines.append(f"| {on} | {r['ops']} | {r['peak_allocated'] / gib:.3f} | {r['peak_reserved'] / gib:.3f} | "
                     f"{r['reserved_over_allocated']:.4f} |")
    ok = rows["true"]["reserved_over_allocated"] <= 1.02
    lines += ["", f"Target reserved / allocated <= 1.02 with expandable segments: {'met' if ok else 'NOT met'}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
