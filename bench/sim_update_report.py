"""Turns memtide_sim_update's CSV into the Markdown kept in bench/results/ and, when matplotlib
is importable, a plot of update time against the stride k.

Usage: python bench/sim_update_report.py CSV OUT.md [--png OUT.png] [--command CMD]
       [--extra-csv CSV --extra-label TEXT]
"""
import argparse
import csv
from collections import defaultdict
from datetime import date

TARGET_VS_CPU = 1.6
TARGET_VS_STATIC = 1.7


def load(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def summarize(rows):
    """Per model: cpu time, static20 time, best interleaved (host grads) k and time."""
    out = {}
    for r in rows:
        m = out.setdefault(r["model"], {"params": float(r["params"]), "sweep": {}, "sweep_gpu": {}})
        t = float(r["update_s"])
        if r["policy"] == "cpu":
            m["cpu"] = t
        elif r["policy"] == "static20":
            m["static"] = t
        elif r["grads"] == "host":
            m["sweep"][float(r["k"])] = t
            busy = {x: float(r[f"{x}_busy_s"]) for x in ("cpu", "gpu", "h2d", "d2h")}
            m.setdefault("busiest", {})[float(r["k"])] = max(busy.items(), key=lambda kv: kv[1])
        else:
            m["sweep_gpu"][float(r["k"])] = t
    for m in out.values():
        m["best_k"], m["best"] = min(m["sweep"].items(), key=lambda kv: kv[1])
        m["best_k_gpu"], m["best_gpu"] = min(m["sweep_gpu"].items(), key=lambda kv: kv[1])
    return out


def table(summary):
    lines = ["| model | all-CPU (s) | static 20% (s) | best k | interleaved (s) | G params/s | vs CPU | vs static 20% | "
             "busiest resource at best k (busy s, share of phase) | best k, grads kept on GPU | time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in summary.items():
        bn, bt = m["busiest"][m["best_k"]]
        lines.append(f"| {name} | {m['cpu']:.3f} | {m['static']:.3f} | {m['best_k']:g} | {m['best']:.3f} | "
                     f"{m['params'] / m['best'] / 1e9:.1f} | {m['cpu'] / m['best']:.2f}x | "
                     f"{m['static'] / m['best']:.2f}x | {bn} {bt:.3f} ({bt / m['best']:.0%}) | "
                     f"{m['best_k_gpu']:g} | {m['best_gpu']:.3f} |")
    return "\n".join(lines)


def sweep_table(summary):
    ks = sorted(next(iter(summary.values()))["sweep"])
    lines = ["| model | " + " | ".join(f"k={k:g}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for name, m in summary.items():
        lines.append(f"| {name} | " + " | ".join(f"{m['sweep'][k]:.3f}" for k in ks) + " |")
    return "\n".join(lines)


def verdicts(summary):
    worst_cpu = min(m["cpu"] / m["best"] for m in summary.values())
    worst_static = min(m["static"] / m["best"] for m in summary.values())
    return (f"- interleaved (best k) vs all-CPU >= {TARGET_VS_CPU}x: smallest {worst_cpu:.2f}x -> "
            f"{'met' if worst_cpu >= TARGET_VS_CPU else 'NOT met'}\n"
            f"- interleaved (best k) vs static 20% >= {TARGET_VS_STATIC}x: smallest {worst_static:.2f}x -> "
            f"{'met' if worst_static >= TARGET_VS_STATIC else 'NOT met'}")


def plot(rows, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this environment: no plot was drawn (the CSV has every point)."
    series = defaultdict(list)
    flat = {}
    for r in rows:
        if r["policy"] == "interleaved" and r["grads"] == "host":
            series[r["model"]].append((float(r["k"]), float(r["update_s"])))
        elif r["policy"] in ("cpu", "static20"):
            flat[(r["model"], r["policy"])] = float(r["update_s"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, pts in series.items():
        pts.sort()
        line, = ax.plot([k for k, _ in pts], [t for _, t in pts], marker="o", label=f"{model} interleaved")
        ax.axhline(flat[(model, "cpu")], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("stride k (one subgroup in every k updated on the GPU)")
    ax.set_ylabel("update phase (s)")
    ax.set_title("Simulated update time vs k (dotted: all-CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return f"![update time vs k]({png.split('/')[-1]})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("out")
    ap.add_argument("--png")
    ap.add_argument("--command", default="")
    ap.add_argument("--extra-csv")
    ap.add_argument("--extra-label", default="")
    a = ap.parse_args()
    rows = load(a.csv)
    summary = summarize(rows)
    figure = plot(rows, a.png) if a.png else "(no plot requested)"
    parts = [
        f"# Update-phase simulation: all-CPU vs static 20% vs interleaved over k ({date.today()})",
        "",
        f"Command: `{a.command}`" if a.command else "",
        "",
        "Phantom SimDevice (no data, virtual clock) running the real UpdateScheduler with the Deep Optimizer "
        "States H100 node per GPU: PCIe 55 GB/s each way (pinned), GPU AdamW 25 G params/s, CPU AdamW "
        "2 G params/s (the 192-thread host's ~8 G params/s shared by 4 GPUs), host DRAM 220 GB/s, "
        "100M-parameter subgroups, 4 GPU slots, bf16 model parameters. Each GPU updates its ZeRO-3 shard "
        "(a quarter of the model); the shards run at once, so throughput = model params / update time. "
        "Unless marked, gradients are on the host (offloaded during backward) and are prefetched with "
        "the state (16 B/param H2D, 12 B/param D2H for a GPU-updated subgroup). Static 20% = TwinFlow "
        "with the last 20% of subgroups resident on the GPU. The second run of each configuration is "
        "reported (the first moves static residents in).",
        "",
        table(summary),
        "",
        "Targets:",
        "",
        verdicts(summary),
        "",
        "Update time (s) over the k sweep, gradients on the host:",
        "",
        sweep_table(summary),
        "",
        figure,
        "",
    ]
    if a.extra_csv:
        extra = summarize(load(a.extra_csv))
        parts += [f"## Sensitivity: {a.extra_label}", "", table(extra), "", verdicts(extra), ""]
    parts += [
        "## Reading",
        "",
        "- The busiest-resource column is the schedule's yardstick: a phase cannot be shorter than "
        "its busiest resource's busy time, so a share near 100% means the scheduler leaves little on "
        "the table for that placement. At k = 2 (the paper's choice for its own rates) the CPU is the "
        "bottleneck; the best k sends well over half of the subgroups to the GPU (a 1 : k pattern, as "
        "the design notes predict from counting bytes).",
        "- Keeping the gradients of GPU-updated subgroups on the GPU (paper 4.1) cuts their prefetch "
        "to 12 B/param: compare the last two columns with the best host-gradient time.",
        "- In the sensitivity run the CPU is the busiest resource because its update shares the "
        "narrower DRAM with DMA: the contention term the paper's Eq. 1 lacks.",
        "- The planner's (PerfModel) choice is not in this table yet; the plan-vs-best-k check is added "
        "when PerfModel lands.",
        "",
        "Simulated time only: this is what the scheduler does under the model's rates, not a GPU measurement.",
    ]
    with open(a.out, "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
