"""Turns `memtide simulate --update-sweep`'s CSV into the Markdown kept in bench/results/ and, when matplotlib
is importable, a plot of update time against the stride k.

Usage: python tools/simulator/sim_update_report.py CSV OUT.md [--png OUT.png] [--command CMD]
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
    """Per model: cpu time, static20 time, the k sweeps (host and GPU gradients) and the
    automatic plan of each gradient placement."""
    out = {}
    for r in rows:
        m = out.setdefault(r["model"], {"params": float(r["params"]), "sweep": {}, "sweep_gpu": {}, "plan": {}})
        t = float(r["update_s"])
        if r["policy"] == "cpu":
            m["cpu"] = t
        elif r["policy"] == "static20":
            m["static"] = t
        elif r["policy"] == "auto":
            m["plan"][r["grads"]] = {"k": float(r["k"]), "simulated": t, "predicted": float(r["predicted_s"]),
                                     "slots": int(r["slots"]), "gpu_fraction": float(r["gpu_fraction"])}
        elif r["grads"] == "host":
            m["sweep"][float(r["k"])] = t
            m.setdefault("predicted", {})[float(r["k"])] = float(r["predicted_s"])
            busy = {x: float(r[f"{x}_busy_s"]) for x in ("cpu", "gpu", "h2d", "d2h")}
            m.setdefault("busiest", {})[float(r["k"])] = max(busy.items(), key=lambda kv: kv[1])
        else:
            m["sweep_gpu"][float(r["k"])] = t
    for m in out.values():
        # Ties go to the smaller k, as the simulator's own summary does.
        m["best_k"], m["best"] = min(m["sweep"].items(), key=lambda kv: (kv[1], kv[0]))
        m["best_k_gpu"], m["best_gpu"] = min(m["sweep_gpu"].items(), key=lambda kv: (kv[1], kv[0]))
    return out


PLAN_TOLERANCE = 0.05
READING_PLAN = (
    "- Plan vs sweep. Plan / best can be below 1: the plan runs with its own 3 slots, the sweep with 4, "
    "and in the simulator a fourth slot can cost time (an earlier prefetch holds the H2D queue ahead of "
    "low-precision uploads). The model under-predicts by a few percent (predicted / simulated < 1): "
    "the simulator's copy engines serve copies in the order the host issued them, so a prefetch that "
    "waits for its slot's flush also holds back the uploads issued after it and, through the two "
    "staging buffers, the CPU; the model's engines serve copies as they become ready (what "
    "independent hardware queues do). The same effect makes the simulator sensitive to where in the "
    "pattern the GPU subgroups fall, which the model barely sees: every miss of the 5% criterion has "
    "the plan at (or next to) the best swept GPU count with a different arrangement, e.g. 10B, "
    "gradients kept on the GPU: plan k = 1.471 and swept k = 1.4 both put 17 of 25 subgroups on the "
    "GPU; the model predicts 0.419 vs 0.418 s, the simulator gives 0.469 vs 0.431 s (see the CSV). "
    "In the 110 GB/s run the 10B miss is the same kind: the model has k = 1.2 (20 of 25 on the GPU) "
    "0.7% behind its plan (0.668 vs 0.673 s), the simulator puts it 6% ahead (0.659 vs 0.702 s), "
    "DRAM sharing being modelled differently (the model gives DMA its bandwidth first). "
    "Modelling the two staging buffers in the walk brings the host-gradient predictions within 1-4% "
    "of the simulator but changes the model's paper-Eq. 1 V100 check (it then prefers k = 1) and "
    "makes more slots sometimes worse, so it is left as an open question for the model rather than "
    "changed here."
)


def plan_table(summary):
    lines = ["| model | grads | plan k | GPU share | slots | predicted (s) | simulated (s) | predicted / simulated | "
             "best swept k | its time (s) | plan / best | within 5% |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in summary.items():
        for grads, sweep_key, best_k, best in (("host", "sweep", m["best_k"], m["best"]),
                                               ("gpu", "sweep_gpu", m["best_k_gpu"], m["best_gpu"])):
            p = m["plan"].get(grads)
            if p is None:
                continue
            ratio = p["simulated"] / best
            lines.append(f"| {name} | {grads} | {p['k']:.4g} | {p['gpu_fraction']:.0%} | {p['slots']} | "
                         f"{p['predicted']:.3f} | {p['simulated']:.3f} | {p['predicted'] / p['simulated']:.3f} | "
                         f"{best_k:g} | {best:.3f} | {ratio:.3f} | "
                         f"{'yes' if ratio <= 1 + PLAN_TOLERANCE else '**no**'} |")
    return "\n".join(lines)


def plan_verdict(summary):
    out = []
    for grads, sweep_key in (("host", "best"), ("gpu", "best_gpu")):
        ratios = [m["plan"][grads]["simulated"] / m[sweep_key] for m in summary.values() if grads in m["plan"]]
        if ratios:
            worst = max(ratios)
            out.append(f"- automatic plan within 5% of the best swept k, gradients on the {grads}: worst "
                       f"{worst:.3f}x -> {'met' if worst <= 1 + PLAN_TOLERANCE else 'NOT met'}")
    return "\n".join(out)


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
    """Rows: k; columns: simulated (predicted) seconds per model, host gradients. * marks the best
    swept k, p the plan's own k."""
    names = list(summary)
    ks = sorted({k for m in summary.values() for k in m["sweep"]})
    lines = ["| k | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in ks:
        cells = []
        for name in names:
            m = summary[name]
            if k not in m["sweep"]:
                cells.append("")
                continue
            mark = ("*" if k == m["best_k"] else "") + ("p" if "host" in m["plan"] and k == m["plan"]["host"]["k"] else "")
            cells.append(f"{m['sweep'][k]:.3f} ({m['predicted'][k]:.3f}){mark}")
        lines.append(f"| {k:.4g} | " + " | ".join(cells) + " |")
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
        return ("matplotlib is not installed in this environment: no plot was drawn (the CSV has every point; "
                "`python -m pip install matplotlib` and rerun to get it).")
    series = defaultdict(list)
    flat = {}
    plans = {}
    for r in rows:
        if r["policy"] == "interleaved":
            series[(r["model"], r["grads"])].append((float(r["k"]), float(r["update_s"])))
        elif r["policy"] == "auto":
            plans[(r["model"], r["grads"])] = (float(r["k"]), float(r["update_s"]))
        elif r["policy"] in ("cpu", "static20"):
            flat[(r["model"], r["policy"])] = float(r["update_s"])
    models = list(dict.fromkeys(m for m, _ in series))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, grads in zip(axes, ("host", "gpu")):
        for model in models:
            pts = sorted(series.get((model, grads), []))
            if not pts:
                continue
            line, = ax.plot([k for k, _ in pts], [t for _, t in pts], marker=".", label=f"{model}")
            ax.axhline(flat[(model, "cpu")], color=line.get_color(), linestyle=":", linewidth=1)
            if (model, grads) in plans:
                pk, pt = plans[(model, grads)]
                ax.plot([pk], [pt], marker="*", markersize=13, color=line.get_color(), markeredgecolor="black",
                        linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 1.5, 2, 3, 4, 6, 8], labels=["1", "1.5", "2", "3", "4", "6", "8"])
        ax.set_xlabel("stride k (one subgroup in every k updated on the GPU)")
        ax.set_title(f"gradients on the {grads}" + (" (prefetched)" if grads == "host" else " (kept, paper 4.1)"))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("simulated update phase (s)")
    axes[0].legend(fontsize=8, title="model", title_fontsize=8)
    fig.suptitle("Simulated update time vs k; star: PerfModel automatic plan; dotted: all-CPU")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
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
        "## The PerfModel's automatic plan vs the best swept k",
        "",
        "`PerfModel::plan(Policy::automatic)` with the simulator's own rates (H2D/D2H, CPU and GPU update, "
        "host DRAM, 30 B of CPU DRAM traffic per param), the same subgroups, gpu_slot_limit = the sweep's "
        "slots (the plan takes min(limit, 3)) and no static residents (the sweep has none). The plan is then "
        "run in the simulator with its own slots; its k is also one of the swept points (at the sweep's "
        "slots). Criterion (issue): the plan's simulated time within 5% of the best swept k's.",
        "",
        plan_table(summary),
        "",
        plan_verdict(summary),
        "",
        "Update time over the k sweep, gradients on the host: simulated s (PerfModel predicted s); "
        "* best swept k, p the plan's k:",
        "",
        sweep_table(summary),
        "",
        figure,
        "",
    ]
    if a.extra_csv:
        extra = summarize(load(a.extra_csv))
        parts += [f"## Sensitivity: {a.extra_label}", "", table(extra), "", verdicts(extra), "",
                  "The automatic plan at these rates (the PerfModel told the same 110 GB/s):", "",
                  plan_table(extra), "", plan_verdict(extra), ""]
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
        "- In the sensitivity run the CPU is the busiest resource from 10B up because its update shares the "
        "narrower DRAM with DMA: the contention term the paper's Eq. 1 lacks.",
        READING_PLAN,
        "",
        "Simulated time only: this is what the scheduler does under the model's rates, not a GPU measurement.",
    ]
    with open(a.out, "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
