"""What ``memtide simulate`` takes from its flags, for one rank and for a node of ranks alike: the
model, its shape and the node's figures, and the flag behind a figure the simulator refuses."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Tuple

import memtide

from .._common import RATE_FLAGS, UsageError

# GPUs the simulator knows: memory, the achieved FLOP/s of the model's kernels (a tenth of the dense
# bf16 peak, which makes ZeRO-3 reach the paper's ~30 TFLOP/s per H100 over whole iterations; see
# NodeSpec::gpu_flops), PCIe each way (pinned), collective bandwidth per GPU over NVLink.
SIM_GPUS = {
    "h100": {"capacity_bytes": 80 * 2**30, "gpu_flops": 100e12, "h2d_bytes_per_s": 55e9, "d2h_bytes_per_s": 55e9,
             "link_bytes_per_s": 300e9},
    "h200": {"capacity_bytes": 141 * 10**9, "gpu_flops": 100e12, "h2d_bytes_per_s": 55e9, "d2h_bytes_per_s": 55e9,
             "link_bytes_per_s": 300e9},
    "a100": {"capacity_bytes": 80 * 2**30, "gpu_flops": 31e12, "h2d_bytes_per_s": 25e9, "d2h_bytes_per_s": 25e9,
             "link_bytes_per_s": 200e9},
}


# The flags that set a node figure: flag -> (simulate_iteration's node key, scale).
NODE_FLAGS = dict(RATE_FLAGS, gpu_mem=("capacity_bytes", 1), gpu_flops=("gpu_flops", 1e12),
                  link=("link_bytes_per_s", 1e9), flush=("pageable_flush_bytes_per_s", 1e9),
                  subgroup_size=("subgroup_params", 1), host_mem=("host_budget_bytes", 1),
                  nvme_read=("nvme_read_bytes_per_s", 1e9), nvme_write=("nvme_write_bytes_per_s", 1e9),
                  nodes=("nodes", 1), inter_node=("inter_node_bytes_per_s", 1e9),
                  inter_node_latency=("inter_node_latency_s", 1e-6))


def model_and_node(args: argparse.Namespace) -> Tuple[Optional[str], Dict[str, int], Dict[str, Any]]:
    """The model (a Table 2 name or None for a custom shape), its shape overrides and the node's
    figures the flags give."""
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "micro_batch", "micro_batches", "vocab")
             if getattr(args, k) is not None}
    model = args.model if args.model is not None else "20B"
    if model.lower() == "custom":
        model = None
    if model is None and not {"layers", "hidden", "heads"} <= shape.keys():
        raise UsageError("--model custom needs --layers, --hidden and --heads")
    node = dict(SIM_GPUS[args.gpu])
    node["gpus"] = args.gpus_per_node or 4
    for flag, (key, scale) in NODE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            node[key] = value * scale
    if args.updates_during_backward:
        node["updates_during_backward"] = 1
    if "host_budget_bytes" in node:  # the report says which drive rates the NVMe tier ran at
        defaults = memtide.simulation_defaults()
        for key in ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
            node.setdefault(key, defaults[key])
    return model, shape, node


def usage_error_for(e: ValueError) -> Optional[UsageError]:
    """The flag behind a node figure the simulator refused, named instead of its key."""
    for flag, (key, _) in NODE_FLAGS.items():
        if str(e).startswith(f"node: {key} "):
            return UsageError(f"--{flag.replace('_', '-')}: {e}")
    if "host budget" in str(e):
        return UsageError(f"--host-mem: {e}")
    if "layer window" in str(e):
        return UsageError(f"--window: {e}")
    if " params in subgroups of " in str(e):  # more subgroups than the simulator keeps
        return UsageError(f"--subgroup-size: {e}")
    if " is not a multiple of heads " in str(e):
        return UsageError(f"--heads: {e}")
    return None
