"""One rank of the sharded-checkpoint test (test_distributed.py): FSDP2 + TieredAdamW saved with
torch.distributed.checkpoint on one world size and resumed on another.

    LOAD SAVE OUT [KILLED]: loads the DCP checkpoint LOAD ("-": none, start at step 0; resharded
    to this world size), trains to step 5, saving model, optimizer and the next step to SAVE
    ("-": none) after the first step it trains. Rank 0 writes the final full params to OUT
    (torch.save). With KILLED, it saves again there after the second step, and rank 1 is killed
    (SIGKILL) in the middle of that save, its data written and the save not yet recorded.
Each step trains on the same global batch, split evenly among the ranks, so every world size
computes the same update."""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from memtide.optim import TieredAdamW

LOAD, SAVE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
KILLED = sys.argv[4] if len(sys.argv) > 4 else None


class DyingWriter(dcp.FileSystemWriter):
    """Writes as FileSystemWriter does; on rank 1 the process is killed once its data is written,
    before the coordinator (rank 0) has every rank's part and records the checkpoint."""

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201 - FileSystemWriter's signature
        written = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return written
GLOBAL_BATCH, STEPS = 8, 5


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 13), torch.nn.GELU(),
                                torch.nn.Linear(13, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = TieredAdamW(model.parameters(), lr=1e-2, policy="cpu", subgroup_size=64, max_grad_norm=0.05)

    def state():
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                "next_step": torch.zeros((), dtype=torch.int64)}

    start = 0
    if LOAD != "-":
        loaded = state()
        dcp.load(loaded, checkpoint_id=LOAD)
        set_model_state_dict(model, loaded["model"])
        set_optimizer_state_dict(model, opt, loaded["optim"])
        start = int(loaded["next_step"])
    for step in range(start, STEPS):
        x = torch.randn(GLOBAL_BATCH, 7, generator=torch.Generator().manual_seed(1000 + step))
        share = GLOBAL_BATCH // world
        model(x[rank * share:(rank + 1) * share]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == start and SAVE != "-":
            saved = state()
            saved["next_step"].fill_(step + 1)
            dcp.save(saved, checkpoint_id=SAVE)
        if step == start + 1 and KILLED is not None:
            saved = state()
            saved["next_step"].fill_(step + 1)
            dcp.save(saved, storage_writer=DyingWriter(KILLED))
            raise AssertionError("the save whose rank was killed went through")
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    if rank == 0:
        torch.save(params, OUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
