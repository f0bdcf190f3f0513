"""What the subcommands share: exit codes, the usage error, argument types and the rate flags.

Sizes, durations, counts and cpu lists are written by the C++ rules (core/format), bound in
``memtide._memtide``; sizes are read by the C++ parser, the one the options table uses.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Dict, NamedTuple, Optional

from memtide import _memtide

# Exit codes: 2 is what argparse uses for bad usage; a bad MEMTIDE_* value is the same kind of
# mistake, so it gets 2 as well. Failures of the work itself get 1.
EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a C tool killed by the signal reports
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, as a shell reports it

_INT_MAX = 2**31 - 1

# A quadrillion parameters: beyond any model, and within every integer type the planner uses.
_MAX_PARAMS = 1e15
_COUNT_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


class UsageError(ValueError):
    """A combination of flags that argparse cannot check on its own."""


def error(e: BaseException) -> None:
    # An exception without a message (MemoryError() from a huge allocation) still says what it is.
    message = str(e) or type(e).__name__
    # The C++ messages (out of memory in particular) already start with "memtide:".
    print(message if message.startswith("memtide") else f"memtide: {message}", file=sys.stderr)


def model_shape(args: argparse.Namespace, defaults: Dict[str, int]) -> Dict[str, int]:
    """The model shape from the flags, each one not given taken from `defaults`."""
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}


# ---- argument types ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > _INT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {_INT_MAX}, got {value}")
    return value


def _split_number(text: str):
    """'20B' -> (20.0, 'B'); '1.5T' -> (1.5, 'T'); '20e9' -> (2e10, '')."""
    t = text.strip()
    i = len(t)
    while i > 0 and t[i - 1].isalpha():
        i -= 1
    # '20e9' ends in a digit; '2e' alone is no number and falls through to the float() error.
    number, unit = t[:i], t[i:].upper()
    if unit == "E":
        number, unit = t, ""
    return float(number), unit


def param_count(text: str) -> int:
    """Parameters: 7000000000, 20e9, 20B, 1.5T, 100M, 350k (B is a billion here, not a byte)."""
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


def size(text: str) -> int:
    """Bytes: 80GiB, 512GB, 64G, 1.5TiB, 4096 (memtide's one size parser, as MEMTIDE_MAX_BYTES reads)."""
    try:
        value = _memtide.parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; expected e.g. 80GiB, 512GB, 1.5TiB or a number of bytes") from None
    # The planner and the bindings take sizes as signed 64-bit integers.
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 8 EiB, got {text!r}")
    return value


def positive_size(text: str) -> int:
    value = size(text)
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


# Rates are given in billions a second (GB/s, G params/s) or trillions (TFLOP/s): from one unit a
# second to 1e18 (what memtide.simulate_iteration accepts), every figure and every time computed
# from them stay finite (1e308 G/s overflowed to inf after scaling; below 1 B/s gave times past any
# clock).
_RATE_MIN, _RATE_MAX = 1.0, 1e18


def _rate_type(scale: float):
    lo, hi = _RATE_MIN / scale, _RATE_MAX / scale

    def rate_in_unit(text: str) -> float:
        value = _float(text, 0.0, inclusive=False)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be a rate from {lo:g} to {hi:g}, got {text!r}")
        return value

    return rate_in_unit


rate = _rate_type(1e9)  # GB/s, G params/s
tflops = _rate_type(1e12)  # TFLOP/s


def rate_or_zero(text: str) -> float:
    value = _float(text, 0.0, inclusive=True)
    return value if value == 0 else rate(text)


def fraction(text: str) -> float:
    return _float(text, 0.0, inclusive=True, maximum=1.0)


def stride(text: str) -> float:
    """k, the stride of the interleaved update: one in every k subgroups on the GPU."""
    return _float(text, 1.0, inclusive=True)


def window_arg(text: str):
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of blocks >= 0 or auto, got {text!r}")
    if n > _INT_MAX:  # the simulator counts blocks in an int; a bigger window is every block anyway
        raise argparse.ArgumentTypeError(f"must be at most {_INT_MAX} blocks (or auto), got {text!r}")
    return n


# ---- the numeric flags' ranges (memtide simulate and memtide plan) -----------------------------
#
# One table: argparse checks each value against it and --help prints it from it, so a range shown
# is the range enforced. The bounds are the simulator's own (tools/simulator: ModelShape::validate,
# NodeSpec::validate, simulate_iteration, the update sweep; tests/python_bindings/cli/sim/test_simulate.py
# checks that each end is accepted there), refused here first so the refusal names the flag.


class FlagRange(NamedTuple):
    parse: Callable[[str], Any]  # the text to a number (or "auto"); bad syntax raises ArgumentTypeError
    lo: float
    hi: float
    text: str  # the range as --help and a refusal write it
    integer: bool
    or_zero: bool = False  # 0 is accepted too (a rate of 0: fused)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)  # inf and nan fall outside every range
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _window(text: str):
    return "auto" if text == "auto" else _integer(text)


def _ints(lo: int, hi: int, note: str = "") -> FlagRange:
    return FlagRange(_integer, lo, hi, f"{lo} to {hi}{note}", True)


def _rates(scale: float, unit: str) -> FlagRange:
    lo, hi = _RATE_MIN / scale, _RATE_MAX / scale
    return FlagRange(_number, lo, hi, f"{lo:g} to {hi:g} {unit}", False)


_PIB = 2**50
# The most GPUs the simulator lays on one node's two sockets (--nodes without --host); one rank
# alone, or the update sweep, models up to 1024 GPUs.
NODE_GPUS_MAX = 64
_GB_S = _rates(1e9, "GB/s")

FLAG_RANGES: Dict[str, FlagRange] = {
    # The model's shape (ModelShape::validate); heads must also divide hidden.
    "layers": _ints(1, 100_000), "hidden": _ints(1, 2**20), "heads": _ints(1, 2**20), "seq": _ints(1, 2**24),
    "micro_batch": _ints(1, 65536), "micro_batches": _ints(1, 4096), "vocab": _ints(1, 2**24),
    "gpus_per_node": _ints(1, 1024, f"; 1 to {NODE_GPUS_MAX} with a node of ranks without --host or --topology"),
    "iterations": _ints(1, 1000), "nodes": _ints(1, 65536), "slots": _ints(1, 1024),
    # Blocks; more than the model has is every block (--layers' most).
    "window": FlagRange(_window, 0, 100_000, "0 to 100000 blocks, or auto", True),
    "gpu_mem": FlagRange(size, 2**30, _PIB, "1GiB to 1024TiB", True),
    "host_mem": FlagRange(size, 1, _PIB, "1 B to 1024TiB", True),
    "save_buffer": FlagRange(size, 1, _PIB, "1 B to 1024TiB", True),
    "margin": FlagRange(size, 0, _PIB, "0 to 1024TiB", True),
    "params": FlagRange(param_count, 1, _MAX_PARAMS, f"1 to {_MAX_PARAMS:.0e} params", True),
    "subgroup_size": FlagRange(param_count, 1, _MAX_PARAMS, f"1 to {_MAX_PARAMS:.0e} params", True),
    **{flag: _GB_S for flag in ("h2d", "d2h", "dram", "link", "flush", "nvme_read", "nvme_write", "inter_node", "save_write")},
    **{flag: _rates(1e9, "G params/s") for flag in ("cpu_update", "gpu_update")},
    "cpu_downscale": FlagRange(_number, _RATE_MIN / 1e9, _RATE_MAX / 1e9,
                               f"0, or {_RATE_MIN / 1e9:g} to {_RATE_MAX / 1e9:g} G params/s", False, or_zero=True),
    "gpu_flops": _rates(1e12, "TFLOP/s"),
    "inter_node_latency": FlagRange(_number, 0, 1e6, "0 to 1e+06 us", False),  # NodeSpec: 0 to 1 s
    "static_fraction": FlagRange(_number, 0, 1, "0 to 1", False),
    "k": FlagRange(_number, 1, sys.float_info.max, "a finite number >= 1", False),
}


def _in_range(r: FlagRange, value) -> bool:
    return value == "auto" or r.lo <= value <= r.hi or (r.or_zero and value == 0)


def checked(flag: str) -> Callable[[str], Any]:
    """argparse's type for `flag` (its dest): the number, or a refusal that states the range."""
    r = FLAG_RANGES[flag]

    def check(text: str):
        try:
            value = r.parse(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (accepted: {r.text})") from None
        if not _in_range(r, value):
            raise argparse.ArgumentTypeError(f"must be {r.text}, got {text!r}")
        return value

    check.__name__ = flag  # argparse names a type by it in some messages
    return check


def apply_ranges(parser: argparse.ArgumentParser) -> None:
    """Every flag of `parser` in FLAG_RANGES is checked against its range and shows it in --help."""
    for action in parser._actions:
        if action.dest in FLAG_RANGES and action.option_strings:
            action.type = checked(action.dest)
            action.help = f"{action.help or ''} [accepted: {FLAG_RANGES[action.dest].text}]".strip()


# ---- the PerfModel's rates as flags (memtide plan and memtide simulate) -----------------------

# flag -> (rate key, unit)
RATE_FLAGS = {
    "h2d": ("h2d_bytes_per_s", 1e9), "d2h": ("d2h_bytes_per_s", 1e9),
    "cpu_update": ("cpu_update_params_per_s", 1e9), "gpu_update": ("gpu_update_params_per_s", 1e9),
    "dram": ("host_dram_bytes_per_s", 1e9),
}


def add_rate_flags(parser) -> None:
    parser.add_argument("--h2d", type=rate, default=None, metavar="GB/s", help="pinned host-to-device rate")
    parser.add_argument("--d2h", type=rate, default=None, metavar="GB/s", help="pinned device-to-host rate")
    parser.add_argument("--cpu-update", type=rate, default=None, metavar="G/s",
                        help="CPU optimizer step, G params/s per GPU (U_c)")
    parser.add_argument("--gpu-update", type=rate, default=None, metavar="G/s",
                        help="GPU optimizer step, G params/s (U_g)")
    parser.add_argument("--dram", type=rate, default=None, metavar="GB/s",
                        help="host DRAM bandwidth shared by CPU updates and DMA")
