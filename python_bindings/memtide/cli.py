"""The ``memtide`` command line: ``memtide info`` and ``memtide run`` (training, or ``--trace``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from typing import Any, Dict, Optional, Sequence

import memtide
from memtide import train_job

# Exit codes: 2 is what argparse uses for bad usage; a bad MEMTIDE_* value is the same kind of
# mistake, so it gets 2 as well. Failures of the work itself get 1.
EXIT_USAGE = 2
EXIT_FAILURE = 1

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


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
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
        f"CPU (fp32; {device['why']}; memtide backend {memtide.backend()})"
    progress(f"training a {shape['layers']}-layer GPT-style model (hidden {shape['hidden']}, heads {shape['heads']}, "
             f"seq {shape['seq']}, batch {shape['batch']}, vocab {shape['vocab']}) for {shape['iterations']} steps "
             f"with memtide.optim.TieredAdamW(policy={args.policy}) on {where} ...")
    result = train_job.train(shape, device, args.policy, args.subgroup_size, args.k, args.gpu_static_fraction,
                             progress)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_train(result)
    return 0


def _print_train(r: Dict[str, Any]) -> None:
    m, o, u = r["model"], r["optimizer"], r["update"]
    print()
    print(f"model     {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}, seq {m['seq']}, batch {m['batch']}, "
          f"vocab {m['vocab']}: {_format_count(m['params'])} parameters ({m['dtype']})")
    first, last = r["steps"][0]["loss"], r["steps"][-1]["loss"]
    print(f"loss      {first:.4f} -> {last:.4f} over {len(r['steps'])} steps (two batches, cycled); "
          f"after the last update {r['final_loss']:.4f}")
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
                  f"{format_bytes(w['min_free']):>15}  {_format_duration(w['duration_ns']):>10}")
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
          f"{format_bytes(o['state_bytes'])} host, {where}")
    print(f"plan      {r['plan']['summary']}")
    print(f"update    engine {o['engine']} ({o['cpu_isa']}, {o['cpu_threads']} threads): "
          f"{_format_count(u['params_per_step'])} params in {_format_duration(u['engine_seconds_median'] * 1e9)} "
          f"= {_format_count(u['engine_params_per_second'])} params/s (median of {u['steps_measured']} steps)")
    print(f"          whole step() with gradient gather and write-back: "
          f"{_format_duration(u['step_seconds_median'] * 1e9)} = {_format_count(u['step_params_per_second'])} params/s")
    if u["predicted_seconds"] is not None:
        p = u["predicted_seconds"]
        print(f"          predicted {_format_duration(p * 1e9)} vs measured "
              f"{_format_duration(u['engine_seconds_median'] * 1e9)} ({u['engine_seconds_median'] / p:.2f}x)")
    print()
    print("the same update (trained state, last gradients) under each policy:")
    for p in r["policies"]:
        print(f"  {p['plan']}")
        print(f"    {_format_duration(p['update_seconds'] * 1e9)} = {_format_count(p['params_per_second'])} params/s, "
              f"state digest {p['digest']}")
    same = "yes, bit for bit" if r["policies_identical"] else "NO: the policies disagree"
    print(f"identical results under every policy: {same}")


class _UsageError(ValueError):
    """A combination of flags that argparse cannot check on its own."""


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
    run.add_argument("--k", type=_positive_int, default=None, metavar="N",
                     help="CPU subgroups per GPU subgroup (interleaved, auto)")
    run.add_argument("--gpu-static-fraction", type=_fraction, default=0.0, metavar="F",
                     help="share of subgroups kept on the GPU (static, interleaved, auto; default 0)")
    run.add_argument("--device", choices=("auto", "cuda", "sim"), default=None,
                     help="device backend (default: MEMTIDE_DEVICE, else auto); sim trains on CPU tensors")
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
    except (memtide.ConfigError, _UsageError) as e:
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
