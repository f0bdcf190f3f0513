"""What ``memtide plan`` computes: one GPU's optimizer update phase under every policy, with the
memory the model leaves for it, on the PerfModel's rates.

The arithmetic lives here so that the CLI only parses flags and prints; the messages of
``PlanError`` name the ``memtide plan`` flags, which match this module's arguments.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from .. import _memtide
from .._memtide import format_bytes, format_count

# The PerfModel's figures: fp32 param, exp_avg and exp_avg_sq move between tiers; the fp32
# gradient joins them in host memory.
STATE_BYTES_PER_PARAM = _memtide.STATE_BYTES_PER_PARAM
HOST_STATE_BYTES_PER_PARAM = _memtide.STATE_BYTES_PER_PARAM + _memtide.GRAD_BYTES_PER_PARAM

# Where the defaults come from: the Deep Optimizer States testbed, per H100 (4 per node).
DEFAULTS_NOTE = (
    "defaults: the Deep Optimizer States H100 testbed, per GPU (PCIe Gen5 ~55 GB/s each way pinned; "
    "CPU update ~8 G params/s per node of 4 GPUs = 2 per GPU; host DRAM of one socket ~220 GB/s; "
    "80 GiB HBM3; 512 GB host memory); memtide fuses the fp32->16-bit downscale into the CPU step. "
    "Flags override."
)


class PlanError(Exception):
    """The machine cannot run the workload as asked."""


def subgroups(params: int, size: int) -> List[int]:
    """The subgroup sizes, cut as TieredAdamW cuts them (memtide._memtide.cut_subgroups): as many of
    `size` as fit, then the rest. PlanError beyond MAX_SUBGROUPS, naming the size that fits."""
    try:
        return [end - start for start, end in _memtide.cut_subgroups(params, size, "--subgroup-size")]
    except ValueError as e:
        raise PlanError(str(e)) from None


def plan(params: int, subgroup_size: int, gpu_mem: int, host_mem: int, margin: int, *,
         rates: Optional[Mapping[str, float]] = None, overridden: Sequence[str] = (),
         nvme_read: Optional[float] = None, nvme_write: Optional[float] = None,
         static_fraction: float = 0.2, k: float = 2.0, policy: str = "auto") -> Dict[str, Any]:
    """Plans the update phase of `params` parameters in subgroups of `subgroup_size` on one GPU of
    `gpu_mem` bytes (`margin` of them kept free) with `host_mem` bytes of host memory.

    `rates` overrides memtide.default_rates() (named in `overridden`, as the report says);
    `nvme_read`/`nvme_write` (bytes/s, both or neither) add an NVMe tier for the state that does
    not fit `host_mem`. Every policy is planned, each with its own knob (`static_fraction` for
    static, the stride `k` for interleaved; auto searches both); `policy` is the one reported at
    the top level. Raises PlanError when the machine cannot hold the workload.
    """
    rates = dict(_memtide.default_rates(), **(rates or {}))
    sizes = subgroups(params, subgroup_size)

    host_state = HOST_STATE_BYTES_PER_PARAM * params
    nvme = nvme_read is not None or nvme_write is not None
    if host_state > host_mem and not nvme:
        raise PlanError(
            f"the optimizer state of {format_count(params)} params needs {format_bytes(host_state)} of host "
            f"memory ({HOST_STATE_BYTES_PER_PARAM} B/param: fp32 params, exp_avg, exp_avg_sq, grads), but --host-mem "
            f"is {format_bytes(host_mem)}: plan with an NVMe tier (--nvme-read and --nvme-write, measured by "
            "memtide probe --nvme DIR)")
    if nvme and (nvme_read is None or nvme_write is None):
        raise PlanError("an NVMe tier needs both --nvme-read and --nvme-write (memtide probe --nvme DIR measures them)")
    if nvme:
        rates["nvme_read_bytes_per_s"] = nvme_read
        rates["nvme_write_bytes_per_s"] = nvme_write
    persistent = _memtide.GPU_MODEL_BYTES_PER_PARAM * params  # 16-bit params and grads, all iteration
    if persistent + margin > gpu_mem:
        raise PlanError(
            f"the 16-bit params and grads of {format_count(params)} params ({format_bytes(persistent)}) plus the "
            f"--margin ({format_bytes(margin)}) do not fit in --gpu-mem {format_bytes(gpu_mem)}: "
            f"the model needs a layer window (parameters offloaded too), which this planner does not cover")
    headroom = gpu_mem - persistent - margin
    # No iteration is measured here: slots and residents share the update headroom.
    fit = _memtide.fit_gpu_budget(sizes, headroom, headroom)
    slot_bytes, slots, static_limit = fit["slot_bytes"], fit["gpu_slot_limit"], fit["gpu_static_limit"]
    on_nvme = None
    if host_state > host_mem:
        try:
            on_nvme = _memtide.fit_host_budget(sizes, host_mem, gpu_static_limit=static_limit)
        except ValueError as e:
            raise PlanError(str(e)) from None
    spilled = sum(on_nvme) if on_nvme else 0

    policies = {}
    for name in _memtide.POLICIES:
        p = _memtide.plan_update(
            sizes, policy=name, rates=rates, static_fraction=static_fraction if name == "static" else 0.0,
            k=k if name == "interleaved" else None, gpu_slot_limit=slots, gpu_static_limit=static_limit,
            on_nvme=on_nvme)
        pred = p["prediction"]
        seconds = pred["total_ns"] / 1e9
        policies[name] = {
            "k": p["k"],
            "gpu_streamed": p["gpu_streamed"],
            "static_residents": p["static_residents"],
            "gpu_slots": p["gpu_slots"],
            "predicted_update_s": seconds,
            "bound_s": pred["bound_ns"] / 1e9,
            "throughput_params_per_s": params / seconds if seconds > 0 else 0.0,
            "busiest": pred["busiest"],
            "busy_s": {r: pred[f"{r}_ns"] / 1e9 for r in ("cpu", "gpu", "h2d", "d2h", "dram", "nvme")},
            "placement": p["placement"],
        }
    chosen = policies[policy]
    return {
        "params": params,
        "subgroups": len(sizes),
        "subgroup_size": subgroup_size,
        "policy": policy,
        "k": chosen["k"],
        "static_residents": chosen["static_residents"],
        "gpu_slots": chosen["gpu_slots"],
        "predicted_update_s": chosen["predicted_update_s"],
        "throughput_params_per_s": chosen["throughput_params_per_s"],
        "busiest": chosen["busiest"],
        "gpu": {
            "memory": gpu_mem, "persistent": persistent, "margin": margin, "headroom": headroom,
            "slot_bytes": slot_bytes, "slot_limit": slots, "static_limit": static_limit,
        },
        "host": {"memory": host_mem, "optimizer_state": host_state},
        "nvme": {"subgroups": spilled, "state_bytes": spilled * STATE_BYTES_PER_PARAM * subgroup_size,
                 "read_bytes_per_s": rates.get("nvme_read_bytes_per_s", 0),
                 "write_bytes_per_s": rates.get("nvme_write_bytes_per_s", 0)} if spilled else None,
        "rates": rates,
        "overridden": list(overridden),
        "defaults": DEFAULTS_NOTE,
        "policies": policies,
    }
