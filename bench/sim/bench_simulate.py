#!/usr/bin/env python3
"""Whole iterations on the simulated 4 x H100 node: the paper's Table 2 models under ZeRO-3 with
the optimizer offloaded, TwinFlow (20% static on the GPU) and memtide, and the 20B model's
sensitivity to the data-parallel degree and the CPU update rate.

    python bench/sim/bench_simulate.py --out bench/results/sim-iterations/DATE.md [--png bench/results/sim-iterations/DATE.png]

Every number comes from memtide.simulate_iteration (the real allocator, phase tracker, gradient
path, planner and scheduler on a phantom SimDevice; docs/simulator.md has the assumptions). The
plot (matplotlib, when importable) stacks forward, backward and update per contender and model,
as the paper's Figure 7 does.
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
from plotting import pyplot  # noqa: E402

CONTENDERS = ("zero3_offload", "twinflow", "memtide")
LABEL = {"zero3_offload": "ZeRO-3 offload", "twinflow": "TwinFlow 20%", "memtide": "memtide auto"}
GiB = 2**30


def run(model: str, node: dict | None = None) -> dict:
    out = {}
    for c in CONTENDERS:
        out[c] = memtide.simulate_iteration(model=model, contender=c, node=node)
    return out


def split(r: dict) -> tuple[float, float, float]:
    """memtide over ZeRO-3, what memtide's backward alone gives, and what its update adds."""
    z, m = r["zero3_offload"]["simulated"], r["memtide"]["simulated"]
    after_backward = z["iteration_s"] - z["backward_s"] + m["backward_s"]
    return z["iteration_s"] / m["iteration_s"], z["iteration_s"] / after_backward, after_backward / m["iteration_s"] - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Markdown results file")
    ap.add_argument("--png", help="stacked-bar plot of the phases (needs matplotlib)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    defaults = memtide.simulation_defaults()
    models = [m["name"] for m in defaults["models"]]
    results = {}
    for name in models:
        print(f"simulating {name}...", file=sys.stderr, flush=True)
        results[name] = run(name)

    lines = [f"# Whole iterations on the simulated 4 x H100 node ({date.today()})", ""]
    cmd = f"python bench/sim/bench_simulate.py --out {args.out}" + (f" --png {args.png}" if args.png else "")
    lines += [f"Command: `{cmd}` on {os.cpu_count()} cores, {platform.machine()}, memtide {memtide.__version__}. "
              "Each contender runs 3 iterations of one ZeRO-3 rank (micro-batch 1, sequence 2048, activation "
              "checkpointing, 100M-parameter subgroups) on a phantom SimDevice; the last is reported. Node: "
              f"{defaults['gpus']:.0f} GPUs of {defaults['capacity_bytes'] / GiB:.0f} GiB, "
              f"{defaults['gpu_flops'] / 1e12:.0f} TFLOP/s achieved by the model's kernels, collectives at "
              f"{defaults['link_bytes_per_s'] / 1e9:.0f} GB/s, PCIe {defaults['h2d_bytes_per_s'] / 1e9:.0f} GB/s each "
              f"way, CPU update {defaults['cpu_update_params_per_s'] / 1e9:.0f} G params/s and GPU update "
              f"{defaults['gpu_update_params_per_s'] / 1e9:.0f} G params/s per GPU, ZeRO-3's pageable gradient flush "
              f"{defaults['pageable_flush_bytes_per_s'] / 1e9:.1f} GB/s (docs/simulator.md).", ""]
    lines += ["## Iteration time per phase (s) and speed-up", "",
              "| model | contender | forward | backward | update | iteration | predicted | speed-up vs ZeRO-3 | "
              "update / bound | peak allocated fwd / bwd / upd (GiB, of 80) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name in models:
        z = results[name]["zero3_offload"]["simulated"]["iteration_s"]
        for c in CONTENDERS:
            r = results[name][c]
            s = r["simulated"]
            bound = r["update_bound_s"] / s["update_s"] * 100
            peaks = " / ".join(f"{r['peak_bytes'][p] / GiB:.1f}" for p in ("forward", "backward", "update"))
            lines.append(f"| {name} | {LABEL[c]} | {s['forward_s']:.2f} | {s['backward_s']:.2f} | {s['update_s']:.2f} | "
                         f"{s['iteration_s']:.2f} | {r['predicted']['iteration_s']:.2f} | {z / s['iteration_s']:.2f}x | "
                         f"{bound:.0f}% | {peaks} |")
    lines += ["", "## memtide over ZeRO-3 offload, next to the paper", "",
              "| model | memtide / ZeRO-3 | from the backward pass | then the update adds | memtide / TwinFlow | "
              "memtide update / its bound |", "|---|---|---|---|---|---|"]
    for name in models:
        total, bwd, upd = split(results[name])
        tw = results[name]["twinflow"]["simulated"]["iteration_s"] / results[name]["memtide"]["simulated"]["iteration_s"]
        mt = results[name]["memtide"]
        lines.append(f"| {name} | {total:.2f}x | {bwd:.2f}x | +{upd * 100:.0f}% | {tw:.2f}x | "
                     f"{mt['update_bound_s'] / mt['simulated']['update_s'] * 100:.0f}% |")
    lines += ["| paper (Figure 7) | 2x to 2.5x | 1.9x (20B) | +60% (20B) | 1.7x to 2.3x (Figure 12) | - |", ""]

    sens = []
    for gpus in (1, 2, 4, 8):
        print(f"simulating 20B on {gpus} GPUs...", file=sys.stderr, flush=True)
        sens.append((f"{gpus} GPU{'s' if gpus > 1 else ''} per node", run("20B", {"gpus": gpus})))
    for factor, label in ((0.5, "half the CPU update rate"), (2.0, "double the CPU update rate")):
        sens.append((label, run("20B", {"cpu_update_params_per_s": defaults["cpu_update_params_per_s"] * factor})))
    lines += ["## Sensitivity: the 20B model", "",
              "| setting | ZeRO-3 (s) | TwinFlow (s) | memtide (s) | memtide / ZeRO-3 | memtide plan |",
              "|---|---|---|---|---|---|"]
    for label, r in sens:
        plan = r["memtide"]["plan"]
        lines.append(f"| {label} | {r['zero3_offload']['simulated']['iteration_s']:.2f} | "
                     f"{r['twinflow']['simulated']['iteration_s']:.2f} | {r['memtide']['simulated']['iteration_s']:.2f} | "
                     f"{split(r)[0]:.2f}x | {plan['static_residents']} resident, {plan['gpu_streamed']} streamed "
                     f"(k {plan['k']:.2f}) of {len(plan['placement'])} |")
    lines += ["", "The paper's Figure 17 reaches 4.4x at lower data-parallel degrees: fewer GPUs per node means "
              "a larger shard per rank, so more optimizer state per GPU to flush and update.", ""]
    lines += [f"All simulations together took {time.perf_counter() - t0:.1f} s of wall time here.", ""]

    plt = pyplot() if args.png else None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width, x = 0.27, 0
        ticks, names = [], []
        colors = {"forward_s": "#4c72b0", "backward_s": "#dd8452", "update_s": "#55a868"}
        for name in models:
            for i, c in enumerate(CONTENDERS):
                s = results[name][c]["simulated"]
                bottom = 0.0
                for key in ("forward_s", "backward_s", "update_s"):
                    ax.bar(x + i * width, s[key], width * 0.95, bottom=bottom, color=colors[key],
                           label=key[:-2] if name == models[0] and i == 0 else None,
                           hatch={"zero3_offload": "", "twinflow": "//", "memtide": ".."}[c], edgecolor="white")
                    bottom += s[key]
            ticks.append(x + width)
            names.append(name)
            x += 1
        ax.set_xticks(ticks, names)
        ax.set_ylabel("iteration time (s), one rank")
        ax.set_title("Simulated iteration per phase: ZeRO-3 offload (plain), TwinFlow 20% (//), memtide (..)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        lines.append(f"![phases per model and contender]({os.path.basename(args.png)})")
        lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
