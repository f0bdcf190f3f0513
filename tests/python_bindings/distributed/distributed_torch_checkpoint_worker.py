"""One rank of the torch-checkpoint test (test_torch_checkpoints.py): TieredAdamW's state saved the
ways torch users save torch.optim.AdamW's, under FSDP2, HSDP (two replicas of FSDP2 shards) or DDP
(argv[1]), then resumed.

- ``torch.save(opt.state_dict(), path)`` per rank, over an earlier checkpoint at that path, then
  loaded (``torch.load``) into a new TieredAdamW over an identically built model;
- ``torch.distributed.checkpoint`` (``get_state_dict``/``dcp.save``), loaded into
  ``torch.optim.AdamW`` through ``dcp.load``/``set_state_dict``; with argv[2] ``async``,
  ``dcp.async_save`` through memtide.optim.StateWriter while the original takes its two more
  steps (rank 0 also keeps the full state as it was asked for in asked.pt, for a load on one
  process).

Both resumed runs take two more steps beside the original's two more: each rank writes the
largest difference to rank<R>.json in the working folder."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from memtide.optim import StateWriter, TieredAdamW

WRAP = sys.argv[1]
ASYNC = sys.argv[2:] == ["async"]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    # 61 rows over 2 ranks: uneven shards, each state tensor starting inside the flat buffers.
    model = torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 3))
    if WRAP in ("fsdp2", "hsdp"):
        world = dist.get_world_size()
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if WRAP == "hsdp"
                else init_device_mesh("cpu", (world,)))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return DistributedDataParallel(model)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, 7, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def params(model: torch.nn.Module):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    opt = TieredAdamW(model.parameters(), lr=1e-2, subgroup_size=64)
    train(model, opt, 3, seed=0)

    path = f"opt.rank{rank}.pt"
    with open(path, "wb") as f:
        f.write(b"an earlier checkpoint")
    torch.save(opt.state_dict(), path)
    saved = torch.load(path, weights_only=True)
    start = params(model)
    # torch.save's file, into a new TieredAdamW over the same start.
    again = build()
    again.load_state_dict(model.state_dict())
    resumed = TieredAdamW(again.parameters(), lr=1e-2, subgroup_size=64)
    resumed.load_state_dict(saved)

    if ASYNC:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, opt, options=full)
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, "asked.pt")
        msd, osd = get_state_dict(model, opt)
        group = dist.new_group(backend="gloo")  # the save's collectives apart from training's
        # A buffer of one subgroup: the steps below copy one and wait for the writer for the rest.
        writer = StateWriter("dcp", opt, buffer_bytes=12 * 64)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id="dcp", storage_writer=writer,
                                process_group=group)
        train(model, opt, 2, seed=10)
        future.result()
        assert writer.progress()["committed"], writer.progress()
        # What this rank's writer did not write (DDP: DCP has one rank write each replicated
        # tensor) was let go: the bytes it kept, and the optimizer's elements.
        kept = (writer.progress()["bytes_total"], opt.layout.numel)
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id="dcp")

    # DCP's checkpoint, into torch.optim.AdamW.
    theirs = build()
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    msd, osd = get_state_dict(theirs, reference)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id="dcp")
    set_state_dict(theirs, reference, model_state_dict=state["model"], optim_state_dict=state["optim"])

    if not ASYNC:
        train(model, opt, 2, seed=10)
    train(again, resumed, 2, seed=10)
    train(theirs, reference, 2, seed=10)
    out = {"kept": kept if ASYNC else None, "moved": diff(params(model), start), "torch_save": diff(params(again), params(model)),
           "dcp_into_torch": diff(params(theirs), params(model)), "keys": sorted(saved["param_groups"][0])}
    with open(f"rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
