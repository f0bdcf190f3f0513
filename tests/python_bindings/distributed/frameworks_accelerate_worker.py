"""One rank of the Accelerate tests (test_frameworks.py): a training script as a user writes it for
Hugging Face Accelerate, with TieredAdamW (argv[1] "memtide") or torch.optim.AdamW ("torch") from
the same start. argv[2] "ddp": run under torchrun, ``Accelerator(cpu=True)`` is Accelerate's
MULTI_CPU set-up (DistributedDataParallel on gloo; prepare() moves the model to "cpu:0" after the
optimizer was built). argv[2] "fsdp2": run by ``accelerate launch --config_file`` with a config of
``distributed_type: FSDP`` and ``fsdp_version: 2`` (see accelerator() for what Accelerate does with
it on CPU). Rank 0 saves what it found to argv[3] (torch.save)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from memtide.optim import TieredAdamW
from torchrun_rank import save_on_rank_zero

TIERED, MODE, OUT = sys.argv[1] == "memtide", sys.argv[2], sys.argv[3]
STEPS, MICRO = 10, 2  # optimizer steps, micro-batches per step


def accelerator() -> Accelerator:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    if MODE == "fsdp2":
        # `accelerate launch --config_file` (distributed_type: FSDP, fsdp_version: 2) sets
        # ACCELERATE_USE_FSDP=true and the FSDP_* settings and launches through torchrun;
        # Accelerator() builds its FullyShardedDataParallelPlugin from them. But AcceleratorState
        # (accelerate/state.py) turns FSDP on only when the distributed type is MULTI_GPU, MULTI_NPU,
        # MULTI_XPU and the like: on CPU it is MULTI_CPU (Accelerator(cpu=True)) and the plugin is
        # dropped without a word (prepare() makes a DDP model); without cpu=True on a machine with
        # no accelerator it is NO (every rank trains by itself). Passing the plugin to
        # Accelerator(cpu=True, fsdp_plugin=...) is dropped the same way. The least hacky way to
        # Accelerate's FSDP2 on CPU: the plugin the launch configured, built as Accelerator() builds
        # it, and the distributed type set by hand where AcceleratorState sets it on GPUs (in
        # PartialState's shared state too: every AcceleratorState() made later, as
        # AcceleratedOptimizer makes one, copies it from there). Everything after this (prepare's
        # fully_shard, the param swap into the optimizer, accumulate, clip_grad_norm_) is
        # Accelerate's own FSDP2 path, the same as on GPUs.
        assert os.environ.get("ACCELERATE_USE_FSDP") == "true" and os.environ.get("FSDP_VERSION") == "2", \
            "launch with accelerate launch --config_file (fsdp_version: 2)"
        assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        assert acc.is_fsdp2
    return acc


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    # 2.4k params; a LayerNorm for the no-decay group.
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def main() -> None:
    acc = accelerator()
    model = build()
    # The user's script: weight decay on the Linear weights, none on biases and the LayerNorm.
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    optimizer = TieredAdamW if TIERED else torch.optim.AdamW
    opt = optimizer(groups, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    model, opt, sched = acc.prepare(model, opt, sched)

    gen = torch.Generator().manual_seed(100 + acc.process_index)  # each rank its own data
    torch.manual_seed(1)
    target = torch.nn.Linear(16, 8)  # what the model learns
    for _ in range(STEPS * MICRO):
        x = torch.randn(8, 16, generator=gen)
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()

    params = list(acc.unwrap_model(model).parameters())
    sharded = all(isinstance(p, DTensor) for p in params)
    params = [p.full_tensor() if sharded else p for p in params]
    out = {"params": [p.detach().clone() for p in params], "start": [p.detach() for p in build().parameters()],
           "world": dist.get_world_size(), "sharded": sharded, "is_fsdp2": acc.is_fsdp2,
           "distributed_type": str(acc.distributed_type), "wrapper": type(model).__name__, "device": str(acc.device)}
    if TIERED:
        inner = opt.optimizer  # AcceleratedOptimizer's
        out.update(steps=inner.stats.steps, skipped=inner.stats.skipped)
    save_on_rank_zero(out, OUT)


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
