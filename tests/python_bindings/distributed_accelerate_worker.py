"""One rank of the Accelerate test (test_distributed.py): Hugging Face Accelerate's FSDP2 set-up
(``FullyShardedDataParallelPlugin(fsdp_version=2)``, ``accelerator.prepare(model, optimizer, scheduler)``)
trains a small model with TieredAdamW (argv[1] "memtide") or torch.optim.AdamW ("torch"), from
the same start. Accelerate's prepare builds the sharded params after the optimizer and swaps them
into its param groups. Two param groups, gradient accumulation (``accelerator.accumulate``), an
LR scheduler and clipping. Rank 0 saves what it found to argv[2] (torch.save). One optimizer per
launch: Accelerate prepares one model per process under FSDP2."""

from __future__ import annotations

import sys
from typing import Any, Dict

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from memtide.optim import TieredAdamW

TIERED, OUT = sys.argv[1] == "memtide", sys.argv[2]
STEPS, MICRO, CLIP = 4, 2, 0.05


def accelerator() -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=100)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    # Accelerate turns FSDP on for accelerators only (GPUs and the like); on CPU it stops at plain
    # multi-process (gloo). Its FSDP2 path is the same code on either: turned on by hand here.
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    # 61 and 13 rows do not divide by 2 ranks: uneven shards. The two larger Linears get their own
    # fully_shard (size-based wrap), the last one is the root's.
    return torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 13), torch.nn.GELU(),
                               torch.nn.Linear(13, 3))


def train(acc: Accelerator, tiered: bool) -> Dict[str, Any]:
    model = build()
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3}]
    opt = (TieredAdamW(groups, lr=1e-2, policy="cpu", subgroup_size=64, max_grad_norm=CLIP) if tiered
           else torch.optim.AdamW(groups, lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, prepared, sched = acc.prepare(model, opt, sched)
    gen = torch.Generator().manual_seed(100 + acc.process_index)
    for _ in range(STEPS * MICRO):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(4, 7, generator=gen)).square().mean())
            if not tiered and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            prepared.step()
            sched.step()
            prepared.zero_grad()
    out = {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
           "sharded": all(isinstance(p, DTensor) for p in model.parameters()), "world": dist.get_world_size()}
    if tiered:
        out.update(numel=opt._layout.numel, regathered=opt.stats.regathered, steps=opt.stats.steps,
                   same_params={id(p) for p in opt._layout.params} == {id(p) for p in model.parameters()})
    return out


def main() -> None:
    out = train(accelerator(), TIERED)
    out["start"] = [p.detach() for p in build().parameters()]
    if TIERED:
        numel = torch.tensor([out["numel"]])
        sizes = [torch.zeros_like(numel) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, numel)
        out["numel_per_rank"] = [int(s) for s in sizes]
    if dist.get_rank() == 0:
        torch.save(out, OUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
