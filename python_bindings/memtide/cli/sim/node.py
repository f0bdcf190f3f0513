"""``memtide simulate --nodes M / --host NAME / --topology FILE / --placement LIST``: every rank of a
node on its share of the host while the others run, memtide's NUMA placement against oblivious
ones, and many nodes joined by a modelled network (tiering::simulate_node, docs/simulator.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any, Dict, List

import memtide
from memtide._memtide import format_bytes, format_count

from .._common import FLAG_RANGES, NODE_GPUS_MAX, UsageError
from .._interrupt import native
from .inputs import model_and_node, usage_error_for

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
    if args.gpus_per_node is not None and args.gpus_per_node > NODE_GPUS_MAX and args.host is None \
            and args.topology is None:
        raise UsageError(f"--gpus-per-node: must be {FLAG_RANGES['gpus_per_node'].text}, got {args.gpus_per_node}")
    model, shape, node = model_and_node(args)
    gpus = node.pop("gpus")
    placements = _placements(args.placement) if args.placement is not None else list(PLACEMENTS)
    started = time.monotonic()
    runs: List[Dict[str, Any]] = []
    failed: Dict[str, str] = {}
    try:
        # One contender at a time: a baseline that does not fit on the GPU (they keep every
        # parameter there; --window lets memtide keep only some blocks) is a result, as with one rank.
        for contender in CONTENDERS:
            try:
                r = native(memtide.simulate_node, what=f"simulating the node ({contender})",  # Ctrl-C: cli/_interrupt.py
                           quiet=args.json, model=model, shape=shape or None, node=node,
                           checkpointing=not args.no_checkpointing, iterations=args.iterations, window=args.window,
                           host=args.host, topology=args.topology, gpus=gpus, placements=placements,
                           contenders=[contender])
            except MemoryError as e:
                if contender == "memtide":
                    raise
                failed[contender] = str(e).split("; allocated ")[0]
                if not args.json:
                    print(f"  {contender} does not fit: {failed[contender]}", file=sys.stderr, flush=True)
                continue
            runs += r["runs"]
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
    r["runs"] = sorted(runs, key=lambda run: (placements.index(run["placement"]), CONTENDERS.index(run["contender"])))
    # Per placement: each contender's node iteration and memtide's speed-up over ZeRO-3 offload.
    # (A contender that did not fit: {"fits": false, "error"} under every placement.)
    table: Dict[str, Dict[str, Any]] = {p: {name: {"fits": False, "error": failed.get(name)} for name in CONTENDERS}
                                        for p in placements}
    for run in r["runs"]:
        slow = run["ranks"][run["slowest_rank"]]
        table[run["placement"]][run["contender"]] = {
            "iteration_s": run["iteration_s"], "slowest_rank": run["slowest_rank"],
            "update_s": slow["simulated"]["update_s"], "collective_s": slow["collective_s"], "fits": True}
    for row in table.values():
        row["speedup_memtide_over_zero3"] = (row["zero3_offload"]["iteration_s"] / row["memtide"]["iteration_s"]
                                             if row["zero3_offload"]["fits"] else None)
    r["placements"] = table
    if args.window is not None:
        # The layer window is each rank's own: --window auto sizes it from the rank's share of the host.
        r["window"] = {"requested": args.window, "placements": {
            run["placement"]: [{"rank": rank, "window": x["window"], "window_why": x["window_why"],
                                "window_h2d_bytes": x["window_h2d_bytes"]} for rank, x in enumerate(run["ranks"])]
            for run in r["runs"] if run["contender"] == "memtide"}}
    r["collective_s"] = table["memtide"]["memtide"]["collective_s"]
    return r


# A rank's share of the host as simulate_node gives it to the rank's simulation (tiering::simulate_node):
# these rates replace the node's; the NVMe rates only where the host has drives for the rank.
_SHARE_RATES = ("cpu_update_params_per_s", "host_dram_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s")
_SHARE_NVME = ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s")


def _timeline(args: argparse.Namespace, r: Dict[str, Any]) -> Dict[str, Any]:
    """memtide's ranks under memtide's placement: one trace per rank, named by its rank as a job's
    ranks name theirs (REPORT.rank<R>.trace.jsonl, its header's rank and world_size), and one
    report of them all with a lane per rank (memtide._timeline.render_ranks, which draws a real
    job's ranks). simulate_node keeps no rank's operations, so each distinct rank is simulated again
    with record_ops on its share of the host: the same simulation, checked to give the same times."""
    from memtide import _timeline as timeline

    from .trace import write_simulation_trace

    model, shape, node = model_and_node(args)
    node["gpus"] = r["gpus_per_node"]
    mine = next(run for run in r["runs"] if run["placement"] == "memtide" and run["contender"] == "memtide")
    world = r["nodes"] * r["gpus_per_node"]  # the node simulated is node 0: its ranks are 0 to gpus_per_node - 1
    job = timeline.job_identity()  # one job: every rank's trace names the same
    recorded: Dict[Any, Dict[str, Any]] = {}
    traces = []
    for rank, result in enumerate(mine["ranks"]):
        share = result["share"]
        rates = {k: share[k] for k in _SHARE_RATES}
        rates.update({k: share[k] for k in _SHARE_NVME if share[k] > 0})
        key = tuple(sorted(rates.items()))
        if key not in recorded:
            recorded[key] = native(memtide.simulate_iteration, what=f"recording rank {rank}", quiet=args.json,
                                   model=model, shape=shape or None, contender="memtide", node=dict(node, **rates),
                                   checkpointing=not args.no_checkpointing, iterations=args.iterations,
                                   record_ops=True, window=args.window)
        again = recorded[key]
        if again["simulated"] != result["simulated"] or again["window"] != result["window"]:
            raise RuntimeError(f"memtide simulate --timeline: rank {rank} simulated again did not repeat its node "
                               f"simulation ({again['simulated']} against {result['simulated']})")
        trace = timeline.companions(timeline.rank_report(args.timeline, rank))["trace"]
        write_simulation_trace(args, again, trace, rank=rank, world_size=world, job=job, placement="memtide",
                               gpu=share["gpu"], socket=share["socket"], window=again["window"])
        traces.append(trace)
    files = timeline.companions(args.timeline)
    if len(traces) == 1:  # one GPU: its report alone (a report of ranks needs two)
        report = timeline.render(traces[0], args.timeline, chrome=files["chrome"], png=files["png"])
    else:
        report = timeline.render_ranks(traces, args.timeline, chrome=files["chrome"])
    return {"html": report["html"], "chrome": report.get("chrome"), "events": report["events"], "traces": traces}


def run(args: argparse.Namespace) -> int:
    if args.timeline:
        from memtide import _timeline as timeline

        try:
            timeline.check_report_target(args.timeline)  # before the simulation, not after
        except timeline.TraceError as e:
            raise UsageError(str(e)) from None
    if not args.json:
        print("simulating every rank of the node...", file=sys.stderr, flush=True)
    r = simulate(args)
    if args.timeline:
        r["timeline"] = _timeline(args, r)
        if not args.json:
            t = r["timeline"]
            print(f"timeline  {t['html']} ({t['events']:,} events, a lane per rank; traces "
                  f"{', '.join(t['traces'])}; Chrome trace {t['chrome']})", file=sys.stderr)
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
        cells = [(f"{row[c]['iteration_s']:.2f}s" if row[c]["fits"] else "no fit") for c in CONTENDERS]
        speedup = row["speedup_memtide_over_zero3"]
        print(f"{name:13}{cells[0]:>15}{cells[1]:>10}{cells[2]:>10}"
              f"{(f'{speedup:.2f}x' if speedup is not None else '-'):>10}   {row['memtide']['slowest_rank']}")
    for name in CONTENDERS:
        if not r["placements"]["memtide"][name]["fits"]:
            print(f"  {name} does not fit" + (" without the layer window" if r.get("window") else "")
                  + f": {r['placements']['memtide'][name]['error']}")
    print("each rank under memtide (update phase, its share of the host, what capped its CPU update):")
    for run in r["runs"]:
        if run["contender"] != "memtide":
            continue
        for rank in run["ranks"]:
            s = rank["share"]
            print(f"  {run['placement']:12} GPU {s['gpu']} (socket {s['socket']}): update {rank['simulated']['update_s']:.3f} s; "
                  f"CPU {s['cpu_update_params_per_s'] / 1e9:.2f} G params/s on {s['cores']:.1f} cores, DRAM "
                  f"{s['host_dram_bytes_per_s'] / 1e9:.0f} GB/s, H2D {s['h2d_bytes_per_s'] / 1e9:.1f} GB/s; "
                  f"busiest: {s['busiest']}"
                  + (f"; window {rank['window']} block(s), {format_bytes(int(rank['window_h2d_bytes']))} copied in"
                     if rank["window"] else "; no window" if r.get("window") else ""))
    if r.get("window"):  # how --window auto chose each rank's (ranks with one share chose alike)
        for placement, ranks in r["window"]["placements"].items():
            for why, group in itertools.groupby(ranks, key=lambda x: x["window_why"]):
                if why:
                    print(f"  window {placement} ranks {','.join(str(x['rank']) for x in group)}: {why}")
    print(f"collectives {r['collective_s']:.2f} s per iteration end to end (overlapping compute)"
          + (f", modelled as rings inside and across the {r['nodes']} nodes" if r["nodes"] > 1 else ""))
    print(f"simulated in {r['wall_s']:.2f} s")
    return 0
