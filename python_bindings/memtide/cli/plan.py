"""``memtide plan``: the optimizer update phase of one GPU under every policy (memtide.cli.planning), printed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict

import memtide
from . import planning
from memtide._memtide import POLICIES, format_bytes, format_count, format_duration_ns

from ._common import (EXIT_FAILURE, RATE_FLAGS, UsageError, add_rate_flags, apply_ranges, error, fraction, param_count, positive_size, rate,
                      rate_or_zero, size, stride)


def _plan(args: argparse.Namespace) -> Dict[str, Any]:
    """The flags in the PerfModel's units, then memtide.cli.planning.plan."""
    flag_rates = dict(RATE_FLAGS, cpu_downscale=("cpu_downscale_params_per_s", 1e9))
    rates, overridden = {}, []
    for flag, (key, scale) in flag_rates.items():
        value = getattr(args, flag)
        if value is not None:
            rates[key] = value * scale
            overridden.append("--" + flag.replace("_", "-"))
    try:
        return planning.plan(
            args.params, args.subgroup_size, args.gpu_mem, args.host_mem, args.margin, rates=rates,
            overridden=overridden, nvme_read=None if args.nvme_read is None else args.nvme_read * 1e9,
            nvme_write=None if args.nvme_write is None else args.nvme_write * 1e9,
            static_fraction=args.static_fraction, k=args.k, policy=args.policy)
    except ValueError as e:
        # A rate the PerfModel refuses came from one flag: name it, not the model's field.
        for flag, (key, _) in flag_rates.items():
            if f"rates.{key} " in str(e):
                raise UsageError(f"--{flag.replace('_', '-')}: {e}") from None
        raise


def _stride_text(p: Dict[str, Any], subgroups: int) -> str:
    """What the plan's stride k says; the planner gives k = 0 when no subgroup is streamed."""
    if p["k"] > 0:
        return f"k = {p['k']:.3f} (one in every k streamed subgroups updated on the GPU)"
    if p["static_residents"] == subgroups:
        where = "every subgroup stays on the GPU as a static resident"
    elif p["static_residents"] == 0:
        where = "every subgroup is updated on the CPU"
    else:
        where = f"the {subgroups - p['static_residents']} subgroups that are not static residents are updated on the CPU"
    return f"no stride k: no subgroup is streamed to the GPU, {where}"


def _print_plan(result: Dict[str, Any]) -> None:
    g, h, r = result["gpu"], result["host"], result["rates"]
    sizes = planning.subgroups(result["params"], result["subgroup_size"])
    last = "" if sizes[-1] == sizes[0] else f", last {format_count(sizes[-1])}"
    print(f"model     {format_count(result['params'])} params in {result['subgroups']} subgroups of "
          f"{format_count(result['subgroup_size'])}{last}")
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
              f"{format_duration_ns(p['predicted_update_s'] * 1e9):>9}  {format_duration_ns(p['bound_s'] * 1e9):>9}  "
              f"{format_count(p['throughput_params_per_s']) + ' params/s':>16}  {p['busiest']}{marker}")
    chosen = result["policies"][result["policy"]]
    print()
    print(f"{result['policy']}: {_stride_text(chosen, result['subgroups'])}, "
          f"{chosen['static_residents']} static resident(s), {chosen['gpu_slots']} GPU slot(s); predicted update "
          f"{format_duration_ns(chosen['predicted_update_s'] * 1e9)}, {format_count(chosen['throughput_params_per_s'])}"
          f" params/s; busiest resource: {chosen['busiest']}")


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        result = _plan(args)
    except planning.PlanError as e:
        error(e)
        return EXIT_FAILURE
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_plan(result)
    return 0


def add_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="plan the optimizer update phase (CPU/GPU placement of subgroups) with the PerfModel",
        description="Predicts the optimizer update phase for every policy (cpu, static, "
        "interleaved, auto) with memtide's PerfModel and prints the plans. " + planning.DEFAULTS_NOTE,
    )
    plan.add_argument("--params", type=param_count, default=20_000_000_000, metavar="N",
                      help="parameters this GPU's optimizer updates, e.g. 20e9 or 20B (default: 20B, GPT-NeoX-20B)")
    plan.add_argument("--subgroup-size", type=param_count, default=100_000_000, metavar="N",
                      help="parameters per optimizer subgroup (default: 100M, as in the paper)")
    plan.add_argument("--gpu-mem", type=positive_size, default=80 * 2**30, metavar="SIZE",
                      help="GPU memory, e.g. 80GiB (default: 80GiB)")
    plan.add_argument("--host-mem", type=positive_size, default=512 * 10**9, metavar="SIZE",
                      help="host memory for optimizer state, e.g. 512GB (default: 512GB)")
    plan.add_argument("--margin", type=size, default=2 * 2**30, metavar="SIZE",
                      help="GPU memory kept free: CUDA context, workspaces, fragmentation (default: 2GiB)")
    add_rate_flags(plan)
    plan.add_argument("--nvme-read", type=rate, default=None, metavar="GB/s",
                      help="the NVMe tier's read rate (memtide probe --nvme DIR); with --nvme-write, a model whose "
                      "state exceeds --host-mem is planned with the subgroups that do not fit on NVMe")
    plan.add_argument("--nvme-write", type=rate, default=None, metavar="GB/s", help="the NVMe tier's write rate")
    plan.add_argument("--cpu-downscale", type=rate_or_zero, default=None, metavar="G/s",
                      help="separate fp32->16-bit pass on the CPU, G params/s (D_c); 0 = fused into the step")
    plan.add_argument("--static-fraction", type=fraction, default=0.2, metavar="F",
                      help="GPU-resident share for the static policy (default: 0.2)")
    plan.add_argument("--k", type=stride, default=2.0, metavar="K",
                      help="stride for the interleaved policy: one in every K subgroups on the GPU (default: 2)")
    plan.add_argument("--policy", choices=POLICIES, default="auto",
                      help="the plan reported at the top level (default: auto); all are printed")
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    apply_ranges(plan)  # every numeric flag: its range checked and shown, from one table
    plan.set_defaults(func=_cmd_plan)

