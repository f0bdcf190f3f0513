"""``memtide simulate --nodes M / --host NAME / --topology FILE / --placement LIST``: every rank of a
node on its share of the host while the others run, memtide's NUMA placement against oblivious
ones, and many nodes joined by a modelled network (tiering::simulate_node, docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List

import memtide
from memtide._memtide import format_count

from ._common import UsageError
from .sim_inputs import model_and_node, usage_error_for

PLACEMENTS = ("memtide", "node0", "interleave", "first_touch")
CONTENDERS = ("zero3_offload", "twinflow", "memtide")
# The host's shares decide these per rank: a flag for them would be overridden, so it is refused.
_PER_RANK_RATES = ("h2d", "d2h", "cpu_update", "dram")


def _placements(text: str) -> List[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PLACEMENTS]
    if bad or not names:
        raise UsageError(f"--placement {text!r}: expected a comma-separated list of {', '.join(PLACEMENTS)}")
    if "memtide" not in names:
        names.insert(0, "memtide")  # the others are measured against it
    return list(dict.fromkeys(names))


def simulate(args: argparse.Namespace) -> Dict[str, Any]:
    """The node simulation as a dict (the --json output)."""
    for flag in _PER_RANK_RATES:
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} sets one rank's rate; with a node of ranks each rank's "
                             "share of the host decides it (give --host or --topology instead)")
    for flag in ("timeline", "window"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} is not available with a node of ranks yet")
    model, shape, node = model_and_node(args)
    gpus = node.pop("gpus")
    placements = _placements(args.placement) if args.placement is not None else list(PLACEMENTS)
    started = time.monotonic()
    try:
        r = memtide.simulate_node(model=model, shape=shape or None, node=node, checkpointing=not args.no_checkpointing,
                                  iterations=args.iterations, host=args.host, topology=args.topology, gpus=gpus,
                                  placements=placements, contenders=list(CONTENDERS))
    except ValueError as e:
        named = usage_error_for(e)
        if named is not None:
            raise named from None
        text = str(e)
        if text.startswith("host: gpus must be"):
            raise UsageError(f"--gpus-per-node: {text}") from None
        if text.startswith("host: topology"):
            raise UsageError(f"--topology: {text}") from None
        if text.startswith("host "):
            raise UsageError(f"--host: {text}") from None
        raise UsageError(text) from None
    except OSError as e:  # the topology file
        raise UsageError(f"--topology: {e}") from None
    if args.gpus_per_node is not None and args.gpus_per_node != r["gpus_per_node"]:
        raise UsageError(f"--gpus-per-node {args.gpus_per_node}: the host ({r['host']}) has {r['gpus_per_node']} GPUs")
    r["wall_s"] = time.monotonic() - started
    # Per placement: each contender's node iteration and memtide's speed-up over ZeRO-3 offload.
    table: Dict[str, Dict[str, Any]] = {}
    for run in r["runs"]:
        row = table.setdefault(run["placement"], {})
        slow = run["ranks"][run["slowest_rank"]]
        row[run["contender"]] = {"iteration_s": run["iteration_s"], "slowest_rank": run["slowest_rank"],
                                 "update_s": slow["simulated"]["update_s"], "collective_s": slow["collective_s"]}
    for row in table.values():
        row["speedup_memtide_over_zero3"] = row["zero3_offload"]["iteration_s"] / row["memtide"]["iteration_s"]
    r["placements"] = table
    r["collective_s"] = table["memtide"]["memtide"]["collective_s"]
    return r


def run(args: argparse.Namespace) -> int:
    if not args.json:
        print("simulating every rank of the node...", file=sys.stderr, flush=True)
    r = simulate(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    sockets = r["sockets"]
    print(f"model     {r['model']}: {format_count(r['params'])} params")
    print(f"node      {r['host']}: {len(sockets)} sockets ("
          + ", ".join(f"{s['cores']} cores, {s['dram_bytes_per_s'] / 1e9:.0f} GB/s DRAM" for s in sockets)
          + f"), {r['gpus_per_node']} GPUs (sockets " + " ".join(str(g[0]) for g in r["gpus"]) + ")"
          + (f"; {r['nodes']} nodes, ZeRO-3 over {r['nodes'] * r['gpus_per_node']} ranks" if r["nodes"] > 1 else ""))
    print(f"{'placement':13}{'zero3_offload':>15}{'twinflow':>10}{'memtide':>10}{'speed-up':>10}   slowest rank")
    for name, row in r["placements"].items():
        print(f"{name:13}{row['zero3_offload']['iteration_s']:14.2f}s{row['twinflow']['iteration_s']:9.2f}s"
              f"{row['memtide']['iteration_s']:9.2f}s{row['speedup_memtide_over_zero3']:9.2f}x   "
              f"{row['memtide']['slowest_rank']}")
    print("each rank under memtide (update phase, its share of the host, what capped its CPU update):")
    for run in r["runs"]:
        if run["contender"] != "memtide":
            continue
        for rank in run["ranks"]:
            s = rank["share"]
            print(f"  {run['placement']:12} GPU {s['gpu']} (socket {s['socket']}): update {rank['simulated']['update_s']:.3f} s; "
                  f"CPU {s['cpu_update_params_per_s'] / 1e9:.2f} G params/s on {s['cores']:.1f} cores, DRAM "
                  f"{s['host_dram_bytes_per_s'] / 1e9:.0f} GB/s, H2D {s['h2d_bytes_per_s'] / 1e9:.1f} GB/s; "
                  f"busiest: {s['busiest']}")
    print(f"collectives {r['collective_s']:.2f} s per iteration end to end (overlapping compute)"
          + (f", modelled as rings inside and across the {r['nodes']} nodes" if r["nodes"] > 1 else ""))
    print(f"simulated in {r['wall_s']:.2f} s")
    return 0
