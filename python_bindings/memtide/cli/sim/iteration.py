"""``memtide simulate`` without the node flags: whole training iterations of one ZeRO-3 rank on the
simulated device, ZeRO-3 offload against TwinFlow and memtide, and their report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict

import memtide
from memtide._memtide import format_bytes, format_count

from .._common import UsageError
from .._interrupt import finished, native
from .inputs import model_and_node, usage_error_for
from .trace import write_simulation_trace

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
        # Only memtide saves while training goes on (DeepSpeed and torch.save stop training).
        save = dict(save=True, save_write_bytes_per_s=(args.save_write or 0.0) * 1e9, save_buffer_bytes=args.save_buffer or 0) \
            if args.save_checkpoint and name == "memtide" else {}
        try:
            # On a worker thread: one call simulates every iteration (minutes at the largest flags),
            # and Ctrl-C must not wait for it (cli/_interrupt.py).
            r = native(memtide.simulate_iteration, what=f"simulating {name}", quiet=args.json,
                       model=model, shape=shape or None, contender=name, node=node,
                       checkpointing=not args.no_checkpointing, iterations=args.iterations,
                       record_ops=record, window=args.window if name == "memtide" else None, **save)
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
        if "save" in r:
            results[name]["save"] = r["save"]
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
    from memtide import _timeline as timeline

    html_path = args.timeline
    files = timeline.companions(html_path)
    write_simulation_trace(args, r, files["trace"])
    return timeline.render(files["trace"], html_path, chrome=files["chrome"], png=files["png"])


def _print_save(s: Dict[str, Any], alone_s: float) -> None:
    """The save beside training, against the iterations without it and a save that stops training."""
    its = s["iteration_s"]
    beside = ", ".join(f"{t:.2f} s" for t in its[:6]) + (f", ... ({len(its)} in all)" if len(its) > 6 else "")
    print(f"save      memtide saved each rank's optimizer state ({format_bytes(int(s['state_bytes']))} at "
          f"{s['write_bytes_per_s'] / 1e9:.1f} GB/s) in {s['save_s']:.1f} s while training went on: iterations "
          f"beside it {beside}, against {alone_s:.2f} s without (steps waited {sum(s['waited_s']):.2f} s; copied "
          f"aside {format_bytes(int(s['copied_bytes']))}, buffer peak {format_bytes(int(s['peak_buffer_bytes']))} of "
          f"{format_bytes(int(s['buffer_bound_bytes']))}); a save that stops training (torch.save, DeepSpeed) "
          f"stops it {s['state_bytes'] / s['write_bytes_per_s']:.1f} s")


def run(args: argparse.Namespace) -> int:
    if args.timeline:
        from memtide import _timeline as timeline

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
    if mt.get("save"):
        _print_save(mt["save"], mt["iteration_s"])
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
