"""Renders a Google Benchmark JSON file as the Markdown kept in bench/results/.

The page carries what a reader needs to trust the figures: the command, the date, the machine,
the build, and every benchmark with its counters, plus a verdict for each stated target.
"""
import argparse
import json
import platform
import subprocess
from datetime import date


def machine() -> str:
    lines = []
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    mem_kib = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    lines.append(f"- CPU: {model}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores, "
                 f"{mem_kib / 1024 / 1024:.0f} GiB RAM, {platform.system()} {platform.release()}")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True) if _has("nvidia-smi") else None
    lines.append(f"- GPU: {gpu.stdout.strip()}" if gpu and gpu.returncode == 0 else "- GPU: none (SimDevice only)")
    return "\n".join(lines)


def _has(cmd: str) -> bool:
    from shutil import which
    return which(cmd) is not None


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json_in")
    ap.add_argument("md_out")
    ap.add_argument("--command", default="")
    ap.add_argument("--title", default="Allocator benchmarks")
    args = ap.parse_args()
    data = json.load(open(args.json_in))
    ctx = data["context"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = [f"# {args.title}, {date.today().isoformat()}", "",
           f"Command: `{args.command.strip()}` (commit {commit or 'unknown'})", "",
           "## Machine and build", machine(),
           f"- Build: {ctx.get('library_build_type', '?')} Google Benchmark, memtide Release; "
           f"GPU backend: {ctx.get('memtide_backend_gpu', '?')}" if "memtide_backend_gpu" in ctx else
           f"- Build: {ctx.get('library_build_type', '?')} Google Benchmark, memtide Release"]
    out += [f"- {k.removeprefix('memtide_')}: {v}" for k, v in ctx.items()
            if k.startswith("memtide_") and k != "memtide_backend_gpu"]
    out += [""]

    out += ["## Figures", "", "| benchmark | time | CPU time | counters |", "|---|---|---|---|"]
    fast_path = {}
    for b in data["benchmarks"]:
        name = b["name"]
        if b.get("aggregate_name") in ("mean", "stddev", "cv"):
            continue  # the median speaks for the repetitions; the spread is in the JSON
        counters = {k: v for k, v in b.items() if k not in {
            "name", "run_name", "run_type", "repetitions", "repetition_index", "threads", "iterations", "real_time",
            "cpu_time", "time_unit", "family_index", "per_family_instance_index", "aggregate_name",
            "aggregate_unit", "label"}}
        unit = b.get("time_unit", "ns")
        label = f" ({b['label']})" if b.get("label") else ""
        out.append(f"| {name} | {b['real_time']:.4g} {unit} | {b['cpu_time']:.4g} {unit} | "
                   + ", ".join(f"{k}={fmt(v)}" for k, v in counters.items()) + label + " |")
        if b.get("aggregate_name") == "median" and name.startswith("CachedAllocFree/"):
            fast_path[name] = b["real_time"] if unit == "ns" else None

    if fast_path or any(b["name"].startswith("TransformerReplay") for b in data["benchmarks"]):
        out += ["", "## Targets", ""]
    for name, ns in fast_path.items():
        if ns is not None:
            out.append(f"- {name}: median {ns:.1f} ns per alloc+free pair; target < 100 ns: "
                       f"{'met' if ns < 100 else 'NOT met'}")
    for b in data["benchmarks"]:
        if b["name"].startswith("TransformerReplay") and "resv_over_alloc" in b:
            r = b["resv_over_alloc"]
            out.append(f"- {b['name']}: peak reserved / peak allocated = {r:.4f}; target <= 1.10: "
                       f"{'met' if r <= 1.10 else 'NOT met'}; update-phase headroom found: "
                       f"{b['update_headroom_GiB']:.2f} GiB of a {b['limit_GiB']:.2f} GiB limit")
    for b in data["benchmarks"]:
        if b["name"].startswith("BM_StagingMix") and "reserved_over_requested" in b and not b.get("error_occurred"):
            r = b["reserved_over_requested"]
            memtide = not b["name"].startswith("BM_StagingMixPow2Cache")
            verdict = (f"target <= 1.15: {'met' if r <= 1.15 else 'NOT met'}" if memtide
                       else "power-of-two caching model, for comparison")
            out.append(f"- {b['name']}: peak reserved / peak requested = {r:.4f} "
                       f"({b['peak_reserved_GiB']:.3f} / {b['peak_requested_GiB']:.3f} GiB); {verdict}")
    open(args.md_out, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
