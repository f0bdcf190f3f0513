"""The ``memtide`` command line: ``memtide info``, ``memtide probe`` and ``memtide run``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from typing import Any, Dict, Optional, Sequence

import memtide

# Exit codes: 2 is what argparse uses for bad usage; a bad MEMTIDE_* value is the same kind of
# mistake, so it gets 2 as well. Failures of the work itself get 1.
EXIT_USAGE = 2
EXIT_FAILURE = 1

_INT_MAX = 2**31 - 1

_RUN_DEFAULTS = {
    "layers": 24,
    "hidden": 2048,
    "heads": 16,
    "seq": 2048,
    "batch": 4,
    "vocab": 50304,
    "iterations": 3,
}


def format_bytes(n: int) -> str:
    """GiB or MiB (KiB and B for small values), two decimals."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _format_duration(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def _format_count(n: float) -> str:
    """1.31B, 5.92M: ML notation for parameter and op counts."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def _cuda_version(v: int) -> str:
    # CUDA encodes 12.4 as 12040.
    return f"{v // 1000}.{(v % 1000) // 10}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > _INT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {_INT_MAX}, got {value}")
    return value


def _torch_version() -> Optional[str]:
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
    except Exception:  # a broken torch install must not break `memtide info`
        return None
    return str(torch.__version__)


# ---- info ---------------------------------------------------------------------------------------


def _info() -> Dict[str, Any]:
    current = memtide.options()
    table = [dict(row, value=current.get(row["key"], "")) for row in memtide.option_table()]
    return {
        "memtide": memtide.__version__,
        "library": memtide.library_path(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "device_option": current.get("device", "auto"),
        "backend": memtide.backend(),
        "device_count": memtide.device_count(),
        "cuda": memtide.cuda_status(),
        "options": table,
    }


def _print_info(info: Dict[str, Any]) -> None:
    cuda = info["cuda"]
    print(f"memtide   {info['memtide']}  ({info['library']})")
    print(f"python    {info['python']}")
    print(f"torch     {info['torch'] or 'not installed'}")
    print(f"backend   {info['backend']}  (MEMTIDE_DEVICE={info['device_option']}, {info['device_count']} device(s))")
    if cuda["usable"]:
        print(
            f"GPUs      {cuda['device_count']} (driver {_cuda_version(cuda['driver_version'])}, "
            f"CUDA runtime {_cuda_version(cuda['runtime_version'])})"
        )
    else:
        built = f"built with CUDA {_cuda_version(cuda['runtime_version'])}" if cuda["compiled"] else "built without CUDA"
        print(f"GPUs      {cuda['device_count']} found, CUDA not usable: {cuda['reason']}; memtide {built}")
    print()
    print("options (environment variable, current value, accepted values):")
    env_w = max(len(row["env"]) for row in info["options"])
    val_w = max(len(row["value"]) for row in info["options"])
    for row in info["options"]:
        print(f"  {row['env']:<{env_w}}  {row['value']:<{val_w}}  {row['accepted']}")
        print(f"  {'':<{env_w}}  {row['help']}")


def _cmd_info(args: argparse.Namespace) -> int:
    info = _info()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        _print_info(info)
    return 0


# ---- probe --------------------------------------------------------------------------------------

# What each link class means, in the order of the matrix legend (worst first, as nvidia-smi lists them).
_LINK_LEGEND = (
    ("X", "the GPU itself"),
    ("SYS", "PCIe plus the link between NUMA nodes (sockets)"),
    ("NODE", "PCIe plus the path between two host bridges of one NUMA node"),
    ("PHB", "PCIe through one host bridge (the CPU's root complex)"),
    ("PXB", "several PCIe bridges, no host bridge (cascaded switches)"),
    ("PIX", "at most one PCIe switch"),
)


def format_cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8", the kernel's cpu list notation."""
    values = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def _probe_json(topo: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "source": topo["source"],
        "numa_nodes": topo["numa_nodes"],
        "gpus": topo["gpus"],
        "links": topo["links"],
    }


def _print_probe(topo: Dict[str, Any]) -> None:
    gpus = topo["gpus"]
    print(f"source    {topo['source']}" + ("" if topo["hwloc"] else "  (memtide built without hwloc)"))
    print()
    if gpus:
        names = [f"GPU{g['index']}" for g in gpus]
        width = max(6, max(len(n) for n in names) + 2)
        cpu_col = [format_cpu_list(g["cpus"]) or "N/A" for g in gpus]
        numa_col = [",".join(str(n) for n in g["numa_nodes"]) if g["locality_known"] else "N/A" for g in gpus]
        cpu_w = max(len("CPU Affinity"), max(len(c) for c in cpu_col)) + 2
        print(" " * width + "".join(f"{n:<{width}}" for n in names) + f"{'CPU Affinity':<{cpu_w}}NUMA Affinity")
        for i, name in enumerate(names):
            cells = "".join(f"{link:<{width}}" for link in topo["links"][i])
            print(f"{name:<{width}}{cells}{cpu_col[i]:<{cpu_w}}{numa_col[i]}")
        print()
        print("Legend:")
        for code, meaning in _LINK_LEGEND:
            print(f"  {code:<4} = {meaning}")
        print()
        print("GPUs:")
        for g in gpus:
            print(f"  GPU{g['index']}  {g['pci_bus_id']}  {g['name']}")
        for g in gpus:
            if not g["locality_known"]:
                print(f"  GPU{g['index']}: NUMA locality unknown; memtide uses node {g['preferred_node']} (the most memory) "
                      f"and cpus {format_cpu_list(g['local_cpus']) or 'none'} for it")
    else:
        print("no NVIDIA GPU found")
    print()
    print("NUMA nodes:")
    for node in topo["numa_nodes"]:
        memory = format_bytes(node["memory_bytes"]) if node["memory_bytes"] else "memory unknown"
        print(f"  node {node['os_index']}  {memory:>12}  cpus {format_cpu_list(node['cpus']) or 'none'}")


def _cmd_probe(args: argparse.Namespace) -> int:
    if args.topology is not None and not os.path.isfile(args.topology):
        what = "is not a file" if os.path.exists(args.topology) else "does not exist"
        print(f"memtide probe: --topology {args.topology!r} {what}; expected an hwloc XML file (lstopo --of xml)",
              file=sys.stderr)
        return EXIT_USAGE
    topo = memtide.topology(args.topology)
    if args.json:
        json.dump(_probe_json(topo), sys.stdout, indent=2)
        print()
    else:
        _print_probe(topo)
    return 0


# ---- run ----------------------------------------------------------------------------------------


def _print_run(result: Dict[str, Any], shape: Dict[str, int]) -> None:
    print(f"device    {result['device']} [{result['backend']}], {format_bytes(result['device_memory'])}, "
          f"allocator limit {format_bytes(result['limit'])}")
    print(f"model     {shape['layers']} layers, hidden {shape['hidden']}, heads {shape['heads']}, seq {shape['seq']}, "
          f"batch {shape['batch']}, vocab {shape['vocab']}: {_format_count(result['params'])} parameters")
    print(f"replay    {shape['iterations']} iterations, {result['ops']} allocator ops in "
          f"{_format_duration(result['seconds'] * 1e9)} ({_format_count(result['ops_per_second'])} ops/s)")
    print()
    print(f"last iteration   {'peak allocated':>15}  {'peak reserved':>15}  {'min free':>15}  {'wall time':>10}")
    for name, w in result["phases"].items():
        if not w["seen"]:
            continue
        print(f"  {name:<14} {format_bytes(w['peak_allocated']):>15}  {format_bytes(w['peak_reserved']):>15}  "
              f"{format_bytes(w['min_free']):>15}  {_format_duration(w['duration_ns']):>10}")
    print()
    print(f"peak reserved / peak allocated   {result['reserved_over_allocated']:.3f}  "
          f"({format_bytes(result['peak_reserved'])} / {format_bytes(result['peak_allocated'])})")
    h = result["update_headroom"]
    basis = f"from {h['iterations_used']} finished iteration(s)" if h["from_history"] else "no finished iteration yet"
    print(f"update headroom until forward    {format_bytes(h['bytes'])}  "
          f"(limited by {h['limiting_phase']}, {basis}, margin {memtide.options()['headroom_margin']})")


def _cmd_run(args: argparse.Namespace) -> int:
    shape = {k: getattr(args, k) for k in _RUN_DEFAULTS}
    device = args.device or memtide.options()["device"]
    resolved = memtide.resolve_backend(device)
    where = (
        f"a phantom SimDevice ({memtide.options()['sim_capacity']})" if resolved == "sim" else "cuda:0"
    )
    # Progress goes to stderr under --json so stdout stays one JSON document.
    progress = sys.stderr if args.json else sys.stdout
    print(
        f"replaying {shape['iterations']} iterations of a {shape['layers']}-layer transformer "
        f"(hidden {shape['hidden']}, seq {shape['seq']}, batch {shape['batch']}) on {where} ...",
        file=progress,
        flush=True,
    )
    result = memtide.replay_transformer(backend=device, **shape)
    result["ops_per_second"] = result["ops"] / result["seconds"] if result["seconds"] > 0 else 0.0
    result["model"] = shape
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_run(result, shape)
    return 0


# ---- main ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtide",
        description="memtide: CUDA-aware caching allocator and memory-tiering runtime.",
    )
    parser.add_argument("--version", action="version", version=f"memtide {memtide.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="versions, device backend, GPUs and the options table")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)

    probe = sub.add_parser(
        "probe",
        help="GPUs, NUMA nodes, GPU-local cores and PCIe links (like nvidia-smi topo -m)",
        description="Shows the topology memtide plans with: each GPU's PCIe links to the others, its local "
        "cores and NUMA nodes, and the NUMA nodes with their memory. Sources: --topology, else "
        "MEMTIDE_TOPOLOGY, else this machine through hwloc, else sysfs.",
    )
    probe.add_argument("--json", action="store_true", help="print JSON instead of text")
    probe.add_argument("--topology", metavar="FILE", default=None,
                       help="an hwloc XML file (lstopo --of xml) to show instead of this machine")
    probe.set_defaults(func=_cmd_probe)

    run = sub.add_parser(
        "run",
        help="replay a GPT-style training allocation trace through the caching allocator",
        description="Replays the allocation trace of GPT-style training (forward, backward, AdamW "
        "update) and reports per-phase watermarks, fragmentation and update-phase headroom.",
    )
    for name, default in _RUN_DEFAULTS.items():
        run.add_argument(f"--{name}", type=_positive_int, default=default, metavar="N",
                         help=f"(default: {default})")
    run.add_argument("--device", choices=("auto", "cuda", "sim"), default=None,
                     help="device backend (default: MEMTIDE_DEVICE, else auto)")
    run.add_argument("--json", action="store_true", help="print JSON instead of text")
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except memtide.ConfigError as e:
        _error(e)
        return EXIT_USAGE
    except (MemoryError, RuntimeError, ValueError) as e:
        _error(e)
        return EXIT_FAILURE


def _error(e: BaseException) -> None:
    message = str(e)
    # The C++ messages (out of memory in particular) already start with "memtide:".
    print(message if message.startswith("memtide") else f"memtide: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
