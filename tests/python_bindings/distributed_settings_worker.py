"""One rank of the disagreeing-ranks test (test_distributed.py): rank 1 builds its TieredAdamW
with another setting than rank 0 (argv[2] names which), under FSDP2 or DDP (argv[1]). Every rank
writes the error it got, or "no error", to rank<N>.txt in the working directory."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from memtide.optim import TieredAdamW

WRAP, SETTING = sys.argv[1], sys.argv[2]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Linear(9, 2))
    if WRAP == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    kwargs = {"policy": "cpu", "subgroup_size": 32}
    if SETTING == "whole_state":  # same settings; a whole (unsharded) moment is loaded
        opt = TieredAdamW(model.parameters(), **kwargs)
        model(torch.randn(3, 5)).sum().backward()
        opt.step()
        state = opt.state_dict()
        before = opt.buffers.exp_avg.clone()
        state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].full_tensor()
        try:
            opt.load_state_dict(state)
            said = "no error"
        except ValueError as e:
            said = str(e) + (" (state kept)" if torch.equal(before, opt.buffers.exp_avg) else " (state changed)")
        with open(f"rank{rank}.txt", "w") as f:
            f.write(said)
        dist.destroy_process_group()
        return
    if rank == 1:
        kwargs.update({"policy": {"policy": "auto"}, "subgroup_size": {"subgroup_size": 16},
                       "lr": {"lr": 0.5}}[SETTING])
    try:
        opt = TieredAdamW(model.parameters(), **kwargs)
        if WRAP == "ddp":
            opt.register_ddp(model)
        said = "no error"
    except ValueError as e:
        said = str(e)
    with open(f"rank{rank}.txt", "w") as f:
        f.write(said)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
