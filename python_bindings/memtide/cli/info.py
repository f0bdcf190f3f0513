"""``memtide info``: versions, the device backend, GPUs, CUPTI, the torch allocator path and the options table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from typing import Any, Dict, Optional

import memtide


def _cuda_version(v: int) -> str:
    # CUDA encodes 12.4 as 12040.
    return f"{v // 1000}.{(v % 1000) // 10}"


def _torch_version() -> Optional[str]:
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
    except Exception:  # a broken torch install must not break `memtide info`
        return None
    return str(torch.__version__)


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
        "optimizer_reads": _optimizer_reads(),
        "options": table,
    }


def _torch_allocator_path() -> Dict[str, Any]:
    """Which way use_with_torch() would make memtide torch's allocator here (and why)."""
    from .. import torch_bridge

    return torch_bridge.status()


def _optimizer_reads() -> str:
    """How TieredAdamW reads its params each step and hooks their gradients here (one library does
    both): "native", or "python: why"."""
    try:
        from ..optim import torch_reads
    except ImportError as e:  # no torch
        return f"python: {e}"
    return torch_reads.status()


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
    print(f"optimizer reads and gradient hooks  {info['optimizer_reads']}")
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


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="versions, device backend, GPUs and the options table")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)
