"""One rank of the sharded save-while-training test (test_distributed.py): FSDP2 or HSDP +
TieredAdamW saved with TieredAdamW.save_checkpoint (each rank writes its shard as one part while
the steps go on) and resumed with load_checkpoint on another world size and wrapping.

    WRAP LOAD SAVE OUT: WRAP is "fsdp2" (a 1-D mesh of every rank) or "hsdp" (2 replicas of
    world/2 shards). Loads the checkpoint LOAD ("-": none, start at step 0), trains to step
    STEPS, asking for a save to SAVE ("-": none) after the first step it trains and waiting for
    it only at the end ("{rank}" in SAVE: each rank names its own path, which must fail). Rank 0
    writes the final full params to OUT (torch.save).
    With WRAP "fsdp2-torch" it builds torch.optim.AdamW instead, loads LOAD into it and the model
    with torch.distributed.checkpoint.load through memtide's CheckpointReader, and rank 0 writes
    the loaded params and state, whole, to OUT.
Each step trains on the same global batch, split evenly among the ranks, so every world size
computes the same update."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from memtide.optim import TieredAdamW

WRAP, LOAD, SAVE, OUT = sys.argv[1:5]
GLOBAL_BATCH, STEPS = 8, 5


def load_into_torch(model: torch.nn.Module) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from memtide.optim import CheckpointReader

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, storage_reader=CheckpointReader(LOAD, state["optim"], model_key="model"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    out = {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
           "exp_avg": [opt.state[p]["exp_avg"].full_tensor() for p in model.parameters()],
           "exp_avg_sq": [opt.state[p]["exp_avg_sq"].full_tensor() for p in model.parameters()],
           "step": [float(opt.state[p]["step"]) for p in model.parameters()],
           "lr": opt.param_groups[0]["lr"]}
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(out, OUT)
    dist.destroy_process_group()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if WRAP.startswith("fsdp2") else \
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 13), torch.nn.GELU(),
                                torch.nn.Linear(13, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if WRAP == "fsdp2-torch":
        load_into_torch(model)
        return
    opt = TieredAdamW(model.parameters(), lr=1e-2, policy="cpu", subgroup_size=64, max_grad_norm=0.05)

    start = 0
    if LOAD != "-":
        opt.load_checkpoint(LOAD)  # the params too: their fp32 values are the masters
        start = int(opt.state_dict()["state"][0]["step"])
    save = None
    for step in range(start, STEPS):
        x = torch.randn(GLOBAL_BATCH, 7, generator=torch.Generator().manual_seed(1000 + step))
        share = GLOBAL_BATCH // world
        model(x[rank * share:(rank + 1) * share]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == start and SAVE != "-":
            save = opt.save_checkpoint(SAVE.format(rank=rank))  # the steps below go on while it is written
    if save is not None:
        save.wait()
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    dist.barrier()  # every part is in (the last rank's wait commits the folder)
    if rank == 0:
        torch.save(params, OUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
