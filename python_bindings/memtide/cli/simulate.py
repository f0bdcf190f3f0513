"""``memtide simulate``: whole training iterations of a ZeRO-3 rank on the simulated device, ZeRO-3
offload against TwinFlow and memtide."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict

import memtide
from memtide._memtide import format_bytes, format_count

from ._common import (UsageError, add_rate_flags, apply_ranges, param_count, positive_int, positive_size, rate,
                      rate_or_zero, tflops, window_arg)
from .sim_inputs import SIM_GPUS, model_and_node, usage_error_for
from ._interrupt import finished, native
from .sim_trace import write_simulation_trace

_CONTENDERS = ("zero3_offload", "twinflow", "memtide")


def _simulate(args: argparse.Namespace) -> Dict[str, Any]:
    model, shape, node = model_and_node(args)
    results = {}
    failed = {}
    checkpoint = not args.no_checkpointing
    tokens = (args.seq or 2048) * (args.micro_batch or 1) * (args.micro_batches or 1)
    for name in _CONTENDERS:
        if not args.json:
            print(f"simulating {name}...", file=sys.stderr, flush=True)
        record = bool(args.timeline) and name == "memtide"  # its operations go into the trace
        try:
            # On a worker thread: one call simulates every iteration (minutes at the largest flags),
            # and Ctrl-C must not wait for it (cli/_interrupt.py).
            r = native(memtide.simulate_iteration, what=f"simulating {name}", quiet=args.json,
                       model=model, shape=shape or None, contender=name, node=node,
                       checkpointing=not args.no_checkpointing, iterations=args.iterations,
                       record_ops=record, window=args.window if name == "memtide" else None)
        except ValueError as e:
            # A node figure the simulator refuses came from one flag: name it, not the key.
            named = usage_error_for(e)
            if named is not None:
                raise named from None
            raise
        except MemoryError as e:
            # A contender that does not fit on the GPU (the baselines keep every parameter there;
            # memtide without the layer window too) is a result, not the end of the comparison:
            # say so and go on with the others. The allocator's advice (MEMTIDE_MEMORY_FRACTION,
            # batch size) is for real runs, not a simulated GPU: only what did not fit is kept.
            failed[name] = {"fits": False, "error": str(e).split("; allocated ")[0]}
            if not args.json:
                print(f"  {name} does not fit: {failed[name]['error']}", file=sys.stderr, flush=True)
            continue
        if record:
            recorded = r
        sim, pred = r["simulated"], r["predicted"]
        finished(f"{name} ({sim['iteration_s']:.2f} s per iteration)")
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
    if len(failed) == len(_CONTENDERS):  # none ran: the model's figures from its shape
        model_name, params, capacity = model or "custom", _params(model, shape), node["capacity_bytes"]
    results.update(failed)
    results = {name: results[name] for name in _CONTENDERS}
    out = {"model": model_name, "params": params, "shape": shape, "gpu": args.gpu, "node": node,
           "checkpointing": not args.no_checkpointing, "capacity_bytes": capacity,
           "window": results["memtide"].get("window"),
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


def _params(model, shape: Dict[str, int]) -> float:
    """The model's parameters as the simulator counts them (ModelShape::params), for a report in
    which no contender ran."""
    dims = {"vocab": 50304}
    dims.update(next((row for row in memtide.simulation_defaults()["models"] if row["name"] == model), {}))
    dims.update(shape)
    h = dims["hidden"]
    return dims["layers"] * (12 * h * h + 13 * h) + dims["vocab"] * h


def _simulation_trace(args: argparse.Namespace, r: Dict[str, Any]) -> Dict[str, Any]:
    """Writes the memtide contender's last simulated iteration (recorded) as a trace, then its report."""
    import memtide_timeline as timeline

    html_path = args.timeline
    files = timeline.companions(html_path)
    write_simulation_trace(args, r, files["trace"])
    return timeline.render(files["trace"], html_path, chrome=files["chrome"], png=files["png"])


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.update_sweep:
        from . import update_sweep

        return update_sweep.run(args)
    for flag in ("csv", "slots"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} belongs to --update-sweep")
    if any(getattr(args, f) is not None for f in ("nodes", "host", "topology", "placement")):
        from . import node_sim

        return node_sim.run(args)
    if args.timeline:
        import memtide_timeline as timeline

        try:
            timeline.check_report_target(args.timeline)  # before the simulation, not after
        except timeline.TraceError as e:
            raise UsageError(str(e)) from None
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
    print(f"model     {result['model']}: {format_count(result['params'])} params"
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
            if name != "memtide" and result["window"]:
                why = " without the layer window"
            elif name == "memtide" and not result["window"]:
                why = " (--window auto keeps only some blocks on the GPU)"
            else:
                why = ""
            print(f"{name:15}does not fit in {format_bytes(int(result['capacity_bytes']))}{why}")
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
        print(f"backward  memtide updated {format_count(mt['backward_update_params'])} params on the CPU during "
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


def add_parser(sub) -> None:
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
    sim.add_argument("--model", default=None, metavar="NAME",
                     help=f"a Table 2 model ({names}; default 20B), or custom with --layers --hidden --heads")
    for flag, what in (("layers", "transformer blocks"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("seq", "sequence length (default 2048)"), ("micro-batch", "micro-batch (default 1)"),
                       ("micro-batches", "micro-batches per step (default 1)"), ("vocab", "vocabulary (default 50304)")):
        sim.add_argument("--" + flag, type=positive_int, default=None, metavar="N", help=what)
    sim.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="N",
                     help="the ZeRO-3 data-parallel degree (default: 4, as in the paper; with --host or "
                     "--topology, the host's GPUs)")
    sim.add_argument("--gpu", choices=sorted(SIM_GPUS), default="h100", help="GPU figures (default: h100)")
    sim.add_argument("--gpu-mem", type=positive_size, default=None, metavar="SIZE", help="GPU memory")
    sim.add_argument("--gpu-flops", type=tflops, default=None, metavar="TFLOP/s", help="achieved dense bf16 FLOP/s")
    sim.add_argument("--link", type=rate, default=None, metavar="GB/s", help="collective bandwidth per GPU")
    sim.add_argument("--flush", type=rate, default=None, metavar="GB/s",
                     help="ZeRO-3's pageable gradient flush (default: 2.5, the paper's Figure 6)")
    add_rate_flags(sim)
    sim.add_argument("--subgroup-size", type=param_count, default=None, metavar="N",
                     help="parameters per optimizer subgroup (default: 100M)")
    sim.add_argument("--host-mem", type=positive_size, default=None, metavar="SIZE",
                     help="host memory per GPU for its rank's optimizer state (16 B/param of its shard); the "
                     "subgroups that do not fit live on NVMe (default: as much as the state needs)")
    sim.add_argument("--nvme-read", type=rate, default=None, metavar="GB/s",
                     help="the NVMe tier's read rate per GPU (memtide probe --nvme DIR; default: 3)")
    sim.add_argument("--nvme-write", type=rate, default=None, metavar="GB/s",
                     help="the NVMe tier's write rate per GPU (default: 2)")
    sim.add_argument("--window", type=window_arg, default=None, metavar="N|auto",
                     help="memtide only: the layer window (STRONGHOLD), keeping N blocks' parameters on the GPU and "
                     "the rest in host memory, or auto to size it from the modelled block times and the memory left "
                     "(default: every parameter on the GPU); the contenders that do not fit without it are reported "
                     "as such; with the node flags, each rank's window (auto: from its share of the host)")
    sim.add_argument("--updates-during-backward", action="store_true",
                     help="memtide only: update the subgroups its plan puts on the CPU as soon as their gradients are "
                     "home, while backward goes on (STRONGHOLD; speculative, with a saved copy, as clipping and loss "
                     "scaling need)")
    sim.add_argument("--no-checkpointing", action="store_true", help="keep every activation (the paper: checkpointing)")
    sim.add_argument("--iterations", type=positive_int, default=3, metavar="N",
                     help="iterations simulated; the last is reported (default: 3)")
    sim.add_argument("--timeline", metavar="REPORT.html",
                     help="also write memtide's simulated iteration as a trace (REPORT.trace.jsonl) and its "
                     "timeline report (REPORT.html, REPORT.chrome.json, and REPORT.png with matplotlib); with the node "
                     "flags, a trace per rank (REPORT.rank<R>.trace.jsonl) and one report with a lane per rank")
    sim.add_argument("--json", action="store_true", help="print JSON instead of text")
    node = sim.add_argument_group(
        "a whole node of ranks, and many nodes (any of these flags; docs/simulator.md, \"A node of ranks\")")
    node.add_argument("--nodes", type=positive_int, default=None, metavar="M",
                      help="nodes in the job: ZeRO-3 over M x --gpus-per-node ranks, collectives across nodes modelled "
                      "(default: 1)")
    node.add_argument("--host", default=None, metavar="NAME",
                      help="the node's host: 4xh100-2s (the paper's testbed), 8xh100-2s-switches (DGX-H100-like) "
                      "(default: --gpus-per-node GPUs on the paper's two sockets)")
    node.add_argument("--topology", default=None, metavar="FILE.xml",
                      help="the node's sockets and GPUs from an hwloc XML file (lstopo --of xml); rates from --host")
    node.add_argument("--placement", default=None, metavar="LIST",
                      help="where ranks' state and CPU threads go, compared: memtide (each GPU's socket), node0, "
                      "interleave, first_touch (default: all four)")
    node.add_argument("--inter-node", type=rate, default=None, metavar="GB/s",
                      help="each GPU's network bandwidth to other nodes, each way (default: 50, 400 Gb/s NDR)")
    node.add_argument("--inter-node-latency", type=rate_or_zero, default=None, metavar="US",
                      help="one hop of the inter-node ring, in microseconds (default: 5)")
    sweep = sim.add_argument_group("the update phase alone (--update-sweep)")
    sweep.add_argument("--update-sweep", action="store_true",
                       help="simulate the update phase alone: all-CPU, static 20%% and interleaved placement over a "
                       "sweep of the stride k, and the automatic plan against the best k, for the paper's Table 2 "
                       "models (or --model), with --gpus-per-node and --dram; a CSV row per phase, verdicts on stderr")
    sweep.add_argument("--csv", metavar="FILE", default=None, help="write the sweep's CSV to FILE (default: stdout)")
    sweep.add_argument("--slots", type=positive_int, default=None, metavar="N",
                       help="streamed subgroups in flight on the GPU in the sweep (default: 4)")
    apply_ranges(sim)  # every numeric flag: its range checked and shown, from one table
    sim.set_defaults(func=_cmd_simulate)

