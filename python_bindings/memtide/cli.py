"""The ``memtide`` command line: ``memtide info``, ``memtide probe``, ``memtide run`` (training, or ``--trace``) and ``memtide plan``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

import memtide
from memtide import train_job

# Exit codes: 2 is what argparse uses for bad usage; a bad MEMTIDE_* value is the same kind of
# mistake, so it gets 2 as well. Failures of the work itself get 1.
EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a C tool killed by the signal reports

_INT_MAX = 2**31 - 1

# memtide.optim.POLICIES, without importing torch for `memtide info`.
_POLICIES = ("cpu", "static", "interleaved", "auto")

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
        "cupti": _cupti_probe(),
        "torch_allocator": _torch_allocator_path(),
        "options": table,
    }


def _torch_allocator_path() -> Dict[str, Any]:
    """Which way use_with_torch() would make memtide torch's allocator here (and why)."""
    from . import torch_bridge

    return torch_bridge.status()


def _cupti_probe() -> Dict[str, Any]:
    """Whether CUPTI activity tracing would start here (it is started and stopped at once)."""
    status = memtide._memtide.device_trace_start()
    memtide._memtide.device_trace_stop()
    return status


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
    cupti = info["cupti"]
    print(f"CUPTI     {cupti['status']}" + (f": {cupti['detail']}" if cupti["detail"] else "")
          + (f" ({cupti['library']})" if cupti["library"] else ""))
    path = info["torch_allocator"]
    print(f"torch allocator  {path['why']} (bridge {path['built']})")
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


def _cmd_probe_nvme(args: argparse.Namespace) -> int:
    if not getattr(memtide._memtide, "HAVE_NVME", False):
        raise _UsageError("memtide probe --nvme: this memtide was built without the NVMe tier "
                          "(needs liburing-dev and libxxhash-dev)")
    if not args.json:
        print(f"memtide probe: writing and reading {format_bytes(args.nvme_bytes)} in {args.nvme} "
              "(io_uring, O_DIRECT, queue depth 32, 1 MiB requests) ...", file=sys.stderr, flush=True)
    try:
        r = memtide._memtide.nvme_probe(args.nvme, args.nvme_bytes)
    except OSError as e:
        raise _UsageError(f"memtide probe --nvme: {e}") from None
    r["stale_spills"] = [{"path": p, "bytes": b, "age_s": a} for p, b, a in r["stale_spills"]]
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return 0
    print(f"nvme      {r['dir']}: write {r['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
          f"{r['read_bytes_per_s'] / 1e9:.2f} GB/s ({format_bytes(r['bytes'])}, direct I/O, queue depth "
          f"{r['queue_depth']}, {format_bytes(r['block_bytes'])} requests)")
    for s in r["stale_spills"]:
        print(f"stale     {s['path']}: {format_bytes(s['bytes'])}, {s['age_s'] / 3600:.1f} h old, left by a process "
              "that is gone (remove it to free the space)")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    if args.nvme is not None:
        return _cmd_probe_nvme(args)
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
              f"{format_bytes(w['min_free']) if w['min_free'] is not None else '-':>15}  {_format_duration(w['duration_ns']):>10}")
    print()
    print(f"peak reserved / peak allocated   {result['reserved_over_allocated']:.3f}  "
          f"({format_bytes(result['peak_reserved'])} / {format_bytes(result['peak_allocated'])})")
    h = result["update_headroom"]
    basis = f"from {h['iterations_used']} finished iteration(s)" if h["from_history"] else "no finished iteration yet"
    print(f"update headroom until forward    {format_bytes(h['bytes'])}  "
          f"(limited by {h['limiting_phase']}, {basis}, margin {memtide.options()['headroom_margin']})")


def _cmd_run(args: argparse.Namespace) -> int:
    if args.trace and args.timeline:
        raise _UsageError("--timeline records a training run; --trace replays a trace without one")
    return _cmd_replay(args) if args.trace else _cmd_train(args)


def _shape(args: argparse.Namespace, defaults: Dict[str, int]) -> Dict[str, int]:
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}


def _cmd_replay(args: argparse.Namespace) -> int:
    shape = _shape(args, _RUN_DEFAULTS)
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


def _cmd_train(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("memtide run trains with PyTorch, which is not installed; "
                           "`memtide run --trace` replays an allocation trace without it")
    shape = _shape(args, train_job.TRAIN_DEFAULTS)
    if shape["hidden"] % shape["heads"]:
        raise _UsageError(f"--hidden ({shape['hidden']}) must be a multiple of --heads ({shape['heads']})")
    progress_file = sys.stderr if args.json else sys.stdout

    def progress(line: str) -> None:
        print(line, file=progress_file, flush=True)

    requested = args.device or memtide.options()["device"]
    device = train_job.choose_device(requested)
    where = "cuda:0 (bf16 params, memtide as torch's allocator)" if device["kind"] == "cuda" else \
        f"CPU ({'bf16' if args.host_budget else 'fp32'}; {device['why']}; memtide backend {memtide.backend()})"
    progress(f"training a {shape['layers']}-layer GPT-style model (hidden {shape['hidden']}, heads {shape['heads']}, "
             f"seq {shape['seq']}, batch {shape['batch']}, vocab {shape['vocab']}) for {shape['iterations']} steps "
             f"with memtide.optim.TieredAdamW(policy={args.policy}) on {where} ...")
    if args.timeline:
        from . import timeline

        try:
            timeline.check_report_target(args.timeline)  # refused before training, not after
        except timeline.TraceError as e:
            raise _UsageError(str(e)) from None
        memtide.record_history(True)
        base = memtide.stats()
        cupti = memtide._memtide.device_trace_start()
        progress(f"timeline: CUPTI tracing {cupti['status']}" + (f" ({cupti['detail']})" if cupti["detail"] else ""))
    if (args.host_budget is None) != (args.nvme_dir is None):
        raise _UsageError("--host-budget and --nvme-dir go together: the state that does not fit the budget goes "
                          "to the folder")
    nvme = None if args.host_budget is None else {"host_budget": args.host_budget, "nvme_dir": args.nvme_dir}
    try:
        result = train_job.train(shape, device, args.policy, args.subgroup_size, args.k, args.gpu_static_fraction,
                                 progress, nvme=nvme, window=args.window or None,  # 0: none, as simulate
                                 update_during_backward=args.updates_during_backward)
    except (ValueError, OSError) as e:
        if nvme is None or not any(w in str(e) for w in ("host budget", "host_budget", "spill", "NVMe", "nvme")):
            raise
        raise _UsageError(f"--host-budget/--nvme-dir: {e}") from None
    if args.timeline:
        files = timeline.companions(args.timeline)
        trace = files["trace"]
        if device["kind"] == "cuda":
            import torch

            torch.cuda.synchronize()  # CUPTI's last records are flushed after the device is idle
        activities = memtide._memtide.device_trace_stop()
        timeline.trace_from_allocator(memtide.allocator_events(), trace,
                                      base_allocated=base.get("allocated_bytes.all.current", 0),
                                      base_reserved=base.get("reserved_bytes.all.current", 0),
                                      activities=activities, source="memtide run", device=result["device"]["kind"],
                                      cupti=cupti["status"])
        memtide.dump_snapshot(files["pickle"])  # for torch's memory_viz
        report = timeline.render(trace, args.timeline, chrome=files["chrome"], png=files["png"])
        result["timeline"] = {"html": args.timeline, "trace": trace, "memory_viz": files["pickle"],
                              "events": report["events"]}
        progress(f"timeline: {args.timeline} ({report['events']:,} events; trace {trace}, memory_viz pickle "
                 f"{files['pickle']})")
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_train(result)
    return 0


# ---- plan ---------------------------------------------------------------------------------------

# Optimizer state per param in host memory: fp32 params, exp_avg, exp_avg_sq and gradients.
_HOST_STATE_BYTES = 16
# Model memory that stays on the GPU all iteration: 16-bit params and 16-bit grads.
_GPU_PERSISTENT_BYTES = 4


# A quadrillion parameters: beyond any model, and within every integer type the planner uses.
_MAX_PARAMS = 1e15
_COUNT_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}

# Where the defaults come from: the Deep Optimizer States testbed, per H100 (4 per node).
_DEFAULTS_NOTE = (
    "defaults: the Deep Optimizer States H100 testbed, per GPU (PCIe Gen5 ~55 GB/s each way pinned; "
    "CPU update ~8 G params/s per node of 4 GPUs = 2 per GPU; host DRAM of one socket ~220 GB/s; "
    "80 GiB HBM3; 512 GB host memory); memtide fuses the fp32->16-bit downscale into the CPU step. "
    "Flags override."
)


def _split_number(text: str):
    """'20B' -> (20.0, 'B'); '1.5GiB' -> (1.5, 'GIB'); '20e9' -> (2e10, '')."""
    t = text.strip()
    i = len(t)
    while i > 0 and t[i - 1].isalpha():
        i -= 1
    # '20e9' ends in a digit; '2e' alone is no number and falls through to the float() error.
    number, unit = t[:i], t[i:].upper()
    if unit == "E":
        number, unit = t, ""
    return float(number), unit


def _param_count(text: str) -> int:
    """Parameters: 7000000000, 20e9, 20B, 1.5T, 100M, 350k."""
    try:
        number, unit = _split_number(text)
        scale = _COUNT_SUFFIXES[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; expected e.g. 20e9, 20B, 100M, 1.5T") from None
    value = number * scale
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 parameter, got {text!r}")
    if value > _MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"must be at most {_MAX_PARAMS:.0e} parameters, got {text!r}")
    return int(round(value))


def _size(text: str) -> int:
    """Bytes: 80GiB, 512GB, 1.5TiB, 4096."""
    try:
        number, unit = _split_number(text)
        scale = _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; expected e.g. 80GiB, 512GB, 1.5TiB or a number of bytes") from None
    value = number * scale
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a size >= 0, got {text!r}")
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 8 EiB, got {text!r}")
    return int(round(value))


def _positive_size(text: str) -> int:
    value = _size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return value


def _float(text: str, minimum: float, inclusive: bool, maximum: Optional[float] = None) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    ok = math.isfinite(value) and (value >= minimum if inclusive else value > minimum)
    if maximum is not None:
        ok = ok and value <= maximum
    if not ok:
        lo = f"{'>=' if inclusive else '>'} {minimum:g}"
        accepted = f"a number {lo}" + (f" and <= {maximum:g}" if maximum is not None else "")
        raise argparse.ArgumentTypeError(f"must be {accepted}, got {text!r}")
    return value


def _rate(text: str) -> float:
    return _float(text, 0.0, inclusive=False)


def _rate_or_zero(text: str) -> float:
    return _float(text, 0.0, inclusive=True)


def _fraction(text: str) -> float:
    return _float(text, 0.0, inclusive=True, maximum=1.0)


def _stride(text: str) -> float:
    """k, the stride of the interleaved update: one in every k subgroups on the GPU."""
    return _float(text, 1.0, inclusive=True)


class PlanError(Exception):
    """The machine cannot run the workload as asked (exit 1, message only)."""


def _subgroups(params: int, size: int) -> List[int]:
    full, rest = divmod(params, size)
    return [size] * full + ([rest] if rest else [])


def _plan(args: argparse.Namespace) -> Dict[str, Any]:
    defaults = memtide.default_rates()
    rates = dict(defaults)
    flag_rates = dict(_RATE_FLAGS, cpu_downscale=("cpu_downscale_params_per_s", 1e9))
    overridden = []
    for flag, (key, scale) in flag_rates.items():
        value = getattr(args, flag)
        if value is not None:
            rates[key] = value * scale
            overridden.append("--" + flag.replace("_", "-"))

    params = args.params
    n = -(-params // args.subgroup_size)
    if n > memtide.MAX_SUBGROUPS:
        raise PlanError(f"--subgroup-size {args.subgroup_size} cuts {_format_count(params)} params into {n} subgroups; "
                        f"at most {memtide.MAX_SUBGROUPS} are planned: use --subgroup-size "
                        f"{-(-params // memtide.MAX_SUBGROUPS)} or more")
    sizes = _subgroups(params, args.subgroup_size)

    host_state = _HOST_STATE_BYTES * params
    nvme_flags = args.nvme_read is not None or args.nvme_write is not None
    if host_state > args.host_mem and not nvme_flags:
        raise PlanError(
            f"the optimizer state of {_format_count(params)} params needs {format_bytes(host_state)} of host "
            f"memory ({_HOST_STATE_BYTES} B/param: fp32 params, exp_avg, exp_avg_sq, grads), but --host-mem is "
            f"{format_bytes(args.host_mem)}: plan with an NVMe tier (--nvme-read and --nvme-write, measured by "
            "memtide probe --nvme DIR)")
    if nvme_flags and (args.nvme_read is None or args.nvme_write is None):
        raise PlanError("an NVMe tier needs both --nvme-read and --nvme-write (memtide probe --nvme DIR measures them)")
    if nvme_flags:
        rates["nvme_read_bytes_per_s"] = args.nvme_read * 1e9
        rates["nvme_write_bytes_per_s"] = args.nvme_write * 1e9
    persistent = _GPU_PERSISTENT_BYTES * params
    if persistent + args.margin > args.gpu_mem:
        raise PlanError(
            f"the 16-bit params and grads of {_format_count(params)} params ({format_bytes(persistent)}) plus the "
            f"margin ({format_bytes(args.margin)}) do not fit in --gpu-mem {format_bytes(args.gpu_mem)}: "
            f"the model needs a layer window (parameters offloaded too), which this planner does not cover")
    headroom = args.gpu_mem - persistent - args.margin
    # No iteration is measured here: slots and residents share the update headroom.
    fit = memtide.fit_gpu_budget(sizes, headroom, headroom)
    slot_bytes, slots, static_limit = fit["slot_bytes"], fit["gpu_slot_limit"], fit["gpu_static_limit"]
    on_nvme = None
    if host_state > args.host_mem:
        try:
            on_nvme = memtide.fit_host_budget(sizes, args.host_mem, gpu_static_limit=static_limit)
        except ValueError as e:
            raise PlanError(str(e)) from None
    spilled = sum(on_nvme) if on_nvme else 0

    policies = {}
    for name in _POLICIES:
        # Each policy with its own knob: the static share for static, the stride for interleaved;
        # auto searches both.
        plan = memtide.plan_update(
            sizes, policy=name, rates=rates, static_fraction=args.static_fraction if name == "static" else 0.0,
            k=args.k if name == "interleaved" else None, gpu_slot_limit=slots, gpu_static_limit=static_limit,
            on_nvme=on_nvme)
        pred = plan["prediction"]
        seconds = pred["total_ns"] / 1e9
        policies[name] = {
            "k": plan["k"],
            "gpu_streamed": plan["gpu_streamed"],
            "static_residents": plan["static_residents"],
            "gpu_slots": plan["gpu_slots"],
            "predicted_update_s": seconds,
            "bound_s": pred["bound_ns"] / 1e9,
            "throughput_params_per_s": params / seconds if seconds > 0 else 0.0,
            "busiest": pred["busiest"],
            "busy_s": {r: pred[f"{r}_ns"] / 1e9 for r in ("cpu", "gpu", "h2d", "d2h", "dram", "nvme")},
            "placement": plan["placement"],
        }
    chosen = policies[args.policy]
    return {
        "params": params,
        "subgroups": n,
        "subgroup_size": args.subgroup_size,
        "policy": args.policy,
        "k": chosen["k"],
        "static_residents": chosen["static_residents"],
        "gpu_slots": chosen["gpu_slots"],
        "predicted_update_s": chosen["predicted_update_s"],
        "throughput_params_per_s": chosen["throughput_params_per_s"],
        "busiest": chosen["busiest"],
        "gpu": {
            "memory": args.gpu_mem, "persistent": persistent, "margin": args.margin, "headroom": headroom,
            "slot_bytes": slot_bytes, "slot_limit": slots, "static_limit": static_limit,
        },
        "host": {"memory": args.host_mem, "optimizer_state": host_state},
        "nvme": {"subgroups": spilled, "state_bytes": spilled * 12 * args.subgroup_size,
                 "read_bytes_per_s": rates.get("nvme_read_bytes_per_s", 0),
                 "write_bytes_per_s": rates.get("nvme_write_bytes_per_s", 0)} if spilled else None,
        "rates": rates,
        "overridden": overridden,
        "defaults": _DEFAULTS_NOTE,
        "policies": policies,
    }


def _print_plan(result: Dict[str, Any]) -> None:
    g, h, r = result["gpu"], result["host"], result["rates"]
    sizes = _subgroups(result["params"], result["subgroup_size"])
    last = "" if sizes[-1] == sizes[0] else f", last {_format_count(sizes[-1])}"
    print(f"model     {_format_count(result['params'])} params in {result['subgroups']} subgroups of "
          f"{_format_count(result['subgroup_size'])}{last}")
    print(f"GPU       {format_bytes(g['memory'])}: {format_bytes(g['persistent'])} 16-bit params + grads, margin "
          f"{format_bytes(g['margin'])}, update headroom {format_bytes(g['headroom'])}")
    print(f"          = {g['slot_limit']} slot(s) of {format_bytes(g['slot_bytes'])} (fp32 p, m, v, grad; "
          f"up to {memtide.USEFUL_SLOTS} used for streaming), up to {g['static_limit']} static resident(s) "
          f"(activations not counted)")
    nv = result.get("nvme")
    if nv:
        print(f"host      {format_bytes(h['memory'])}: optimizer state {format_bytes(h['optimizer_state'])} does not "
              f"fit; {nv['subgroups']} subgroups ({format_bytes(nv['state_bytes'])} of params and moments) live on "
              f"NVMe, read ahead and written back at {nv['read_bytes_per_s'] / 1e9:.1f} / "
              f"{nv['write_bytes_per_s'] / 1e9:.1f} GB/s")
    else:
        print(f"host      {format_bytes(h['memory'])}: optimizer state {format_bytes(h['optimizer_state'])} fits")
    downscale = ("fused into the CPU step" if r["cpu_downscale_params_per_s"] == 0
                 else f"{r['cpu_downscale_params_per_s'] / 1e9:.2f} G params/s")
    print(f"rates     H2D {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {r['d2h_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"CPU update {r['cpu_update_params_per_s'] / 1e9:.2f} G params/s, GPU update "
          f"{r['gpu_update_params_per_s'] / 1e9:.1f} G params/s, downscale {downscale}, host DRAM "
          f"{r['host_dram_bytes_per_s'] / 1e9:.0f} GB/s ({r['cpu_dram_bytes_per_param']:.0f} B/param per CPU update)")
    note = result["defaults"]
    if result["overridden"]:
        note += f" Overridden here: {', '.join(result['overridden'])}."
    print(f"          ({note})")
    print()
    print(f"{'policy':<13} {'k':>6}  {'GPU streamed':>12}  {'static':>6}  {'slots':>5}  {'update':>9}  "
          f"{'bound':>9}  {'throughput':>16}  busiest")
    for name, p in result["policies"].items():
        k = f"{p['k']:.3f}" if p["k"] > 0 else "-"
        marker = " *" if name == result["policy"] else ""
        print(f"{name:<13} {k:>6}  {p['gpu_streamed']:>12}  {p['static_residents']:>6}  {p['gpu_slots']:>5}  "
              f"{_format_duration(p['predicted_update_s'] * 1e9):>9}  {_format_duration(p['bound_s'] * 1e9):>9}  "
              f"{_format_count(p['throughput_params_per_s']) + ' params/s':>16}  {p['busiest']}{marker}")
    chosen = result["policies"][result["policy"]]
    print()
    print(f"{result['policy']}: k = {chosen['k']:.3f} (one in every k streamed subgroups on the GPU), "
          f"{chosen['static_residents']} static resident(s), {chosen['gpu_slots']} GPU slot(s); predicted update "
          f"{_format_duration(chosen['predicted_update_s'] * 1e9)}, {_format_count(chosen['throughput_params_per_s'])}"
          f" params/s; busiest resource: {chosen['busiest']}")


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        result = _plan(args)
    except PlanError as e:
        _error(e)
        return EXIT_FAILURE
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_plan(result)
    return 0


def _print_train(r: Dict[str, Any]) -> None:
    m, o, u = r["model"], r["optimizer"], r["update"]
    print()
    print(f"model     {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}, seq {m['seq']}, batch {m['batch']}, "
          f"vocab {m['vocab']}: {_format_count(m['params'])} parameters ({m['dtype']})")
    first, last = r["steps"][0]["loss"], r["steps"][-1]["loss"]
    print(f"loss      {first:.4f} -> {last:.4f} over {len(r['steps'])} steps (two batches, cycled); "
          f"after the last update {r['final_loss']:.4f}")
    w = r.get("window")
    if w:
        print(f"window    {w['size']} of {w['blocks']} blocks on the device (asked {w['requested']!r}): {w['fetches']} "
              f"fetches, {w['evictions']} evictions, {w['grad_offloads']} gradient offloads")
    bu = r.get("backward_updates")
    if bu:
        print(f"backward  {bu['speculated']} subgroup updates begun during backward: {bu['kept']} kept, "
              f"{bu['redone']} redone at the step, {bu['rolled_back']} rolled back")
        c = bu.get("choice") or {}
        if c:
            how = ("by time: what one worker finishes before backward ends" if c["rule"] == "time"
                   else "by count: untimed, the last layers'")
            print(f"          next backward: {len(c['subgroups'])} of {c['candidates']} host-resident subgroups, "
                  f"chosen {how}")
    print()
    on_gpu = r["device"]["kind"] == "cuda"
    phases = r["phases"]
    if on_gpu:
        print("GPU memory per phase (memtide phase report, last training iteration; memtide serves torch's CUDA "
              "tensors):")
        print(f"  {'phase':<10} {'peak allocated':>15}  {'peak reserved':>15}  {'min free':>15}  {'wall time':>10}")
        for name in ("forward", "backward", "update"):
            w = phases[name]
            print(f"  {name:<10} {format_bytes(w['peak_allocated']):>15}  {format_bytes(w['peak_reserved']):>15}  "
                  f"{format_bytes(w['min_free']) if w['min_free'] is not None else '-':>15}  {_format_duration(w['duration_ns']):>10}")
        h = r["headroom"]
        print(f"  update headroom until forward: {format_bytes(h['bytes'])} (limited by {h['limiting_phase']})")
    else:
        rss = r["host_rss_peak"]
        print("per phase, last training iteration: wall time from memtide's phase tracker (marked by "
              "TieredAdamW.attach hooks);")
        print("  no GPU memory columns: the model's tensors are CPU tensors, which memtide's allocator (a SimDevice "
              "here) does not serve.")
        print("  host column: the process's resident memory at the end of the phase, highest over all steps.")
        print(f"  {'phase':<10} {'wall time':>10}  {'host RSS':>12}")
        for name in ("forward", "backward", "update"):
            host = format_bytes(rss[name]) if rss else "n/a"
            print(f"  {name:<10} {_format_duration(phases[name]['duration_ns']):>10}  {host:>12}")
    print()
    where = "pinned" if o["pinned"] else "pageable (no CUDA)"
    lowp = f" + {o['low_precision']} param copy" if o["low_precision"] else ""
    print(f"optimizer {_format_count(o['numel'])} params in {o['subgroups']} subgroups of "
          f"{_format_count(o['subgroup_size'])}: fp32 params, exp_avg, exp_avg_sq, grads{lowp} = "
          f"{format_bytes(o['state_bytes'])}" + ("" if r.get("nvme") else " host"))
    arena = o.get("host_arena")
    if arena and r.get("nvme"):
        print(f"          {format_bytes(12 * r['nvme']['spilled_params'])} of it on NVMe; in host memory "
              f"{format_bytes(arena['state_bytes'])}: gradients and the kept subgroups (HostArena and registered "
              "pages), staging")
    elif arena:
        node = "not NUMA-bound" if arena["numa_node"] < 0 else f"NUMA node {arena['numa_node']}"
        print(f"          fp32 state in memtide's HostArena: {format_bytes(arena['requested_bytes'])} requested, "
              f"{format_bytes(arena['state_bytes'])} allocated; the arena reserves "
              f"{format_bytes(arena['reserved_bytes'])} in {arena['slabs']} slab(s), {arena['registered_slabs']} "
              f"registered with {arena['device']}, {node}")
    else:
        print(f"          fp32 state in torch tensors, {where}")
    nv = r.get("nvme")
    if nv:
        last = nv["last"]
        print(f"nvme      {nv['spilled']} subgroups ({_format_count(nv['spilled_params'])} params, "
              f"{format_bytes(12 * nv['spilled_params'])} of params and moments) on NVMe in {nv['file']}; the last "
              f"step read {format_bytes(int(last['read_bytes']))} and wrote {format_bytes(int(last['write_bytes']))} "
              f"(drive {nv['read_bytes_per_s'] / 1e9:.2f} GB/s read, {nv['write_bytes_per_s'] / 1e9:.2f} GB/s write); "
              f"staging {format_bytes(nv['staging_bytes'])}")
    print(f"plan      {r['plan']['summary']}")
    print(f"update    engine {o['engine']} ({o['cpu_isa']}, {o['cpu_threads']} threads): "
          f"{_format_count(u['params_per_step'])} params in {_format_duration(u['engine_seconds_median'] * 1e9)} "
          f"= {_format_count(u['engine_params_per_second'])} params/s (median of {u['steps_measured']} steps)")
    print(f"          whole step() with gradient gather and write-back: "
          f"{_format_duration(u['step_seconds_median'] * 1e9)} = {_format_count(u['step_params_per_second'])} params/s")
    ep = r["plan"].get("engine_plan")
    if ep is not None:
        print(f"          PerfModel plan: placement {ep['placement']} (c CPU, g streamed GPU, s GPU-static), "
              f"{ep['gpu_slots']} GPU slots, busiest {ep['prediction']['busiest']}; headroom "
              f"{format_bytes(ep['headroom_bytes'])} from {ep['headroom_from']}")
    if u["predicted_seconds"] is not None:
        p = u["predicted_seconds"]
        m = u.get("measured_seconds")
        clock = u.get("measured_clock", "wall")
        if m is None:
            m, clock = u["engine_seconds_median"], "wall"
        label = ("simulated: the SimDevice's virtual clock, no GPU here" if clock == "simulated"
                 else "wall clock")
        print(f"          update phase predicted {_format_duration(p * 1e9)} vs measured "
              f"{_format_duration(m * 1e9)} ({label}; {m / p:.2f}x)")
    print()
    print("the same update (trained state, last gradients) under each policy (wall time of the engine; "
          "then the update phase on the scheduler's clock):")
    for p in r["policies"]:
        print(f"  {p['plan']}")
        print(f"    {_format_duration(p['update_seconds'] * 1e9)} = {_format_count(p['params_per_second'])} params/s, "
              f"state digest {p['digest']}")
        if p.get("phase_seconds") is not None and p.get("predicted_seconds") is not None:
            print(f"    update phase {_format_duration(p['phase_seconds'] * 1e9)} ({p['phase_clock']}), "
                  f"predicted {_format_duration(p['predicted_seconds'] * 1e9)}")
    same = "yes, bit for bit" if r["policies_identical"] else "NO: the policies disagree"
    print(f"identical results under every policy: {same}")


class _UsageError(ValueError):
    """A combination of flags that argparse cannot check on its own."""


# The PerfModel's rates as flags (memtide plan and memtide simulate): flag -> (rate key, unit).
_RATE_FLAGS = {
    "h2d": ("h2d_bytes_per_s", 1e9), "d2h": ("d2h_bytes_per_s", 1e9),
    "cpu_update": ("cpu_update_params_per_s", 1e9), "gpu_update": ("gpu_update_params_per_s", 1e9),
    "dram": ("host_dram_bytes_per_s", 1e9),
}


def _add_rate_flags(parser) -> None:
    parser.add_argument("--h2d", type=_rate, default=None, metavar="GB/s", help="pinned host-to-device rate")
    parser.add_argument("--d2h", type=_rate, default=None, metavar="GB/s", help="pinned device-to-host rate")
    parser.add_argument("--cpu-update", type=_rate, default=None, metavar="G/s",
                        help="CPU optimizer step, G params/s per GPU (U_c)")
    parser.add_argument("--gpu-update", type=_rate, default=None, metavar="G/s",
                        help="GPU optimizer step, G params/s (U_g)")
    parser.add_argument("--dram", type=_rate, default=None, metavar="GB/s",
                        help="host DRAM bandwidth shared by CPU updates and DMA")


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="plan the optimizer update phase (CPU/GPU placement of subgroups) with the PerfModel",
        description="Predicts the optimizer update phase for every policy (cpu, static, "
        "interleaved, auto) with memtide's PerfModel and prints the plans. " + _DEFAULTS_NOTE,
    )
    plan.add_argument("--params", type=_param_count, default=20_000_000_000, metavar="N",
                      help="parameters this GPU's optimizer updates, e.g. 20e9 or 20B (default: 20B, GPT-NeoX-20B)")
    plan.add_argument("--subgroup-size", type=_param_count, default=100_000_000, metavar="N",
                      help="parameters per optimizer subgroup (default: 100M, as in the paper)")
    plan.add_argument("--gpu-mem", type=_positive_size, default=80 * 2**30, metavar="SIZE",
                      help="GPU memory, e.g. 80GiB (default: 80GiB)")
    plan.add_argument("--host-mem", type=_positive_size, default=512 * 10**9, metavar="SIZE",
                      help="host memory for optimizer state, e.g. 512GB (default: 512GB)")
    plan.add_argument("--margin", type=_size, default=2 * 2**30, metavar="SIZE",
                      help="GPU memory kept free: CUDA context, workspaces, fragmentation (default: 2GiB)")
    _add_rate_flags(plan)
    plan.add_argument("--nvme-read", type=_rate, default=None, metavar="GB/s",
                      help="the NVMe tier's read rate (memtide probe --nvme DIR); with --nvme-write, a model whose "
                      "state exceeds --host-mem is planned with the subgroups that do not fit on NVMe")
    plan.add_argument("--nvme-write", type=_rate, default=None, metavar="GB/s", help="the NVMe tier's write rate")
    plan.add_argument("--cpu-downscale", type=_rate_or_zero, default=None, metavar="G/s",
                      help="separate fp32->16-bit pass on the CPU, G params/s (D_c); 0 = fused into the step")
    plan.add_argument("--static-fraction", type=_fraction, default=0.2, metavar="F",
                      help="GPU-resident share for the static policy (default: 0.2)")
    plan.add_argument("--k", type=_stride, default=2.0, metavar="K",
                      help="stride for the interleaved policy: one in every K subgroups on the GPU (default: 2)")
    plan.add_argument("--policy", choices=_POLICIES, default="auto",
                      help="the plan reported at the top level (default: auto); all are printed")
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    plan.set_defaults(func=_cmd_plan)


# ---- simulate ------------------------------------------------------------------------------------

# GPUs the simulator knows: memory, the achieved FLOP/s of the model's kernels (a tenth of the dense
# bf16 peak, which makes ZeRO-3 reach the paper's ~30 TFLOP/s per H100 over whole iterations; see
# NodeSpec::gpu_flops), PCIe each way (pinned), collective bandwidth per GPU over NVLink.
_SIM_GPUS = {
    "h100": {"capacity_bytes": 80 * 2**30, "gpu_flops": 100e12, "h2d_bytes_per_s": 55e9, "d2h_bytes_per_s": 55e9,
             "link_bytes_per_s": 300e9},
    "h200": {"capacity_bytes": 141 * 10**9, "gpu_flops": 100e12, "h2d_bytes_per_s": 55e9, "d2h_bytes_per_s": 55e9,
             "link_bytes_per_s": 300e9},
    "a100": {"capacity_bytes": 80 * 2**30, "gpu_flops": 31e12, "h2d_bytes_per_s": 25e9, "d2h_bytes_per_s": 25e9,
             "link_bytes_per_s": 200e9},
}
_CONTENDERS = ("zero3_offload", "twinflow", "memtide")


def _window_arg(text: str):
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of blocks >= 0 or auto, got {text!r}")
    return n


def _simulate(args: argparse.Namespace) -> Dict[str, Any]:
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "micro_batch", "micro_batches", "vocab")
             if getattr(args, k) is not None}
    model = args.model
    if model is not None and model.lower() == "custom":
        model = None
    if model is None and not {"layers", "hidden", "heads"} <= shape.keys():
        raise _UsageError("--model custom needs --layers, --hidden and --heads")
    node = dict(_SIM_GPUS[args.gpu])
    node["gpus"] = args.gpus_per_node
    flags = dict(_RATE_FLAGS, gpu_mem=("capacity_bytes", 1), gpu_flops=("gpu_flops", 1e12),
                 link=("link_bytes_per_s", 1e9), flush=("pageable_flush_bytes_per_s", 1e9),
                 subgroup_size=("subgroup_params", 1), host_mem=("host_budget_bytes", 1),
                 nvme_read=("nvme_read_bytes_per_s", 1e9), nvme_write=("nvme_write_bytes_per_s", 1e9))
    for flag, (key, scale) in flags.items():
        value = getattr(args, flag)
        if value is not None:
            node[key] = value * scale
    if args.updates_during_backward:
        node["updates_during_backward"] = 1
    if "host_budget_bytes" in node:  # the report says which drive rates the NVMe tier ran at
        defaults = memtide.simulation_defaults()
        for key in ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
            node.setdefault(key, defaults[key])
    results = {}
    failed = {}
    checkpoint = not args.no_checkpointing
    tokens = (args.seq or 2048) * (args.micro_batch or 1) * (args.micro_batches or 1)
    for name in _CONTENDERS:
        if not args.json:
            print(f"simulating {name}...", file=sys.stderr, flush=True)
        record = bool(args.timeline) and name == "memtide"  # its operations go into the trace
        try:
            r = memtide.simulate_iteration(model=model, shape=shape or None, contender=name, node=node,
                                           checkpointing=not args.no_checkpointing, iterations=args.iterations,
                                           record_ops=record, window=args.window if name == "memtide" else None)
        except ValueError as e:
            if "host budget" in str(e):
                raise _UsageError(f"--host-mem: {e}") from None
            if "layer window" in str(e):
                raise _UsageError(f"--window: {e}") from None
            raise
        except MemoryError as e:
            # With the layer window, the baselines (which keep every parameter on the GPU) may not
            # fit where memtide does: say so instead of failing the comparison.
            if name == "memtide" or args.window is None:
                raise
            failed[name] = {"fits": False, "error": str(e)}
            if not args.json:
                print(f"  {name} does not fit: {e}", file=sys.stderr, flush=True)
            continue
        if record:
            recorded = r
        sim, pred = r["simulated"], r["predicted"]
        results[name] = {
            "iteration_s": sim["iteration_s"], "forward_s": sim["forward_s"], "backward_s": sim["backward_s"],
            "update_s": sim["update_s"], "predicted": pred, "peak_bytes": r["peak_bytes"],
            "peak_reserved_bytes": r["peak_reserved_bytes"],
            # Data parallel: every rank runs the whole model on its own micro-batches (2 FLOPs per
            # param per token forward, twice that backward, once more to recompute).
            "tflops": (4 if checkpoint else 3) * 2 * r["params"] * tokens / 1e12 / sim["iteration_s"],
            "update_bound_s": r["update_bound_s"],
            "update_vs_bound": r["update_bound_s"] / sim["update_s"] if sim["update_s"] > 0 else None,
            "grad_bytes_to_host": r["grad_bytes_to_host"],
            "alloc_retries": r["alloc_retries"],
            "nvme": {"subgroups": r["nvme_subgroups"], "bytes": r["nvme_bytes"]} if r["nvme_subgroups"] else None,
            "plan": {k: r["plan"][k] for k in (
                "k", "gpu_streamed", "static_residents", "gpu_slots")},
            "fits": True,
            "window": r["window"],
        }
        if r["backward_update_params"]:
            results[name]["backward_update_params"] = r["backward_update_params"]
            results[name]["backward_update_busy_s"] = r["backward_update_busy_s"]
        if r["window_why"]:
            results[name]["window_why"] = r["window_why"]
        if r["window"]:
            results[name]["window_h2d_bytes"] = r["window_h2d_bytes"]
        params, model_name, capacity = r["params"], r["model"], r["capacity_bytes"]
    results.update(failed)
    results = {name: results[name] for name in _CONTENDERS}
    out = {"model": model_name, "params": params, "shape": shape, "gpu": args.gpu, "node": node,
           "checkpointing": not args.no_checkpointing, "capacity_bytes": capacity, "window": results["memtide"]["window"],
           "contenders": results, **({"recorded": recorded} if args.timeline else {})}
    if failed:
        out["speedup"] = None
        return out
    zero, mt = results["zero3_offload"], results["memtide"]
    # The speed-up in two steps, as the paper splits it: memtide's backward first, then its update.
    after_backward = zero["iteration_s"] - zero["backward_s"] + mt["backward_s"]
    speedup = {
        "memtide_over_zero3": zero["iteration_s"] / mt["iteration_s"],
        "twinflow_over_zero3": zero["iteration_s"] / results["twinflow"]["iteration_s"],
        "from_backward": zero["iteration_s"] / after_backward,
        "update_adds": after_backward / mt["iteration_s"] - 1,
        "paper": {"memtide_over_zero3": [2.0, 2.5], "from_backward": 1.9, "update_adds": 0.6},
    }
    out["speedup"] = speedup
    return out


def _simulation_trace(args: argparse.Namespace, r: Dict[str, Any]) -> Dict[str, Any]:
    """Writes the memtide contender's last simulated iteration (recorded) as a trace, then its report."""
    from . import timeline

    html_path = args.timeline
    files = timeline.companions(html_path)
    trace = files["trace"]
    with timeline.TraceWriter(trace, source="memtide simulate", clock="virtual", model=r["model"],
                              contender="memtide", capacity_bytes=r["capacity_bytes"]) as w:
        for t, phase in zip(r["phase_start_s"], ("forward", "backward", "update")):
            w.phase(t, phase)
        w.phase(r["end_s"], "other")
        for t, allocated, reserved in r["memory"]:
            w.memory(t, allocated, reserved)
        for engine, start, end, nbytes in r["ops"]:
            w.op(engine, start, end, nbytes)
        for what, subgroup, start, end, nbytes in r["tiering"]:
            w.event(type="tiering", what=what, subgroup=subgroup, start=start, end=end, bytes=nbytes)
    return timeline.render(trace, html_path, chrome=files["chrome"], png=files["png"])


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.timeline:
        from . import timeline

        try:
            timeline.check_report_target(args.timeline)  # before the simulation, not after
        except timeline.TraceError as e:
            raise _UsageError(str(e)) from None
    result = _simulate(args)
    if args.timeline:
        report = _simulation_trace(args, result.pop("recorded"))
        result["timeline"] = {k: report[k] for k in ("html", "chrome", "png", "events")}
        if not args.json:
            print(f"timeline  {report['html']} ({report['events']:,} events; trace {report['html'][:-5]}.trace.jsonl, "
                  f"Chrome trace {report['chrome']}" + (f", plot {report['png']}" if report.get("png") else "") + ")",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    n = result["node"]
    print(f"model     {result['model']}: {_format_count(result['params'])} params"
          + (f" ({', '.join(f'{k} {v}' for k, v in result['shape'].items())})" if result["shape"] else ""))
    print(f"node      one rank of ZeRO-3 over {n['gpus']} x {result['gpu']}: {format_bytes(int(n['capacity_bytes']))}, "
          f"{n['gpu_flops'] / 1e12:.0f} TFLOP/s achieved, links {n['link_bytes_per_s'] / 1e9:.0f} GB/s, "
          f"activation checkpointing {'on' if result['checkpointing'] else 'off'}")
    print(f"{'':15}{'forward':>9}{'backward':>10}{'update':>9}{'iteration':>11}{'speed-up':>10}{'predicted':>11}"
          f"{'update/bound':>14}   peak forward / backward / update")
    fitted = result["contenders"]["zero3_offload"]["fits"]
    zero = result["contenders"]["zero3_offload"]["iteration_s"] if fitted else None
    for name, c in result["contenders"].items():
        if not c["fits"]:
            print(f"{name:15}does not fit in {format_bytes(int(result['capacity_bytes']))} without the layer window")
            continue
        peaks = " / ".join(format_bytes(int(c["peak_bytes"][p])) for p in ("forward", "backward", "update"))
        bound = f"{c['update_vs_bound'] * 100:.0f}%" if c["update_vs_bound"] is not None else "-"
        print(f"{name:15}{c['forward_s']:8.2f}s{c['backward_s']:9.2f}s{c['update_s']:8.2f}s{c['iteration_s']:10.2f}s"
              + (f"{zero / c['iteration_s']:9.2f}x" if zero else f"{'-':>10}")
              + f"{c['predicted']['iteration_s']:10.2f}s{bound:>14}   {peaks}")
    if result["window"]:
        mt = result["contenders"]["memtide"]
        print(f"window    memtide keeps a window of {result['window']} block(s) on the GPU, the rest in host memory "
              f"({format_bytes(int(mt['window_h2d_bytes']))} copied in per iteration)"
              + (f": {mt['window_why']}" if mt.get("window_why") else " (as given)"))
    elif result["contenders"]["memtide"].get("window_why"):
        print(f"window    none: {result['contenders']['memtide']['window_why']}")
    mt = result["contenders"]["memtide"]
    if mt.get("backward_update_params"):
        print(f"backward  memtide updated {_format_count(mt['backward_update_params'])} params on the CPU during "
              f"backward ({mt['backward_update_busy_s']:.2f} s of host time there)")
    sp = result["speedup"]
    if sp is None:
        return 0
    print(f"memtide over ZeRO-3 offload: {sp['memtide_over_zero3']:.2f}x = {sp['from_backward']:.2f}x from the "
          f"backward pass, then +{sp['update_adds'] * 100:.0f}% from the update phase "
          f"(paper, 20B on 4 x H100: 2-2.5x = 1.9x, then +60%)")
    tf = ", ".join(f"{name} {c['tflops']:.0f}" for name, c in result["contenders"].items())
    print(f"TFLOP/s   per GPU over the whole iteration (model FLOPs, recomputation counted): {tf}; the paper measured "
          "~30 for ZeRO-3 offload")
    print(f"capacity  {format_bytes(int(result['capacity_bytes']))} per GPU; the peaks are the bytes allocated in each "
          "phase (memtide's residents, slots and kept gradients included)")
    nv = result["contenders"]["memtide"]["nvme"]
    if nv:
        print(f"nvme      {nv['subgroups']} subgroups of each rank's optimizer state live on NVMe to fit --host-mem "
              f"{format_bytes(int(n['host_budget_bytes']))}: {format_bytes(int(nv['bytes']))} read and written per "
              f"update at {n['nvme_read_bytes_per_s'] / 1e9:.1f} / {n['nvme_write_bytes_per_s'] / 1e9:.1f} GB/s per GPU "
              "(every contender spills the same subgroups)")
    return 0


def _add_simulate_parser(sub) -> None:
    sim = sub.add_parser(
        "simulate",
        help="whole training iterations of a ZeRO-3 rank on the simulated device: ZeRO-3 offload, TwinFlow, memtide",
        description="Simulates whole iterations (forward, backward, update) of one rank of a ZeRO-3 data-parallel "
        "group on a phantom SimDevice, driving memtide's real allocator, phase tracker, gradient path, planner and "
        "scheduler; the model's kernels and collectives are intervals timed from FLOPs and link rates. Prints "
        "each contender's phases, its speed-up over ZeRO-3 with the optimizer offloaded, the predicted iteration, "
        "the update against its resource bound and the peak memory per phase. docs/simulator.md lists the "
        "assumptions.",
    )
    names = ", ".join(row["name"] for row in memtide.simulation_defaults()["models"])
    sim.add_argument("--model", default="20B", metavar="NAME",
                     help=f"a Table 2 model ({names}; default 20B), or custom with --layers --hidden --heads")
    for flag, what in (("layers", "transformer blocks"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("seq", "sequence length (default 2048)"), ("micro-batch", "micro-batch (default 1)"),
                       ("micro-batches", "micro-batches per step (default 1)"), ("vocab", "vocabulary (default 50304)")):
        sim.add_argument("--" + flag, type=_positive_int, default=None, metavar="N", help=what)
    sim.add_argument("--gpus-per-node", type=_positive_int, default=4, metavar="N",
                     help="the ZeRO-3 data-parallel degree (default: 4, as in the paper)")
    sim.add_argument("--gpu", choices=sorted(_SIM_GPUS), default="h100", help="GPU figures (default: h100)")
    sim.add_argument("--gpu-mem", type=_positive_size, default=None, metavar="SIZE", help="GPU memory")
    sim.add_argument("--gpu-flops", type=_rate, default=None, metavar="TFLOP/s", help="achieved dense bf16 FLOP/s")
    sim.add_argument("--link", type=_rate, default=None, metavar="GB/s", help="collective bandwidth per GPU")
    sim.add_argument("--flush", type=_rate, default=None, metavar="GB/s",
                     help="ZeRO-3's pageable gradient flush (default: 2.5, the paper's Figure 6)")
    _add_rate_flags(sim)
    sim.add_argument("--subgroup-size", type=_param_count, default=None, metavar="N",
                     help="parameters per optimizer subgroup (default: 100M)")
    sim.add_argument("--host-mem", type=_positive_size, default=None, metavar="SIZE",
                     help="host memory per GPU for its rank's optimizer state (16 B/param of its shard); the "
                     "subgroups that do not fit live on NVMe (default: as much as the state needs)")
    sim.add_argument("--nvme-read", type=_rate, default=None, metavar="GB/s",
                     help="the NVMe tier's read rate per GPU (memtide probe --nvme DIR; default: 3)")
    sim.add_argument("--nvme-write", type=_rate, default=None, metavar="GB/s",
                     help="the NVMe tier's write rate per GPU (default: 2)")
    sim.add_argument("--window", type=_window_arg, default=None, metavar="N|auto",
                     help="memtide only: the layer window (STRONGHOLD), keeping N blocks' parameters on the GPU and "
                     "the rest in host memory, or auto to size it from the modelled block times and the memory left "
                     "(default: every parameter on the GPU); the contenders that do not fit without it are reported "
                     "as such")
    sim.add_argument("--updates-during-backward", action="store_true",
                     help="memtide only: update the subgroups its plan puts on the CPU as soon as their gradients are "
                     "home, while backward goes on (STRONGHOLD; speculative, with a saved copy, as clipping and loss "
                     "scaling need)")
    sim.add_argument("--no-checkpointing", action="store_true", help="keep every activation (the paper: checkpointing)")
    sim.add_argument("--iterations", type=_positive_int, default=3, metavar="N",
                     help="iterations simulated; the last is reported (default: 3)")
    sim.add_argument("--timeline", metavar="REPORT.html",
                     help="also write memtide's simulated iteration as a trace (REPORT.trace.jsonl) and its "
                     "timeline report (REPORT.html, REPORT.chrome.json, REPORT.png)")
    sim.add_argument("--json", action="store_true", help="print JSON instead of text")
    sim.set_defaults(func=_cmd_simulate)


def _cmd_timeline(args: argparse.Namespace) -> int:
    from . import timeline

    # Four outputs by default, beside the report: the Chrome trace, the PNG, the memory_viz pickle.
    files = timeline.companions(args.output)
    chrome = args.chrome or files["chrome"]
    png = args.png or files["png"]
    viz = args.memory_viz or files["pickle"]
    try:
        timeline.check_report_target(args.output)
        report = timeline.render(args.trace, args.output, chrome=chrome, png=png, progress=not args.json,
                                 memory_viz=viz)
    except timeline.TraceError as e:
        raise _UsageError(str(e)) from None
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"wrote {report['html']} ({report['events']:,} events)")
    print(f"wrote {report['chrome']} ({report['chrome_events']:,} Chrome trace events)")
    print(f"wrote {report['png']}" if report.get("png") else "no PNG: matplotlib is not installed")
    print(f"wrote {report['memory_viz']} ({report['memory_viz_entries']:,} allocations and frees for memory_viz)")
    for r in report["summary"]:
        print(f"  {r['phase']:<9} {r['duration_s']:.4g} s, peak {format_bytes(int(r['peak_allocated']))}, "
              f"H2D {format_bytes(int(r['h2d_bytes']))} at {r['h2d_gbs']:.1f} GB/s, "
              f"D2H {format_bytes(int(r['d2h_bytes']))} at {r['d2h_gbs']:.1f} GB/s")
    return 0


def _add_timeline_parser(sub) -> None:
    tl = sub.add_parser(
        "timeline", help="render a memtide trace: an HTML report that opens offline, a Chrome trace, a PNG, a "
        "memory_viz pickle",
        description="Reads a memtide trace (JSON Lines; see memtide/timeline.py for the format) and writes four "
        "outputs: a single-file HTML report (memory over time per phase, the PCIe lanes, the engines as a Gantt "
        "chart, the update-phase schedule, a summary per phase) that opens offline, a Chrome/Perfetto trace, a PNG "
        "(with matplotlib) and the allocations as a snapshot pickle for torch's memory_viz.")
    tl.add_argument("trace", help="the trace file (e.g. from memtide simulate --timeline)")
    tl.add_argument("-o", "--output", default="memtide_timeline.html", metavar="REPORT.html",
                    help="the HTML report (default: memtide_timeline.html)")
    tl.add_argument("--chrome", metavar="FILE.json",
                    help="the Chrome trace (chrome://tracing, Perfetto; default: REPORT.chrome.json)")
    tl.add_argument("--png", metavar="FILE.png", help="the PNG (needs matplotlib; default: REPORT.png)")
    tl.add_argument("--memory-viz", metavar="FILE.pickle",
                    help="the allocations as a snapshot pickle for torch's memory_viz (default: REPORT.pickle)")
    tl.add_argument("--json", action="store_true", help="print what was written as JSON")
    tl.set_defaults(func=_cmd_timeline)


# ---- observe -------------------------------------------------------------------------------------


def _read_timeline(path: str) -> Dict[str, Any]:
    """Summarizes an observer log: every process's header, events and summary line.

    A process that died before its exit (abort, _exit, a signal) leaves no summary line, and a
    write cut short leaves half a line: both make the log incomplete, which the summary says
    (`complete`, `problems`) instead of failing.
    """
    pids, events, summaries, problems = [], 0, [], []
    peak, peak_t = 0, None
    t0 = None
    with open(path, errors="replace") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file ends with a newline, as every whole line does
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            problems.append(f"line {n} is not a whole JSON record" + (" (the last one: cut short)" if n == len(lines)
                                                                      else ""))
            continue
        kind = rec.get("type")
        if kind == "header":
            pids.append(rec.get("pid"))
        elif kind == "event":
            events += 1
            t0 = rec.get("t_ns", 0) if t0 is None else t0
            if rec.get("peak", 0) > peak:
                peak, peak_t = rec["peak"], rec.get("t_ns", 0)
        elif kind == "summary":
            summaries.append(rec)
    if len(summaries) < len(pids):
        problems.append(f"{len(pids) - len(summaries)} of {len(pids)} process(es) wrote no summary: they ended "
                        "without running exit handlers (abort, _exit, a signal); their events up to then are here")
    return {
        "log": path, "processes": pids, "events": events, "peak_bytes": peak,
        "peak_at_s": None if peak_t is None else (peak_t - t0) / 1e9,
        "current_bytes": sum(s.get("current_bytes", 0) for s in summaries),
        "unknown_frees": sum(s.get("unknown_frees", 0) for s in summaries),
        "complete": not problems,
        "problems": problems,
    }


def _cmd_observe(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("memtide observe: name the program to run, e.g. memtide observe -- python train.py")
    lib = memtide.preload_library_path()
    if not args.log:
        raise _UsageError("memtide observe: --log needs a file name")
    log = os.path.abspath(args.log)
    if os.path.lexists(log):
        # The observer appends; one run, one timeline. Only a regular file is replaced: a link, a
        # device or a folder at that path is the user's, not an old timeline.
        if os.path.islink(log) or not os.path.isfile(log):
            raise _UsageError(f"memtide observe: --log {args.log} exists and is not a regular file "
                              "(a link, a device or a folder); choose another path")
        os.remove(log)
    folder = os.path.dirname(log)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise _UsageError(f"memtide observe: cannot write the timeline {log}: its folder "
                          f"{'does not exist' if not os.path.isdir(folder) else 'is not writable'}")
    if args.timeline:
        from . import timeline

        try:
            timeline.check_report_target(args.timeline)  # before the program runs, not after
        except timeline.TraceError as e:
            raise _UsageError(f"memtide observe: {e}") from None
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["MEMTIDE_PRELOAD_LOG"] = log
    print(f"memtide observe: running {' '.join(command)} with {os.path.basename(lib)}; timeline -> {log}",
          file=sys.stderr, flush=True)
    try:
        rc = subprocess.run(command, env=env).returncode
    except FileNotFoundError:
        raise _UsageError(f"memtide observe: program {command[0]!r} not found") from None
    except OSError as e:  # not executable, a directory, a bad interpreter line
        raise _UsageError(f"memtide observe: cannot run {command[0]!r}: {e.strerror or e}") from None
    if not os.path.exists(log):
        summary = {"log": log, "processes": [], "events": 0, "peak_bytes": 0, "peak_at_s": None,
                   "current_bytes": 0, "unknown_frees": 0, "complete": True, "problems": []}
    else:
        summary = _read_timeline(log)
    summary["exit_code"] = rc
    if args.timeline and os.path.exists(log):
        from . import timeline

        files = timeline.companions(args.timeline)
        trace = files["trace"]
        timeline.trace_from_observer(log, trace, source="memtide observe", program=" ".join(command))
        report = timeline.render(trace, args.timeline, chrome=files["chrome"], memory_viz=files["pickle"])
        summary["timeline"] = {"html": args.timeline, "trace": trace, "events": report["events"]}
        print(f"memtide observe: timeline report {args.timeline} ({report['events']:,} events)", file=sys.stderr)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    elif summary["events"] == 0:
        print("memtide observe: no cudaMalloc/cudaFree(Async) call was seen. The program allocated no GPU "
              "memory, or it reached the CUDA runtime without the dynamic symbol table (cudart_static, "
              "nvcc's default; link with -cudart shared).")
    else:
        at = f" at {summary['peak_at_s']:.3f} s" if summary["peak_at_s"] is not None else ""
        print(f"observed  {summary['events']} segment events in {len(summary['processes'])} process(es)")
        print(f"peak      {format_bytes(summary['peak_bytes'])}{at} (per process)")
        print(f"at exit   {format_bytes(summary['current_bytes'])} still allocated"
              + (f", {summary['unknown_frees']} frees of unseen pointers" if summary["unknown_frees"] else ""))
        print(f"timeline  {log}")
    if summary["problems"]:
        # On stderr in both modes: the figures above cover only what reached the log.
        for problem in summary["problems"]:
            print(f"memtide observe: incomplete timeline: {problem}", file=sys.stderr)
    return rc


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
    probe.add_argument("--nvme", metavar="DIR", default=None,
                       help="measure DIR's sequential write and read rates as the NVMe tier uses it (io_uring, "
                       "O_DIRECT), and list spills that crashed runs left there")
    probe.add_argument("--nvme-bytes", type=_positive_size, default=1 << 30, metavar="SIZE",
                       help="bytes written and read by --nvme (default: 1GiB)")
    probe.set_defaults(func=_cmd_probe)

    run = sub.add_parser(
        "run",
        help="train a small GPT-style model with TieredAdamW (default) or replay an allocation trace (--trace)",
        description="By default trains a small GPT-style model with memtide.optim.TieredAdamW for a few "
        "steps (on the GPU when one is usable, else on CPU tensors) and reports per-phase memory and time, "
        "the update plan, update throughput and the same update under every policy. With --trace, replays "
        "the allocation trace of GPT-style training (forward, backward, AdamW update) through the caching "
        "allocator and reports per-phase watermarks, fragmentation and update-phase headroom.",
    )
    run.add_argument("--trace", action="store_true", help="replay the allocation trace instead of training")
    for name, trace_default in _RUN_DEFAULTS.items():
        what = "training steps / iterations replayed" if name == "iterations" else "model shape"
        run.add_argument(f"--{name}", type=_positive_int, default=None, metavar="N",
                         help=f"{what} (default: {train_job.TRAIN_DEFAULTS[name]}; with --trace {trace_default})")
    run.add_argument("--policy", choices=_POLICIES, default="auto",
                     help="TieredAdamW update policy for training (default: auto)")
    run.add_argument("--subgroup-size", type=_positive_int, default=train_job.SUBGROUP_DEFAULT, metavar="N",
                     help=f"TieredAdamW subgroup size in parameters (default: {train_job.SUBGROUP_DEFAULT})")
    run.add_argument("--k", type=_stride, default=None, metavar="K",
                     help="stride: one in every K subgroups updated on the GPU (interleaved, default 2; auto: "
                     "fixes it instead of the performance model)")
    run.add_argument("--gpu-static-fraction", type=_fraction, default=0.0, metavar="F",
                     help="share of subgroups kept on the GPU (static, interleaved, auto; default 0)")
    run.add_argument("--host-budget", type=_positive_size, default=None, metavar="SIZE",
                     help="host memory the optimizer state may take; what does not fit goes to --nvme-dir "
                     "(the model then trains in bf16 on the CPU too)")
    run.add_argument("--nvme-dir", default=None, metavar="DIR",
                     help="folder on an NVMe drive for the spilled state (a private folder is made in it)")
    run.add_argument("--window", type=_window_arg, default=None, metavar="N|auto",
                     help="train with a layer window (memtide.window.LayerWindow) of N transformer blocks on the "
                     "device, the rest in host memory, or auto (sized after 2 profiled iterations)")
    run.add_argument("--updates-during-backward", action="store_true",
                     help="TieredAdamW updates the CPU subgroups whose gradients are complete while backward goes "
                     "on (speculative and exact; host gradients only)")
    run.add_argument("--device", choices=("auto", "cuda", "sim"), default=None,
                     help="device backend (default: MEMTIDE_DEVICE, else auto); sim trains on CPU tensors")
    run.add_argument("--timeline", metavar="REPORT.html",
                     help="record the allocator and the phases and write the timeline report (REPORT.html), its "
                     "trace (REPORT.trace.jsonl), a memory_viz pickle (REPORT.pickle) and a Chrome trace")
    run.add_argument("--json", action="store_true", help="print JSON instead of text")
    run.set_defaults(func=_cmd_run)

    _add_plan_parser(sub)
    _add_simulate_parser(sub)
    _add_timeline_parser(sub)

    observe = sub.add_parser(
        "observe",
        help="run any CUDA program with the LD_PRELOAD observer and summarize its GPU memory timeline",
        description="Runs PROGRAM with libmemtide_preload.so preloaded: every cudaMalloc/cudaFree(Async) it "
        "makes through the shared CUDA runtime is forwarded unchanged and written, with current and peak "
        "bytes, as JSON Lines to --log; then prints the peak and what was left allocated. Exits with "
        "PROGRAM's exit code.",
    )
    observe.add_argument("--log", default="memtide_observe.jsonl", metavar="FILE",
                         help="timeline file (default: memtide_observe.jsonl; replaced if it exists)")
    observe.add_argument("--timeline", metavar="REPORT.html",
                         help="also write the timeline report (REPORT.html), its trace, a Chrome trace and a "
                         "memory_viz pickle of the program's cudaMalloc/cudaFree calls")
    observe.add_argument("--json", action="store_true", help="print the summary as JSON")
    observe.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS]")
    observe.set_defaults(func=_cmd_observe)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except (memtide.ConfigError, _UsageError) as e:
        _error(e)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader left (`memtide info --json | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (MemoryError, RuntimeError, ValueError, OverflowError, OSError) as e:
        _error(e)
        return EXIT_FAILURE


def _error(e: BaseException) -> None:
    # An exception without a message (MemoryError() from a huge allocation) still says what it is.
    message = str(e) or type(e).__name__
    # The C++ messages (out of memory in particular) already start with "memtide:".
    print(message if message.startswith("memtide") else f"memtide: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
