#!/usr/bin/env python3
"""The layer window in the iteration simulator (STRONGHOLD on one simulated GPU):

1. the largest GPT model (8192 hidden, 64 heads, sequence 2048, more and more layers) whose
   iteration runs on a GPU capped at 32 GiB and at 80 GiB, with the window (size auto) and without;
2. iteration time against window size for the 40B shape at sequence 512 (copies no longer hidden
   behind compute), with the size auto chooses marked.

    python bench/sim/bench_window.py --out bench/results/sim-window/DATE.md [--png bench/results/sim-window/DATE.png]

Every number comes from memtide.simulate_iteration (memtide's contender: the real allocator, phase
tracker, gradient path, planner and scheduler on a phantom SimDevice, the window's copies on the
H2D engine; docs/layer_window.md). One rank, one GPU (ZeRO-3 over 1 GPU), as STRONGHOLD runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import date

import memtide
# What the bench scripts share lies one folder up, in bench/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plotting import pyplot, write_report  # noqa: E402

GiB = 2**30
SHAPE = dict(hidden=8192, heads=64)
SWEEP_SEQS = (2048, 512)  # compute covers each block's copy; then it does not
LAYER_CAP = 1024  # the search stops here (825B params); the host would need ~15 TB for its state


def fits(layers: int, capacity: int, window) -> dict | None:
    node = {"gpus": 1, "capacity_bytes": capacity}
    try:
        return memtide.simulate_iteration(shape=dict(SHAPE, layers=layers), node=node, window=window, iterations=2)
    except MemoryError:
        return None


def largest(capacity: int, window) -> tuple[int, dict]:
    """The most layers that fit (doubling, then bisection), and that iteration."""
    lo, best = 0, None
    hi = 1
    while hi <= LAYER_CAP:
        r = fits(hi, capacity, window)
        if r is None:
            break
        lo, best = hi, r
        hi *= 2
    hi = min(hi, LAYER_CAP + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = fits(mid, capacity, window)
        if r is None:
            hi = mid
        else:
            lo, best = mid, r
    return lo, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Markdown results file")
    ap.add_argument("--png", help="plot of iteration time against window size (needs matplotlib)")
    args = ap.parse_args()
    t0 = time.perf_counter()

    rows = []
    for cap_gib in (32, 80):
        for window in (None, "auto"):
            print(f"largest model on {cap_gib} GiB, window {window}...", file=sys.stderr, flush=True)
            layers, r = largest(cap_gib * GiB, window)
            rows.append((cap_gib, window, layers, r))

    node = {"gpus": 1, "capacity_bytes": 32 * GiB}
    sweeps = {}  # sequence -> ([(m, result or None)], auto's result)
    for seq in SWEEP_SEQS:
        shape = dict(SHAPE, layers=48, seq=seq)
        sweep = []
        for m in list(range(1, 13)) + [14, 16, 20]:
            print(f"seq {seq}, window {m}...", file=sys.stderr, flush=True)
            try:
                sweep.append((m, memtide.simulate_iteration(shape=shape, node=node, window=m)))
            except MemoryError:
                sweep.append((m, None))
        sweeps[seq] = (sweep, memtide.simulate_iteration(shape=shape, node=node, window="auto"))

    lines = [f"# The layer window in the iteration simulator ({date.today()})", ""]
    cmd = f"python bench/sim/bench_window.py --out {args.out}" + (f" --png {args.png}" if args.png else "")
    lines += [f"Command: `{cmd}` on {os.cpu_count()} cores, {platform.machine()}, memtide {memtide.__version__}; "
              f"{time.perf_counter() - t0:.0f} s. One simulated H100 (ZeRO-3 over one GPU, as STRONGHOLD runs), "
              "memtide's contender, activation checkpointing on, micro-batch 1.", ""]
    lines += ["## Largest model that trains on a capped GPU", "",
              f"GPT shape: hidden {SHAPE['hidden']}, {SHAPE['heads']} heads, sequence 2048, layers searched "
              f"(doubling, then bisection; at most {LAYER_CAP}). Without the window the rank's fp16 parameters "
              "live on the GPU for good; with it (size auto) only the window's buffers do, and the rest waits in "
              "host memory. The host then holds 18 B per parameter (fp32 master, two moments, gradient, and "
              "the fp16 home copy): the column says how much, since past the GPU that is the limit (or the "
              "NVMe tier's, `--host-mem`).", "",
              "| GPU memory | window | layers | params | iteration | window chosen | peak (fwd / bwd / update) | "
              "host state |", "|---|---|---|---|---|---|---|---|"]
    base = {}
    for cap, window, layers, r in rows:
        if r is None:
            lines.append(f"| {cap} GiB | {window or 'none'} | none fits | | | | | |")
            continue
        params = r["params"]
        if window is None:
            base[cap] = params
        ratio = f" ({params / base[cap]:.1f}x)" if window and cap in base else ""
        capped = " (search cap)" if layers >= LAYER_CAP else ""
        peaks = " / ".join(f"{r['peak_bytes'][p] / GiB:.1f}" for p in ("forward", "backward", "update"))
        lines.append(f"| {cap} GiB | {window or 'none'} | {layers}{capped} | {params / 1e9:.1f}B{ratio} | "
                     f"{r['simulated']['iteration_s']:.1f} s | {r['window'] or '-'} | {peaks} GiB | "
                     f"{18 * params / 1e12:.2f} TB |")
    lines += ["", "## Iteration time against window size", "",
              "The 40B shape (48 layers) on 32 GiB. A block's shard comes in as 1.5 GiB of fp16 at 55 GB/s "
              "(29 ms), and its gradients leave as fp32 from the gradient path (58 ms, on the other direction "
              "of PCIe).", "",
              "- **Sequence 2048**: a block's forward (34 ms of compute) covers its copy in, and its backward "
              "(103 ms with the recomputation) covers both directions: STRONGHOLD's plateau starts at one block, "
              "so forward is flat from m = 1 and the knee is 1. A larger window only leaves less device memory "
              "to the rest of the iteration: the allocator more and more often finds no cached block of the "
              "size asked, releases its cache and retries, waiting for the GPU each time (the last column), and "
              "backward grows with it; so does the update phase, with fewer GPU subgroups.",
              "- **Sequence 512**: forward (8.6 ms per block) is shorter than the copy in and backward (26 ms) "
              "shorter than the gradients going out: the link bounds every window size. Forward gains the "
              "resident blocks' copies (29 ms each) but the same memory costs more elsewhere.", ""]
    for seq, (sweep, auto) in sweeps.items():
        lines += [f"### Sequence {seq}", "",
                  "| window | forward | backward | update | iteration | peak backward | H2D per iteration | "
                  "allocator retries |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, r in sweep:
            if r is None:
                lines.append(f"| {m} | out of memory | | | | | | |")
                continue
            s = r["simulated"]
            lines.append(f"| {m} | {s['forward_s']:.3f} s | {s['backward_s']:.3f} s | {s['update_s']:.3f} s | "
                         f"{s['iteration_s']:.3f} s | {r['peak_bytes']['backward'] / GiB:.1f} GiB | "
                         f"{r['window_h2d_bytes'] / GiB:.0f} GiB | {r['alloc_retries']} |")
        lines += ["", f"auto chose **{auto['window']}** ({auto['window_why']}); its iteration: "
                  f"{auto['simulated']['iteration_s']:.3f} s.", ""]

    plt = pyplot() if args.png else None
    if plt is not None:
        fig, axes = plt.subplots(1, len(sweeps), figsize=(12, 4))
        for ax, (seq, (sweep, auto)) in zip(axes, sweeps.items()):
            ok = [(m, r) for m, r in sweep if r is not None]
            ms = [m for m, _ in ok]
            ax.plot(ms, [r["simulated"]["iteration_s"] for _, r in ok], "o-", label="iteration")
            ax.plot(ms, [r["simulated"]["forward_s"] for _, r in ok], "s--", label="forward")
            ax.plot(ms, [r["simulated"]["backward_s"] for _, r in ok], "^--", label="backward")
            ax.axvline(auto["window"], color="gray", linestyle=":", label=f"auto: {auto['window']}")
            ax.set_xlabel("window (blocks on the GPU)")
            ax.set_ylabel("seconds")
            ax.set_ylim(bottom=0)
            ax.set_title(f"40B shape, seq {seq}, one simulated H100 at 32 GiB")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        lines.append(f"![iteration time against window size]({os.path.basename(args.png)})")
        lines.append("")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
