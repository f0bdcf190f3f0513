"""``memtide simulate --update-sweep``: the update phase alone on the simulated device, all-CPU,
static 20% and interleaved over a sweep of the stride k, and the automatic plan against the best k
(tools/simulator/include/memtide/simulator/update_sweep.hpp). Writes one CSV row per simulated phase
and a verdict per model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, TextIO

import memtide
from memtide._files import SHARED, FileRefused, open_output

from .._common import UsageError
from .._interrupt import native

COLUMNS = ("model", "params", "shard_params", "subgroups", "policy", "k", "statics", "slots", "gpu_fraction",
           "grads", "update_s", "predicted_s", "bound_s", "throughput_gps", "speedup_vs_cpu", "cpu_busy_s",
           "gpu_busy_s", "h2d_busy_s", "d2h_busy_s", "h2d_d2h_overlap_s", "wall_ms")
# printf-style formats, as the committed results were written.
_FORMATS = {"params": ".4g", "k": ".6g", "gpu_fraction": ".3f", "throughput_gps": ".3f", "speedup_vs_cpu": ".3f",
            "wall_ms": ".1f"}
_SECONDS = {"update_s", "predicted_s", "bound_s", "cpu_busy_s", "gpu_busy_s", "h2d_busy_s", "d2h_busy_s",
            "h2d_d2h_overlap_s"}
# The iteration flags that say nothing to the update phase alone.
_NOT_HERE = ("layers", "hidden", "heads", "seq", "micro_batch", "micro_batches", "vocab", "gpu_mem", "gpu_flops",
             "link", "flush", "h2d", "d2h", "cpu_update", "gpu_update", "subgroup_size", "host_mem", "nvme_read",
             "nvme_write", "window", "timeline")


def _cell(row: Dict[str, Any], column: str) -> str:
    value = row[column]
    if column in _FORMATS:
        return format(value, _FORMATS[column])
    if column in _SECONDS:
        return format(value, ".4f")
    return str(value)


def write_csv(rows: List[Dict[str, Any]], out: TextIO) -> None:
    out.write(",".join(COLUMNS) + "\n")
    for row in rows:
        out.write(",".join(_cell(row, c) for c in COLUMNS) + "\n")


def run(args: argparse.Namespace) -> int:
    given = [name for name in _NOT_HERE if getattr(args, name, None) not in (None, False)]
    given += ["updates_during_backward"] if args.updates_during_backward else []
    given += ["no_checkpointing"] if args.no_checkpointing else []
    if given:
        raise UsageError("--update-sweep simulates the update phase alone; --" + given[0].replace("_", "-")
                         + " does not apply to it")
    dram = args.dram * 1e9 if args.dram is not None else 220e9
    models = [args.model] if args.model is not None else []
    slots = args.slots if args.slots is not None else 4
    try:
        sweep = native(memtide.simulate_update_sweep, what="sweeping the update phase", quiet=args.json,
                       host_dram_bytes_per_s=dram, gpus=args.gpus_per_node or 4,
                                              gpu_slots=slots, models=models)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(sweep, indent=2))
        return 0
    if args.csv and args.csv != "-":
        try:  # the whole file or none: a failed run leaves an earlier CSV as it was
            with open_output(args.csv, mode=SHARED) as f:
                write_csv(sweep["rows"], f)
        except FileRefused as e:
            raise UsageError(f"--csv: {e}") from None
        except OSError as e:
            raise UsageError(f"--csv {args.csv}: {e.strerror or e}") from None
    else:
        write_csv(sweep["rows"], sys.stdout)
    print(f"phantom SimDevice: host DRAM {dram / 1e9:.0f} GB/s per GPU, {slots} slots, {args.gpus_per_node or 4} GPUs, "
          "100M-param subgroups", file=sys.stderr)
    misses = 0
    for v in sweep["verdicts"]:
        ok = v["within_tolerance"]
        misses += not ok
        print(f"{v['model']:5} grads on {v['grads']:4} cpu {v['cpu_s']:.3f} s  static20 {v['static20_s']:.3f} s  "
              f"best swept k={v['best_k']:g} {v['best_s']:.3f} s ({v['cpu_s'] / v['best_s']:.2f}x vs cpu, "
              f"{v['static20_s'] / v['best_s']:.2f}x vs static20)  plan k={v['plan_k']:.4g}: predicted "
              f"{v['plan_predicted_s']:.3f} s, simulated {v['plan_s']:.3f} s = {v['plan_s'] / v['best_s']:.3f}x best "
              f"-> {'within' if ok else 'MISSES'} {sweep['tolerance'] * 100:.0f}%", file=sys.stderr)
    # Not an error exit: the CSV is complete either way; the verdicts say how the plan did.
    if misses:
        print(f"{misses} plan(s) missed the {sweep['tolerance'] * 100:.0f}% criterion", file=sys.stderr)
    return 0
