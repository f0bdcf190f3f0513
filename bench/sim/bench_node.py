"""A node of ranks and many nodes on the simulated device (memtide.simulate_node): memtide's NUMA
placement against oblivious ones on an 8-GPU, 2-socket node; the speed-up over ZeRO-3 offload
against the data-parallel degree and the node count, next to the paper's Figure 17; the largest
model one 8-GPU node trains at 1 TB and 2 TB of host memory, with and without NVMe, next to
ZeRO-Infinity's and MegaTrain's published figures.

    python bench/sim/bench_node.py --out bench/results/sim-node/<date>.md

Simulated time: only the wall times depend on this machine. docs/simulator.md ("A node of ranks")
says what is simulated and what is modelled.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model, pyplot, write_report  # noqa: E402

import memtide  # noqa: E402

DGX = "8xh100-2s-switches"
PLACEMENTS = ["memtide", "node0", "interleave", "first_touch"]
TB = 10**12


def placements(lines: List[str], plots: Dict[str, Any]) -> None:
    """8 ranks on two sockets: the node's iteration and each rank's update under every placement."""
    r = memtide.simulate_node(model="40B", host=DGX, placements=PLACEMENTS, contenders=["zero3_offload", "memtide"])
    lines += ["## 8 ranks on a 2-socket node (40B, `--host 8xh100-2s-switches`)", "",
              "The 40B model's state (16 B/param, 78 GB a rank) does not fit beside its parameters and "
              "activations in 80 GB, so every rank's update runs partly through the host: the path the "
              "placement changes.", "",
              "| placement | ZeRO-3 offload s | memtide s | memtide over ZeRO-3 | memtide's update s per rank (GPU 0..7) | "
              "busiest resource of the slowest rank |", "|---|---:|---:|---:|---|---|"]
    rows = {}
    for run in r["runs"]:
        rows.setdefault(run["placement"], {})[run["contender"]] = run
    for name in PLACEMENTS:
        z, m = rows[name]["zero3_offload"], rows[name]["memtide"]
        updates = " ".join(f"{rank['simulated']['update_s']:.2f}" for rank in m["ranks"])
        busiest = m["ranks"][m["slowest_rank"]]["share"]["busiest"]
        lines.append(f"| {name} | {z['iteration_s']:.2f} | {m['iteration_s']:.2f} | "
                     f"{z['iteration_s'] / m['iteration_s']:.2f}x | {updates} | {busiest} |")
    share = rows["memtide"]["memtide"]["ranks"][0]["share"]
    odd = rows["node0"]["memtide"]["ranks"][4]["share"]
    lines += ["", f"Each rank's share under memtide's placement: {share['cores']:.0f} cores, "
              f"{share['cpu_update_params_per_s'] / 1e9:.2f} G params/s CPU update, "
              f"{share['host_dram_bytes_per_s'] / 1e9:.0f} GB/s DRAM, {share['h2d_bytes_per_s'] / 1e9:.1f} GB/s H2D "
              f"(two GPUs a switch uplink); under node0, GPU 4 (socket 1) gets {odd['cores']:.1f} cores' worth, "
              f"{odd['cpu_update_params_per_s'] / 1e9:.2f} G params/s and {odd['h2d_bytes_per_s'] / 1e9:.1f} GB/s H2D "
              f"(busiest: {odd['busiest']}).", ""]
    plots["placements"] = {name: [rank["simulated"]["update_s"] for rank in rows[name]["memtide"]["ranks"]]
                           for name in PLACEMENTS}


def speedup(model: str, gpus: int, nodes: int) -> Tuple[float, Dict[str, Any]]:
    r = memtide.simulate_node(model=model, gpus=gpus, node={"nodes": nodes}, placements=["memtide"],
                              contenders=["zero3_offload", "memtide"])
    t = {run["contender"]: run for run in r["runs"]}
    return t["zero3_offload"]["iteration_s"] / t["memtide"]["iteration_s"], t["memtide"]["ranks"][0]


def scaling(lines: List[str], plots: Dict[str, Any]) -> None:
    models = ["7B", "13B", "20B"]
    lines += ["## Speed-up over ZeRO-3 offload against the data-parallel degree (one node)", "",
              "GPUs on the paper's two sockets, memtide's placement for both contenders, the micro-batch per "
              "GPU fixed (weak scaling, as the paper's Figure 17). The paper measured up to 4.4x at low degrees, "
              "falling towards 2.5x at higher ones.", "",
              "| model | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in (1, 2, 4, 8)) + " |",
              "|---|" + "---:|" * 4]
    plots["dp"] = {}
    for model in models:
        row = [speedup(model, g, 1)[0] for g in (1, 2, 4, 8)]
        plots["dp"][model] = row
        lines.append(f"| {model} | " + " | ".join(f"{x:.2f}x" for x in row) + " |")
    counts = [1, 2, 4, 8, 16, 32, 64, 128]
    lines += ["", "## Against the node count (4 GPUs a node, as the paper's testbed; collectives modelled)", "",
              "| model | " + " | ".join(str(n) for n in counts) + " |", "|---|" + "---:|" * len(counts)]
    plots["nodes"] = {}
    for model in models:
        row, colls = [], []
        for n in counts:
            s, rank = speedup(model, 4, n)
            row.append(s)
            colls.append(rank["collective_s"])
        plots["nodes"][model] = row
        lines.append(f"| {model} | " + " | ".join(f"{x:.2f}x" for x in row) + " |")
    lines += ["", "As nodes are added each rank holds less of the state, so the update phase (where memtide gains "
              "most) shrinks, while the collectives, which both contenders pay, grow with the inter-node rings.", ""]


def shape(hidden: int) -> Dict[str, int]:
    """The Table 2 proportions (hidden / layers = 128, 128-wide heads), scaled."""
    return {"layers": hidden // 128, "hidden": hidden, "heads": hidden // 128}


def trains(hidden: int, host_bytes: int, nvme: bool) -> Optional[Dict[str, Any]]:
    """memtide's iteration of a model of this width on an 8-GPU node with `host_bytes` of host
    memory (and its eight 3.84 TB drives when `nvme`), or None when it does not fit."""
    s = shape(hidden)
    params = s["layers"] * (12 * hidden**2 + 13 * hidden) + 50304 * hidden
    shard = params / 8
    per_rank = 0.9 * host_bytes / 8  # a tenth for the OS, torch and the data loader
    home = 2 * shard  # the layer window keeps the fp16 parameters in host memory
    node = {"host_budget_bytes": int(per_rank - home)} if nvme else {}
    if per_rank - home <= 0:
        return None
    if not nvme and 16 * shard + home > per_rank:
        return None
    if nvme and 12 * shard * 8 > 8 * 3.84 * TB:
        return None
    try:
        r = memtide.simulate_node(shape=s, host=DGX, node=node, window=1, placements=["memtide"],
                                  contenders=["memtide"], iterations=2)
    except (MemoryError, ValueError):
        return None
    run = r["runs"][0]
    return {"params": params, "iteration_s": run["iteration_s"], "update_s": run["ranks"][0]["simulated"]["update_s"]}


def largest(lines: List[str]) -> None:
    lines += ["## The largest model one 8-GPU node trains (memtide, layer window of 1 block)", "",
              "Widths in steps of 512 (layers = hidden / 128), `8xh100-2s-switches`, 90% of the host memory "
              "for training. With NVMe, the spilled subgroups' params and moments live on the eight drives; "
              "gradients (4 B/param) and the window's fp16 parameters (2 B/param) stay in host memory, which "
              "is what caps the model.", "",
              "| host memory | NVMe | largest model | iteration s | update s |", "|---|---|---:|---:|---:|"]
    for host in (1 * TB, 2 * TB):
        for nvme in (False, True):
            lo, hi, best = 2048, 65536, None
            while hi - lo > 512:  # the widest that trains
                mid = (lo + hi) // 2 // 512 * 512
                got = trains(mid, host, nvme)
                if got is None:
                    hi = mid
                else:
                    lo, best = mid, got
            label = f"{host // TB} TB"
            if best is None:
                lines.append(f"| {label} | {'yes' if nvme else 'no'} | none | - | - |")
            else:
                lines.append(f"| {label} | {'8 x 3.84 TB' if nvme else 'no'} | {best['params'] / 1e9:.0f}B "
                             f"(hidden {lo}) | {best['iteration_s']:.1f} | {best['update_s']:.1f} |")
    lines += ["", "Published figures for comparison (their hardware, not simulated here): ZeRO-Infinity "
              "(Rajbhandari et al., SC'21) fine-tunes a trillion parameters on one DGX-2 node (16 x V100 32 GB, "
              "1.5 TB DRAM, NVMe), offloading parameters and gradients to NVMe too; MegaTrain reports 120B on one "
              "H200 with 1.5 TB of host memory. memtide's NVMe tier keeps gradients and the window's fp16 "
              "parameters in host memory, so its host memory, not its drives, sets the largest model.", ""]


def plot(plots: Dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    width = 0.2
    for i, (name, updates) in enumerate(plots["placements"].items()):
        ax.bar([g + (i - 1.5) * width for g in range(len(updates))], updates, width, label=name)
    ax.set_xlabel("GPU (rank)")
    ax.set_ylabel("memtide's update phase, s")
    ax.set_title("40B, 8 ranks on 2 sockets")
    ax.set_ylim(0, 1.35 * max(max(u) for u in plots["placements"].values()))
    ax.legend(ncol=2, fontsize=8, loc="upper left")
    ax = axes[1]
    for model, row in plots["dp"].items():
        ax.plot([1, 2, 4, 8], row, marker="o", label=model)
    ax.axhline(4.4, color="grey", linestyle=":", label="paper: up to 4.4x")
    ax.axhline(2.5, color="grey", linestyle="--", label="paper: 2.5x at higher DP")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (one node)")
    ax.set_ylabel("memtide over ZeRO-3 offload")
    ax.set_title("data-parallel degree")
    ax.legend(fontsize=8)
    ax = axes[2]
    for model, row in plots["nodes"].items():
        ax.plot([1, 2, 4, 8, 16, 32, 64, 128], row, marker="o", label=model)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes of 4 GPUs")
    ax.set_ylabel("memtide over ZeRO-3 offload")
    ax.set_title("node count (collectives modelled)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the Markdown report; the plot goes beside it (.png)")
    args = ap.parse_args()
    t0 = time.monotonic()
    lines = ["# A node of ranks and many nodes (memtide simulate --host/--nodes)", "",
             "Command: `python bench/sim/bench_node.py --out " + args.out + "`", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()}; simulated time (only the "
             "wall time below depends on this machine).", ""]
    plots: Dict[str, Any] = {}
    placements(lines, plots)
    scaling(lines, plots)
    largest(lines)
    start = time.monotonic()
    big = memtide.simulate_node(model="20B", host=DGX, node={"nodes": 128}, placements=["memtide"])
    lines += ["## 128 nodes of 8 GPUs, 20B", "",
              f"`memtide simulate --nodes 128 --gpus-per-node 8 --host {DGX} --model 20B`: node iteration "
              + ", ".join(f"{run['contender']} {run['iteration_s']:.2f} s" for run in big["runs"])
              + f"; collectives {big['runs'][0]['ranks'][0]['collective_s']:.2f} s per iteration; simulated in "
              f"{time.monotonic() - start:.2f} s of wall time.", "",
              f"Whole report: {time.monotonic() - t0:.1f} s of wall time.", ""]
    png = os.path.splitext(args.out)[0] + ".png"
    plot(plots, png)
    if os.path.exists(png):
        lines.insert(6, f"![placements, data-parallel degree, node count]({os.path.basename(png)})\n")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
