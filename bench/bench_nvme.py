#!/usr/bin/env python3
"""NvmeStore's sequential write and read rates against fio's, side by side in one run on the same
folder: fio with io_uring, direct I/O, 1 MiB blocks, queue depth 32 (what NvmeStore uses).

    python bench/bench_nvme.py DIR [--size 1GiB] [--rounds 3] [--out results.md]

fio is for this benchmark only (apt-get install fio). Each round runs fio write, fio read,
then NvmeStore write and read (memtide._memtide.nvme_probe); the best of the rounds is kept for
each, since a shared or virtual disk is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import date

import memtide


def fio(folder: str, rw: str, size: int) -> float:
    """fio's bandwidth in bytes/s for one sequential pass."""
    with tempfile.TemporaryDirectory(dir=folder) as d:
        cmd = ["fio", "--name=memtide", f"--directory={d}", f"--rw={rw}", "--ioengine=io_uring", "--direct=1",
               "--bs=1M", "--iodepth=32", f"--size={size}", "--numjobs=1", "--output-format=json"]
        if rw == "read":  # lay the file down first, outside the timed pass
            subprocess.run(cmd[:4] + ["--rw=write"] + cmd[5:], check=True, capture_output=True)
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return (job["write"] if rw == "write" else job["read"])["bw_bytes"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--size", type=int, default=1 << 30, help="bytes per pass (default 1 GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        print("bench_nvme: fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    best = {"fio write": 0.0, "fio read": 0.0, "memtide write": 0.0, "memtide read": 0.0}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        best["fio write"] = max(best["fio write"], fio(args.dir, "write", args.size))
        best["fio read"] = max(best["fio read"], fio(args.dir, "read", args.size))
        p = memtide._memtide.nvme_probe(args.dir, args.size)
        best["memtide write"] = max(best["memtide write"], p["write_bytes_per_s"])
        best["memtide read"] = max(best["memtide read"], p["read_bytes_per_s"])
    lines = [f"# NvmeStore against fio ({date.today()})", "",
             f"Command: `python bench/bench_nvme.py {args.dir} --size {args.size} --rounds {args.rounds}` on "
             f"{os.cpu_count()} cores, {platform.machine()}, memtide {memtide.__version__}; fio and NvmeStore both "
             "with io_uring, O_DIRECT, 1 MiB requests, queue depth 32, one pass of the size each, best of the rounds.",
             "", "| direction | fio | NvmeStore | NvmeStore / fio |", "|---|---|---|---|"]
    for d in ("write", "read"):
        f, m = best[f"fio {d}"], best[f"memtide {d}"]
        lines.append(f"| {d} | {f / 1e9:.2f} GB/s | {m / 1e9:.2f} GB/s | {m / f * 100:.0f}% |")
    lines += ["", "NvmeStore also checksums every extent (xxHash3) on the way; the target is 90% of fio."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
