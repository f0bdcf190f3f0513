"""One rank of the disagreeing-ranks tests (test_distributed.py). In one launch it tries every case
in turn, each with a fresh model and optimizer: the ranks that differ (rank 1 of 2; under HSDP the
second replica, ranks 2 and 3 of 4) build their TieredAdamW with another setting, or over other
params, than the others. argv[1] picks the launch:

- "pairs" (2 ranks): every case under FSDP2 (refused at construction), DDP with register_ddp
  (refused there) and DDP without it (refused at the first forward, when TieredAdamW finds the DDP
  model that holds its params), plus a whole (unsharded) moment loaded under FSDP2;
- "hsdp" (4 ranks): HSDP (a 2x2 mesh: replicate, shard) where the two replicas differ.

Each case catches its ValueError, so the next one runs (the agreement goes through the store, not
a collective). Every rank writes {"<wrap>/<case>": what it got (the error, or "no error")} as JSON
to rank<N>.json in the working directory."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from memtide.optim import LossScaler, TieredAdamW

MODE = sys.argv[1]
BASE = {"policy": "cpu", "subgroup_size": 32}

# case: (what every rank passes on top of BASE, what the ranks that differ pass instead)
SETTINGS: Dict[str, Callable[[], Any]] = {
    "same": lambda: ({"update_during_backward": True, "loss_scale": "dynamic", "max_grad_norm": 1.0,
                      "subgroup_size": 2}, {}),  # uneven shards: 23 and 20 subgroups under FSDP2
    "policy": lambda: ({}, {"policy": "auto"}),
    "subgroup_size": lambda: ({}, {"subgroup_size": 16}),
    "lr": lambda: ({}, {"lr": 0.5}),
    "weight_decay": lambda: ({}, {"weight_decay": 0.1}),
    "betas": lambda: ({}, {"betas": (0.8, 0.999)}),
    "eps": lambda: ({}, {"eps": 1e-6}),
    "max_grad_norm": lambda: ({}, {"max_grad_norm": 1.0}),
    "loss_scale": lambda: ({"loss_scale": "dynamic"}, {"loss_scale": 1024.0}),
    "growth_interval": lambda: ({"loss_scale": "dynamic"}, {"loss_scale": LossScaler(growth_interval=100)}),
    "host_budget": lambda: ({"host_budget": "64GiB"}, {"host_budget": "32GiB"}),
    "update_during_backward": lambda: ({}, {"update_during_backward": True}),
    "k": lambda: ({"policy": "interleaved"}, {"k": 4}),
    "gpu_static_fraction": lambda: ({"policy": "static"}, {"gpu_static_fraction": 0.5}),
}
# Cases on the params: the second group's key, a param left out, the extra param (a module of its
# own, sharded like the model under FSDP2, outside DDP's model under DDP) of another shape or dtype.
PARAMS = ["group_key", "left_out", "shape", "dtype"]


def mesh(wrap: str):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if wrap == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def attempt(wrap: str, case: str, differ: bool) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Linear(9, 2))
    shape = (3, 4) if case == "shape" and differ else (4, 3)
    dtype = torch.bfloat16 if case == "dtype" and differ else torch.float32
    extra = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    if wrap in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        m = mesh(wrap)
        model = fully_shard(model, mesh=m)
        extra = fully_shard(extra, mesh=m)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    common, other = SETTINGS[case]() if case in SETTINGS else ({}, {})
    kwargs = {**BASE, **common, **(other if differ else {})}
    params: List[torch.nn.Parameter] = list(model.parameters())
    if case == "left_out" and differ:
        params = params[:-1]
    extra_group: Dict[str, Any] = {"params": list(extra.parameters()), "weight_decay": 0.0}
    if case == "group_key":
        extra_group["tag"] = "other" if differ else "no_decay"
    try:
        opt = TieredAdamW([{"params": params}, extra_group], **kwargs)
        if wrap == "ddp":
            opt.register_ddp(model)
        elif wrap == "ddp-auto":
            model(torch.randn(3, 5))  # TieredAdamW finds the DDP model here
            if opt.distribution.ddp is None:
                return "no error, and no DDP found"
        return "no error"
    except ValueError as e:
        return str(e)


def whole_state() -> str:
    """Same settings under FSDP2; a whole (unsharded) moment is loaded: refused, state kept."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Linear(9, 2)), mesh=mesh("fsdp2"))
    opt = TieredAdamW(model.parameters(), **BASE)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    state = opt.state_dict()
    before = opt.buffers.exp_avg.clone()
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].full_tensor()
    try:
        opt.load_state_dict(state)
        return "no error"
    except ValueError as e:
        return str(e) + (" (state kept)" if torch.equal(before, opt.buffers.exp_avg) else " (state changed)")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    said: Dict[str, str] = {}
    if MODE == "pairs":
        for wrap in ("fsdp2", "ddp", "ddp-auto"):
            for case in [*SETTINGS, *PARAMS]:
                said[f"{wrap}/{case}"] = attempt(wrap, case, differ=rank == 1)
        said["fsdp2/whole_state"] = whole_state()
    else:  # the second replica (ranks 2, 3: the mesh's second row) differs from the first
        for case in ("same", "weight_decay", "shape", "left_out"):
            said[f"hsdp/{case}"] = attempt("hsdp", case, differ=rank >= world // 2)
    with open(f"rank{rank}.json", "w") as f:
        json.dump(said, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
