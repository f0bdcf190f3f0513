"""One rank of the Hugging Face Trainer tests (test_frameworks.py): a user's script for
transformers.Trainer under torchrun, training a tiny random LlamaForCausalLM on a fixed synthetic
dataset with TieredAdamW (argv[1] "memtide") or torch.optim.AdamW ("torch") from the same start.
argv[2] says how the optimizer reaches the Trainer: "optimizers" (built by the user, with the
Trainer's weight-decay groups, and passed as ``optimizers=(opt, None)``) or "cls"
(``optimizer_cls_and_kwargs=(cls, kwargs)``: the Trainer builds it, with its groups). Trainer on
CPU under torchrun is Accelerate's MULTI_CPU: DistributedDataParallel on gloo, and the model moved
to "cpu:0" after the optimizer is built. Rank 0 saves what it found to argv[3] (torch.save)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_pt_utils import get_parameter_names

from memtide.optim import TieredAdamW
from torchrun_rank import save_on_rank_zero

TIERED, HOW, OUT = sys.argv[1] == "memtide", sys.argv[2], sys.argv[3]
STEPS, BATCH, MICRO, SEQ = 10, 2, 2, 16
LR, WEIGHT_DECAY = 1e-2, 0.1
# Trainer.get_decay_parameter_names' rule: no weight decay on biases and norms.
NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)  # 23k params, random


def dataset() -> list:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (STEPS * BATCH * MICRO * 2, SEQ), generator=gen)  # 2 ranks
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    optimizer = TieredAdamW if TIERED else torch.optim.AdamW
    model = build()
    args = TrainingArguments(output_dir="out", use_cpu=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=MICRO, learning_rate=LR, weight_decay=WEIGHT_DECAY,
                             max_grad_norm=1.0, report_to="none", save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, seed=0, dataloader_num_workers=0)
    if HOW == "optimizers":
        decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY))
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        opt = optimizer(groups, lr=LR, weight_decay=WEIGHT_DECAY)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(opt, None))
        assert decay == set(trainer.get_decay_parameter_names(model))
    else:
        trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                          optimizer_cls_and_kwargs=(optimizer, {"lr": LR, "weight_decay": WEIGHT_DECAY}))
    trainer.train()

    inner = trainer.optimizer.optimizer  # the AcceleratedOptimizer's
    assert type(inner) is optimizer, type(inner)
    decays = sorted(g["weight_decay"] for g in inner.param_groups)
    out = {"params": [p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()],
           "start": [p.detach() for p in build().parameters()], "world": dist.get_world_size(),
           "global_step": trainer.state.global_step, "decays": decays, "device": str(trainer.args.device),
           "wrapper": type(trainer.model_wrapped).__name__}
    if TIERED:
        out.update(steps=inner.stats.steps, skipped=inner.stats.skipped)
    save_on_rank_zero(out, OUT)


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
