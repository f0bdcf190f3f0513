"""One rank of the dying-rank tests (test_distributed.py): rank 1 leaves without a word
(``os._exit(0)``: torchrun sees a rank that finished, and waits for the others) and rank 0 must
fail by itself, within the process group's timeout, rather than wait forever.

    WHEN (argv[1]): "train", rank 1 leaves after two steps of FSDP2 training with TieredAdamW;
    "build", rank 1 leaves before building its TieredAdamW, so rank 0 waits for it at
    construction (where the ranks compare their settings).
The process group's timeout is argv[2] seconds. Rank 0 writes the error it got to rank0.txt in
the working directory and ends with status 1."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from memtide.optim import TieredAdamW

WHEN, TIMEOUT = sys.argv[1], float(sys.argv[2])


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if WHEN == "build" and rank == 1:
        os._exit(0)
    try:
        opt = TieredAdamW(model.parameters(), lr=1e-2, policy="cpu", max_grad_norm=1.0)
        for step in range(100):
            if WHEN == "train" and step == 2 and rank == 1:
                os._exit(0)
            model(torch.randn(4, 7)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        said = "no error"
    except Exception as e:  # noqa: BLE001 - whatever the survivor got is what the test reads
        said = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    if rank == 0:
        with open("rank0.txt", "w") as f:
            f.write(said)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if said == "no error" else 1)  # without destroy_process_group: a peer is gone


if __name__ == "__main__":
    main()
