"""``memtide run``: train a small GPT-style model with TieredAdamW (memtide.cli.train_job), or replay an
allocation trace through the caching allocator (``--trace``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any, Dict

import memtide
from . import train_job
from memtide._memtide import POLICIES, format_bytes, format_count, format_duration_ns
from .planning import STATE_BYTES_PER_PARAM

from ._common import UsageError, fraction, model_shape, positive_int, positive_size, stride, window_arg

#: The shell's code for a program ended by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130

_RUN_DEFAULTS = {
    "layers": 24,
    "hidden": 2048,
    "heads": 16,
    "seq": 2048,
    "batch": 4,
    "vocab": 50304,
    "iterations": 3,
}


def _print_run(result: Dict[str, Any], shape: Dict[str, int]) -> None:
    print(f"device    {result['device']} [{result['backend']}], {format_bytes(result['device_memory'])}, "
          f"allocator limit {format_bytes(result['limit'])}")
    print(f"model     {shape['layers']} layers, hidden {shape['hidden']}, heads {shape['heads']}, seq {shape['seq']}, "
          f"batch {shape['batch']}, vocab {shape['vocab']}: {format_count(result['params'])} parameters")
    print(f"replay    {shape['iterations']} iterations, {result['ops']} allocator ops in "
          f"{format_duration_ns(result['seconds'] * 1e9)} ({format_count(result['ops_per_second'])} ops/s)")
    print()
    print(f"last iteration   {'peak allocated':>15}  {'peak reserved':>15}  {'min free':>15}  {'wall time':>10}")
    for name, w in result["phases"].items():
        if not w["seen"]:
            continue
        print(f"  {name:<14} {format_bytes(w['peak_allocated']):>15}  {format_bytes(w['peak_reserved']):>15}  "
              f"{format_bytes(w['min_free']) if w['min_free'] is not None else '-':>15}  {format_duration_ns(w['duration_ns']):>10}")
    print()
    print(f"peak reserved / peak allocated   {result['reserved_over_allocated']:.3f}  "
          f"({format_bytes(result['peak_reserved'])} / {format_bytes(result['peak_allocated'])})")
    h = result["update_headroom"]
    basis = f"from {h['iterations_used']} finished iteration(s)" if h["from_history"] else "no finished iteration yet"
    print(f"update headroom until forward    {format_bytes(h['bytes'])}  "
          f"(limited by {h['limiting_phase']}, {basis}, margin {memtide.options()['headroom_margin']})")


def _cmd_run(args: argparse.Namespace) -> int:
    if args.trace and args.timeline:
        raise UsageError("--timeline records a training run; --trace replays a trace without one")
    return _cmd_replay(args) if args.trace else _cmd_train(args)


def _cmd_replay(args: argparse.Namespace) -> int:
    shape = model_shape(args, _RUN_DEFAULTS)
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
    shape = model_shape(args, train_job.TRAIN_DEFAULTS)
    if shape["hidden"] % shape["heads"]:
        raise UsageError(f"--hidden ({shape['hidden']}) must be a multiple of --heads ({shape['heads']})")
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
    if (args.host_budget is None) != (args.nvme_dir is None):
        raise UsageError("--host-budget and --nvme-dir go together: the state that does not fit the budget goes "
                          "to the folder")
    nvme = None if args.host_budget is None else {"host_budget": args.host_budget, "nvme_dir": args.nvme_dir}
    recorder = None  # device memory, the host and NVMe tiers (memtide.timeline.record)
    if args.timeline:
        from memtide import _timeline as timeline

        from memtide.timeline import Recorder

        try:
            recorder = Recorder(args.timeline, source="memtide run")  # a bad target is refused before training
        except timeline.TraceError as e:
            raise UsageError(str(e)) from None
        cupti = recorder.start()._cupti
        progress(f"timeline: CUPTI tracing {cupti['status']}" + (f" ({cupti['detail']})" if cupti["detail"] else ""))
    try:
        try:
            result = train_job.train(shape, device, args.policy, args.subgroup_size, args.k,
                                     args.gpu_static_fraction, progress, nvme=nvme,
                                     window=args.window or None,  # 0: none, as simulate
                                     update_during_backward=args.updates_during_backward,
                                     on_optimizer=recorder.watch if recorder else None)
        except BaseException:
            if recorder is not None:
                recorder.stop(write=False)  # nothing trained: no report
            raise
    except KeyboardInterrupt:
        # Before the first step: nothing to report (the spill folder goes at exit).
        progress("memtide run: interrupted (Ctrl-C) before training began")
        return EXIT_INTERRUPTED
    except (ValueError, OSError) as e:
        if nvme is None or not any(w in str(e) for w in ("host budget", "host_budget", "spill", "NVMe", "nvme")):
            raise
        raise UsageError(f"--host-budget/--nvme-dir: {e}") from None
    try:
        _report_train(args, result, progress, recorder)
    except KeyboardInterrupt:
        progress("memtide run: interrupted (Ctrl-C) while writing the report")
        return EXIT_INTERRUPTED
    if result["interrupted"]:
        progress(f"memtide run: interrupted (Ctrl-C) after {len(result['steps'])} of {shape['iterations']} steps; "
                 "the report above covers those")
        return EXIT_INTERRUPTED
    return 0


def _report_train(args: argparse.Namespace, result: Dict[str, Any], progress, recorder: Any) -> None:
    if recorder is not None:
        recorder.header["device"] = result["device"]["kind"]
        report = recorder.stop()
        result["timeline"] = {"html": report["html"], "trace": report["trace"], "memory_viz": report["memory_viz"],
                              "events": report["events"]}
        progress(f"timeline: {report['html']} ({report['events']:,} events; trace {report['trace']}, memory_viz "
                 f"pickle {report['memory_viz']})")
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        _print_train(result)


def _print_train(r: Dict[str, Any]) -> None:
    m, o, u = r["model"], r["optimizer"], r["update"]
    print()
    print(f"model     {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}, seq {m['seq']}, batch {m['batch']}, "
          f"vocab {m['vocab']}: {format_count(m['params'])} parameters ({m['dtype']})")
    if r["steps"]:
        first, last = r["steps"][0]["loss"], r["steps"][-1]["loss"]
        after = "" if r["final_loss"] is None else f"; after the last update {r['final_loss']:.4f}"
        print(f"loss      {first:.4f} -> {last:.4f} over {len(r['steps'])} steps (two batches, cycled){after}")
    else:
        print("loss      no step finished")
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
                  f"{format_bytes(w['min_free']) if w['min_free'] is not None else '-':>15}  {format_duration_ns(w['duration_ns']):>10}")
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
            print(f"  {name:<10} {format_duration_ns(phases[name]['duration_ns']):>10}  {host:>12}")
    print()
    where = "pinned" if o["pinned"] else "pageable (no CUDA)"
    lowp = f" + {o['low_precision']} param copy" if o["low_precision"] else ""
    print(f"optimizer {format_count(o['numel'])} params in {o['subgroups']} subgroups of "
          f"{format_count(o['subgroup_size'])}: fp32 params, exp_avg, exp_avg_sq, grads{lowp} = "
          f"{format_bytes(o['state_bytes'])}" + ("" if r.get("nvme") else " host"))
    arena = o.get("host_arena")
    if arena and r.get("nvme"):
        print(f"          {format_bytes(STATE_BYTES_PER_PARAM * r['nvme']['spilled_params'])} of it on NVMe; in host memory "
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
        print(f"nvme      {nv['spilled']} subgroups ({format_count(nv['spilled_params'])} params, "
              f"{format_bytes(STATE_BYTES_PER_PARAM * nv['spilled_params'])} of params and moments) on NVMe in {nv['file']}; the last "
              f"step read {format_bytes(int(last['read_bytes']))} and wrote {format_bytes(int(last['write_bytes']))} "
              f"(drive {nv['read_bytes_per_s'] / 1e9:.2f} GB/s read, {nv['write_bytes_per_s'] / 1e9:.2f} GB/s write); "
              f"staging {format_bytes(nv['staging_bytes'])}")
    print(f"plan      {r['plan']['summary']}")
    print(f"update    engine {o['engine']} ({o['cpu_isa']}, {o['cpu_threads']} threads): "
          f"{format_count(u['params_per_step'])} params in {format_duration_ns(u['engine_seconds_median'] * 1e9)} "
          f"= {format_count(u['engine_params_per_second'])} params/s (median of {u['steps_measured']} steps)")
    print(f"          whole step() with gradient gather and write-back: "
          f"{format_duration_ns(u['step_seconds_median'] * 1e9)} = {format_count(u['step_params_per_second'])} params/s")
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
        print(f"          update phase predicted {format_duration_ns(p * 1e9)} vs measured "
              f"{format_duration_ns(m * 1e9)} ({label}; {m / p:.2f}x)")
    print()
    print("the same update (trained state, last gradients) under each policy (wall time of the engine; "
          "then the update phase on the scheduler's clock):")
    for p in r["policies"]:
        print(f"  {p['plan']}")
        print(f"    {format_duration_ns(p['update_seconds'] * 1e9)} = {format_count(p['params_per_second'])} params/s, "
              f"state digest {p['digest']}")
        if p.get("phase_seconds") is not None and p.get("predicted_seconds") is not None:
            print(f"    update phase {format_duration_ns(p['phase_seconds'] * 1e9)} ({p['phase_clock']}), "
                  f"predicted {format_duration_ns(p['predicted_seconds'] * 1e9)}")
    if r["policies_identical"] is None:
        print("identical results under every policy: not compared (interrupted)")
        return
    same = "yes, bit for bit" if r["policies_identical"] else "NO: the policies disagree"
    print(f"identical results under every policy: {same}")


def add_parser(sub) -> None:
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
        run.add_argument(f"--{name}", type=positive_int, default=None, metavar="N",
                         help=f"{what} (default: {train_job.TRAIN_DEFAULTS[name]}; with --trace {trace_default})")
    run.add_argument("--policy", choices=POLICIES, default="auto",
                     help="TieredAdamW update policy for training (default: auto)")
    run.add_argument("--subgroup-size", type=positive_int, default=train_job.SUBGROUP_DEFAULT, metavar="N",
                     help=f"TieredAdamW subgroup size in parameters (default: {train_job.SUBGROUP_DEFAULT})")
    run.add_argument("--k", type=stride, default=None, metavar="K",
                     help="stride: one in every K subgroups updated on the GPU (interleaved, default 2; auto: "
                     "fixes it instead of the performance model)")
    run.add_argument("--gpu-static-fraction", type=fraction, default=0.0, metavar="F",
                     help="share of subgroups kept on the GPU (static, interleaved, auto; default 0)")
    run.add_argument("--host-budget", type=positive_size, default=None, metavar="SIZE",
                     help="host memory the optimizer state may take; what does not fit goes to --nvme-dir "
                     "(the model then trains in bf16 on the CPU too)")
    run.add_argument("--nvme-dir", default=None, metavar="DIR",
                     help="folder on an NVMe drive for the spilled state (a private folder is made in it)")
    run.add_argument("--window", type=window_arg, default=None, metavar="N|auto",
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
