"""``memtide simulate``: the command line of the iteration simulator (tools/simulator/README.md). This
module holds the subcommand's parser and sends each mode to its module: ``iteration`` (one rank,
the three contenders), ``node`` (a node of ranks, and many nodes), ``update_sweep`` (the update
phase alone); ``inputs`` turns the flags into the simulator's model and node, ``trace`` writes a
simulated iteration as a timeline trace. Every call into the simulator goes through the names
``memtide`` loads lazily from ``memtide._sim``, and only from this package."""

from __future__ import annotations

import argparse

import memtide

from .._common import (UsageError, add_rate_flags, apply_ranges, param_count, positive_int, positive_size, rate,
                       rate_or_zero, tflops, window_arg)
from .inputs import SIM_GPUS


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.update_sweep:
        from . import update_sweep

        return update_sweep.run(args)
    for flag in ("csv", "slots"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} belongs to --update-sweep")
    for flag in ("save_write", "save_buffer"):
        if getattr(args, flag) is not None and not args.save_checkpoint:
            raise UsageError(f"--{flag.replace('_', '-')} belongs to --save-checkpoint")
    if args.save_checkpoint and any(getattr(args, f) is not None for f in ("nodes", "host", "topology", "placement")):
        raise UsageError("--save-checkpoint simulates one rank; leave out the node flags")
    if any(getattr(args, f) is not None for f in ("nodes", "host", "topology", "placement")):
        from . import node

        return node.run(args)
    from . import iteration

    return iteration.run(args)


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
    sim.add_argument("--save-checkpoint", action="store_true",
                     help="memtide then saves each rank's optimizer state while training goes on "
                          "(TieredAdamW.save_checkpoint): iterations run beside the save until it is written")
    sim.add_argument("--save-write", type=rate, default=None, metavar="GB/s",
                     help="the save's disk rate per GPU (default: --nvme-write's, 2)")
    sim.add_argument("--save-buffer", type=positive_size, default=None, metavar="SIZE",
                     help="the save's copy-on-write buffer (default: two subgroups)")
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
