#!/usr/bin/env python3
"""CPU updates during backward (STRONGHOLD 3-E) in the iteration simulator: the paper's 20B model
on the simulated 4 x H100 node (and with A100 figures), memtide's update phase only against
updates of the CPU subgroups begun while backward goes on (speculative, with the saved copy that
clipping and loss scaling need, and without it).

    python bench/sim/bench_backward_updates.py --out bench/results/sim-backward-updates/DATE.md [--png bench/results/sim-backward-updates/DATE.png]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import date

import memtide
from memtide.cli.sim.inputs import SIM_GPUS
# What the bench scripts share lies one folder up, in bench/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plotting import pyplot, write_report  # noqa: E402

GPUS = {name: SIM_GPUS[name] for name in ("h100", "a100")}  # memtide simulate --gpu's figures
VARIANTS = (("update phase only", {}),
            ("during backward, speculative copy", {"updates_during_backward": 1}),
            ("during backward, no copy needed", {"updates_during_backward": 1, "speculative_backup": 0}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--png")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for gpu, node in GPUS.items():
        for label, extra in VARIANTS:
            print(f"{gpu}: {label}...", file=sys.stderr, flush=True)
            r = memtide.simulate_iteration(model="20B", node=dict(node, **extra))
            rows.append((gpu, label, r))
    lines = [f"# CPU updates during backward, 20B on the simulated 4-GPU node ({date.today()})", "",
             f"Command: `python bench/sim/bench_backward_updates.py --out {args.out}"
             + (f" --png {args.png}" if args.png else "") + f"` on {os.cpu_count()} cores, {platform.machine()}, "
             f"memtide {memtide.__version__}; {time.perf_counter() - t0:.0f} s. memtide's contender (policy auto), "
             "3 iterations, the last reported. During backward the host updates the subgroups the plan put on the "
             "CPU as their gradients arrive, in the time it would otherwise wait for the GPU, choosing those it can "
             "finish before backward ends; the update phase does the rest (docs/layer_window.md).", "",
             "| GPU figures | CPU updates | backward | update | iteration | params updated in backward | "
             "host busy then |", "|---|---|---|---|---|---|---|"]
    for gpu, label, r in rows:
        s = r["simulated"]
        lines.append(f"| {gpu} | {label} | {s['backward_s']:.3f} s | {s['update_s']:.3f} s | "
                     f"{s['iteration_s']:.3f} s | {r['backward_update_params'] / 1e6:.0f}M | "
                     f"{r['backward_update_busy_s']:.2f} s |")
    lines.append("")
    for gpu in GPUS:
        base = next(r for g, l, r in rows if g == gpu and l == VARIANTS[0][0])["simulated"]["iteration_s"]
        spec = next(r for g, l, r in rows if g == gpu and l == VARIANTS[1][0])["simulated"]["iteration_s"]
        lines.append(f"- {gpu}: {base:.3f} s -> {spec:.3f} s per iteration ({(base / spec - 1) * 100:+.1f}%).")
    lines.append("")
    plt = pyplot() if args.png else None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 3.6))
        labels = [f"{g}\n{l}" for g, l, _ in rows]
        left = [0.0] * len(rows)
        for phase, color in (("forward_s", "#6a9fd8"), ("backward_s", "#e39c4a"), ("update_s", "#6cb86c")):
            vals = [r["simulated"][phase] for _, _, r in rows]
            ax.barh(labels, vals, left=left, color=color, label=phase[:-2])
            left = [a + b for a, b in zip(left, vals)]
        ax.invert_yaxis()
        ax.set_xlabel("seconds per iteration (20B, simulated)")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        lines += [f"![phases per variant]({os.path.basename(args.png)})", ""]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
