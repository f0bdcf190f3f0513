"""A checkpoint save beside training on the simulated device (memtide simulate --save-checkpoint):
the paper's 20B model on its 4 x H100 node, each rank saving its optimizer state (12 B/param of
its shard) while the iterations go on, against the disk rate and the copy-on-write buffer; and the
time a save that stops training (torch.save, DeepSpeed) would stop it.

    python bench/sim/bench_save.py --out bench/results/sim-save/<date>.md

Simulated time: only the wall time depends on this machine. docs/simulator.md ("A checkpoint save
beside training") says what is simulated and what is modelled.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model, write_report  # noqa: E402

import memtide  # noqa: E402

GIB = 1 << 30
RATES = [1e9, 2e9, 4e9, 8e9]  # bytes/s per rank: 2e9 is the paper's node (two 4 GB/s drives, four ranks)
BUFFERS = [0, 8 * GIB, 16 * GIB, 32 * GIB]  # 0: two subgroups (2.2 GiB)


def row(model: str, rate: float, buffer: int, node: dict) -> str:
    r = memtide.simulate_iteration(model=model, contender="memtide", node=node, save=True,
                                   save_write_bytes_per_s=rate, save_buffer_bytes=buffer)
    s, alone = r["save"], r["simulated"]["iteration_s"]
    its = s["iteration_s"]
    lost = sum(its) - alone * len(its)
    blocking = s["state_bytes"] / rate
    return (f"| {rate / 1e9:.0f} | {s['buffer_bound_bytes'] / GIB:.1f} | {s['save_s']:.1f} | {len(its)} | "
            f"{alone:.2f} | {max(its):.2f} | {sorted(its)[len(its) // 2]:.2f} | {sum(s['waited_s']):.1f} | "
            f"{lost:.1f} | {blocking:.1f} | {s['copied_bytes'] / GIB:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the Markdown report")
    args = ap.parse_args()
    t0 = time.monotonic()
    lines = ["# A checkpoint save beside training, simulated (memtide simulate --save-checkpoint)", "",
             "Command: `python bench/sim/bench_save.py --out " + args.out + "`", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()}; simulated time (only the "
             "wall time below depends on this machine).", "",
             "One rank of the paper's 20B model on its 4 x H100 node (ZeRO-3, memtide's plan): after a "
             "reported iteration the rank asks for a save of its optimizer state, and iterations run "
             "beside it until it is written. The engine's real steps protect every subgroup before they "
             "change it (copy into the buffer, or wait for the writer); the writer is modelled at the "
             "stated rate. 'lost' is the iterations' time beside the save less as many iterations "
             "without it; 'blocking' is the time a save that stops training would stop it at the same "
             "rate.", ""]
    header = ["| write GB/s per rank | buffer GiB | save s | iterations beside | alone s | slowest s | "
              "median s | steps waited s | lost s | blocking s | copied GiB |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for title, node in (("All of each rank's state in host memory", {}),
                        ("Half of each rank's state spilled to NVMe (`--host-mem 32GiB`)", {"host_budget_bytes": 32 * GIB})):
        lines += [f"## {title}", "", "### Against the disk rate (default buffer: two subgroups)", ""] + header
        lines += [row("20B", rate, 0, node) for rate in RATES]
        lines += ["", "### Against the buffer (2 GB/s per rank: the paper's node)", ""] + header
        lines += [row("20B", 2e9, b, node) for b in BUFFERS] + [""]
    lines += ["## Reading", "",
              "- The first update phase after the ask rewrites every subgroup the CPU updates, so it "
              "cannot pass a subgroup the writer has not reached unless it copies it: the steps wait "
              "for about (state - buffer - what the writer wrote during forward and backward) / rate, "
              "once. The iterations after it run at their own pace while the writer finishes.",
              "- GPU-resident subgroups cost the steps nothing: their host state is not written while "
              "they stay on the GPU.",
              "- So the buffer is the lever: host memory for copies against time the steps wait.",
              "- With half the state on NVMe the iterations are paced by the spill's reads and writes, and "
              "the save's waits mostly fall inside those. Modelled, not simulated: the save's writes go to "
              "a disk of their own at the stated rate, and the writer's reads of spilled subgroups from the "
              "spill file are not counted; on the same drives the spill's traffic and the save's share "
              "them, and both slow.", "",
              f"Whole report: {time.monotonic() - t0:.1f} s of wall time.", ""]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
