#!/usr/bin/env python3
"""The NVMe tier, side by side in one run on the same folder:

1. NvmeStore's sequential write and read rates against fio's: fio with io_uring, direct I/O,
   1 MiB blocks, queue depth 32 (what NvmeStore uses). Target: at least 90% of fio.
2. An update phase with half the subgroups spilled (UpdateEngine with a host budget, CPU
   policy, real io_uring and the real CPU kernel, wall clock) against the predicted
   max(I/O time, CPU time): I/O time from NvmeStore's rates in this run (every spilled subgroup
   read and written back once), CPU time from the same phase with nothing spilled. Target:
   within 15%. The PerfModel's own prediction (its pipeline walk, with fill and drain) is shown
   beside it.

    python bench/python/bench_nvme.py DIR [--size 1GiB] [--rounds 3] [--params 32M] [--sweep] [--out bench/results/nvme/DATE-MACHINE.md]

--sweep adds NvmeStore's rates over queue depth x request size (the defaults' measurement).

fio is for this benchmark only (apt-get install fio). Each round runs fio write, fio read,
then NvmeStore write and read (memtide._memtide.nvme_probe); the best of the rounds is kept for
each, since a shared or virtual disk is noisy. The update phases run in --steps rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date

import memtide
from memtide import _memtide


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


class Phases:
    """CPU-policy update phases of an UpdateEngine over `n` params in subgroups of `per`, with
    `budget` bytes of host memory (None: no NVMe tier). One warm-up phase at construction."""

    def __init__(self, folder: str, n: int, per: int, budget: int | None) -> None:
        import torch

        self.subgroups = [(s, min(n, s + per)) for s in range(0, n, per)]
        tier = {} if budget is None else dict(nvme_dir=folder, host_budget=budget)
        self.engine = _memtide.UpdateEngine(n, self.subgroups, low_precision_bytes=4, **tier)
        params, _, _, grads = (torch.from_dlpack(a) for a in self.engine.arrays())
        g = torch.Generator().manual_seed(0)
        grads.copy_(torch.randn(n, generator=g))
        if budget is None:
            params.copy_(torch.randn(n, generator=g))
        else:
            self.engine.spill_host(n)
        self.steps = 0
        self.run()

    def run(self):
        """Wall-clock seconds of one phase, and its report."""
        self.steps += 1
        segments = [(i, a, b, 1e-3, 0.9, 0.999, 1e-8, 0.01, self.steps) for i, (a, b) in enumerate(self.subgroups)]
        t0 = time.perf_counter()
        r = self.engine.step("c" * len(self.subgroups), 0, 0.0, segments, grads_finite=True)
        return time.perf_counter() - t0, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--size", type=int, default=1 << 30, help="bytes per pass (default 1 GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--params", type=_memtide.parse_bytes, default=32 << 20,
                    help="params of the update phase (default 32Mi; K/M/G suffixes)")
    ap.add_argument("--subgroup", type=_memtide.parse_bytes, default=2 << 20, help="params per subgroup (default 2Mi)")
    ap.add_argument("--steps", type=int, default=15, help="rounds of update phases (default 15)")
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep NvmeStore's queue depth (4-64) and request size (128 KiB-4 MiB)")
    ap.add_argument("--sweep-size", type=_memtide.parse_bytes, default=256 << 20,
                    help="bytes per sweep probe (default 256MiB)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
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
             f"Command: `python bench/python/bench_nvme.py DIR --size {args.size} --rounds {args.rounds}` on "
             f"{os.cpu_count()} cores, {platform.machine()}, memtide {memtide.__version__}; fio and NvmeStore both "
             "with io_uring, O_DIRECT, 1 MiB requests, queue depth 32, one pass of the size each, best of the rounds.",
             "", "| direction | fio | NvmeStore | NvmeStore / fio |", "|---|---|---|---|"]
    for d in ("write", "read"):
        f, m = best[f"fio {d}"], best[f"memtide {d}"]
        lines.append(f"| {d} | {f / 1e9:.2f} GB/s | {m / 1e9:.2f} GB/s | {m / f * 100:.0f}% |")
    lines += ["", "NvmeStore also checksums every extent (xxHash3) on the way; the target is 90% of fio."]

    # 1b. NvmeStore's queue depth and request size: the defaults are chosen from this sweep.
    if args.sweep:
        print("sweeping queue depth and request size ...", file=sys.stderr, flush=True)
        sweep = {}
        for qd in (4, 8, 16, 32, 64):
            for block in (128 << 10, 256 << 10, 1 << 20, 4 << 20):
                rates = [_memtide.nvme_probe(args.dir, args.sweep_size, queue_depth=qd, block_bytes=block)
                         for _ in range(args.rounds)]
                sweep[(qd, block)] = (statistics.median(r["write_bytes_per_s"] for r in rates),
                                      statistics.median(r["read_bytes_per_s"] for r in rates))
        blocks = sorted({b for _, b in sweep})
        lines += ["", "## Queue depth and request size", "",
                  f"NvmeStore write / read GB/s over {args.sweep_size >> 20} MiB, median of {args.rounds} rounds "
                  "(rows: requests in flight; columns: bytes per request). NvmeConfig's defaults are 32 and 1 MiB.",
                  "", "| queue depth | " + " | ".join(f"{b >> 10} KiB" for b in blocks) + " |",
                  "|---|" + "---|" * len(blocks)]
        for qd in sorted({q for q, _ in sweep}):
            cells = [f"{sweep[(qd, b)][0] / 1e9:.2f} / {sweep[(qd, b)][1] / 1e9:.2f}" for b in blocks]
            lines.append(f"| {qd} | " + " | ".join(cells) + " |")
        best = max(sweep, key=lambda k: sum(sweep[k]))
        lines += ["", f"Best sum of write and read here: queue depth {best[0]}, {best[1] >> 10} KiB requests "
                  f"({sweep[best][0] / 1e9:.2f} / {sweep[best][1] / 1e9:.2f} GB/s); the defaults: "
                  f"{sweep[(32, 1 << 20)][0] / 1e9:.2f} / {sweep[(32, 1 << 20)][1] / 1e9:.2f} GB/s."]

    # 2. The update phase with half (and a quarter) of the subgroups spilled, in the same folder.
    # Rounds alternate an I/O probe of the spilled bytes, the phase with nothing spilled and the
    # phase spilled, and each round's ratio is taken against its own probe: the shared disk's
    # speed drifts between rounds.
    n, per = args.params, args.subgroup
    print(f"update phases: {n} params in subgroups of {per}, {args.steps} rounds", file=sys.stderr, flush=True)
    plain = Phases(args.dir, n, per, None)
    sizes = [b - a for a, b in plain.subgroups]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = []
    for share in (0.5, 0.25):
        budget = 16 * n - int(12 * share * n) + 2 * 12 * per  # their 12 B/param leave; two subgroups of staging
        phases = Phases(args.dir, n, per, budget)
        info = phases.engine.nvme_info()
        spilled = info["spilled_params"]
        rounds = []
        for _ in range(args.steps):
            probe = _memtide.nvme_probe(args.dir, max(12 * spilled, 1 << 20))
            probe_s = 12 * spilled / probe["read_bytes_per_s"] + 12 * spilled / probe["write_bytes_per_s"]
            t0 = time.perf_counter()
            phases.engine.nvme_round_trip()  # the same reads and write-backs, no update between
            io_s = time.perf_counter() - t0
            cpu_s, _ = plain.run()
            spill_s, report = phases.run()
            rounds.append(dict(io=io_s, probe_s=probe_s, cpu=cpu_s, spill=spill_s, probe=probe,
                               vs_probe=spill_s / max(io_s, cpu_s), vs_stream=spill_s / max(probe_s, cpu_s),
                               vs_sum=spill_s / (io_s + cpu_s)))
        mid = sorted(rounds, key=lambda x: x["vs_probe"])[len(rounds) // 2]
        walk = _memtide.plan_update(sizes, "cpu", rates=dict(
            cpu_update_params_per_s=n / mid["cpu"], nvme_read_bytes_per_s=mid["probe"]["read_bytes_per_s"],
            nvme_write_bytes_per_s=mid["probe"]["write_bytes_per_s"]), low_precision_bytes=4, on_nvme=info["on_nvme"])
        rows.append((share, info, spilled, rounds, mid, walk["prediction"]["total_ns"] / 1e9))
        del phases
    lines += ["", "## The update phase with subgroups on NVMe", "",
              f"UpdateEngine over {n} params in subgroups of {per} ({len(sizes)} subgroups), CPU policy, wall clock; "
              "the spilled subgroups' params and moments are read 2 subgroups ahead and written back behind. "
              f"{args.steps} rounds, each: the tier's I/O alone (`nvme_round_trip`: every spilled subgroup read "
              "through staging and written back, in update order, no update between), the phase with nothing "
              "spilled (the CPU time), the phase spilled; and, for reference, NvmeStore streaming the same bytes "
              "as one sequential write and read (`nvme_probe`). Ratios are taken per round (the disk's speed "
              "drifts by tens of percent within seconds) and their medians shown; the seconds are the round with "
              "the median ratio.", "",
              "| spilled | CPU s | I/O s (the tier alone) | predicted max(I/O, CPU) s | measured s | "
              "measured / predicted (median, range) | measured / (I/O + CPU) | one sequential pass s | "
              "measured / max(sequential, CPU) | PerfModel walk at the sequential rates s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for share, info, spilled, rounds, mid, walk_s in rows:
        vs = [x["vs_probe"] for x in rounds]
        lines.append(
            f"| {info['spilled']} of {len(sizes)} ({12 * spilled / 1e6:.0f} MB) | {mid['cpu']:.3f} | {mid['io']:.3f} | "
            f"{max(mid['io'], mid['cpu']):.3f} | {mid['spill']:.3f} | "
            f"**{median(vs) * 100:.0f}%** ({min(vs) * 100:.0f}-{max(vs) * 100:.0f}%) | "
            f"{median([x['vs_sum'] for x in rounds]) * 100:.0f}% | {mid['probe_s']:.3f} | "
            f"{median([x['vs_stream'] for x in rounds]) * 100:.0f}% | {walk_s:.3f} |")
    lines += ["", "Target: the half-spilled phase within 15% of max(I/O time, CPU time). The tier's own I/O "
              "(extents of one subgroup, reads and write-backs interleaved) is slower on this disk than one long "
              "sequential pass of the same bytes; the last columns show the phase against that pass too."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
