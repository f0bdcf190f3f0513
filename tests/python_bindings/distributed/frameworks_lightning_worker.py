"""One rank of the PyTorch Lightning tests (test_frameworks.py): a LightningModule whose
configure_optimizers returns TieredAdamW (argv[1] "memtide") or torch.optim.AdamW ("torch"),
trained from the same start by ``Trainer(accelerator="cpu", devices=2, ...)`` launched by torchrun
(Lightning sees torchrun's environment and creates no processes of its own). argv[2] is the
strategy: "ddp" (DDPStrategy on gloo) or "fsdp2" (ModelParallelStrategy, Lightning's FSDP2:
``configure_model`` calls fully_shard on the 2-rank data-parallel mesh; Lightning's FSDPStrategy,
FSDP1, refuses accelerator="cpu"). Gradient accumulation, gradient clipping by the Trainer and a
per-step LR scheduler. Rank 0 saves what it found to argv[3] (torch.save)."""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from memtide.optim import TieredAdamW
from torchrun_rank import save_on_rank_zero

TIERED, STRATEGY, OUT = sys.argv[1] == "memtide", sys.argv[2], sys.argv[3]
STEPS, MICRO, BATCH = 10, 2, 8


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build()

    def configure_model(self) -> None:
        if STRATEGY == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        named = list(self.named_parameters())
        decay = [p for n, p in named if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in named if not (n.endswith("weight") and p.dim() > 1)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = (TieredAdamW(groups, lr=1e-2, weight_decay=0.1) if TIERED
               else torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * MICRO * BATCH * 2, 16, generator=gen)  # 2 ranks
    torch.manual_seed(2)
    with torch.no_grad():
        y = torch.nn.Linear(16, 8)(x)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def main() -> None:
    if STRATEGY == "ddp":
        strategy = "ddp"
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=MICRO,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, data())

    params = list(module.net.parameters())
    sharded = all(isinstance(p, DTensor) for p in params)
    opt = trainer.optimizers[0]
    assert type(opt) is (TieredAdamW if TIERED else torch.optim.AdamW), type(opt)
    out = {"params": [(p.full_tensor() if sharded else p).detach().clone() for p in params], "sharded": sharded,
           "start": [p.detach() for p in build().parameters()], "world": dist.get_world_size(),
           "global_step": trainer.global_step, "strategy": type(trainer.strategy).__name__,
           "device": str(trainer.strategy.root_device)}
    if TIERED:
        out.update(steps=opt.stats.steps, skipped=opt.stats.skipped)
    save_on_rank_zero(out, OUT)


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
