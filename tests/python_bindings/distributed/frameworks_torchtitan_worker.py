"""One rank of the torchtitan test (test_frameworks.py), run by torchrun on gloo/CPU: torchtitan's
optimizer container (OptimizersContainer, built from its Config as torchtitan's Trainer builds it:
``config.optimizer.build(model_parts=...)``) naming TieredAdamW as the optimizer of its param
groups, over a tiny Llama 3 of torchtitan's own, parallelized (FSDP2 over 2 ranks) by its own
``parallelize_llama``, built and initialized as its Trainer does, with its LR scheduler container.
The same run with torch.optim.AdamW ("AdamW", torchtitan's default) from the same start comes
first in the same process (torchtitan here is a library, not a launcher: the loop is ours).

torchtitan's Trainer itself cannot run on CPU: torchtitan.tools.utils picks device_type "cuda"
when no accelerator is found, and Trainer.__init__ calls torch.cuda.set_device ("Found no NVIDIA
driver"). What its CPU path needs besides, each done by hand where it is said: the device mesh
on "cpu" and a gloo process group; SDPA attention (FlexAttention, the attention of its language
models, has no backward on CPU); FSDP's reduce-scatter as a plain SUM (torchtitan asks for
PREMUL_SUM, which gloo lacks); the model's sharding plan set by torchtitan's own function (its
Trainer's way, update_from_config, imports the Trainer and with it tensorboard, wandb and
datasets). Rank 0 saves what it found to argv[1] (torch.save)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as parallel_dims_module
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, \
    _output_linear_init, parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from memtide.optim import TieredAdamW
from torchrun_rank import save_on_rank_zero

OUT = sys.argv[1]
STEPS, BATCH, SEQ, VOCAB = 10, 2, 16, 64
PARALLELISM = ParallelismConfig()  # torchtitan's defaults: FSDP2 over all ranks (data_parallel_shard_degree -1)


class MemtideOptimizersContainer(OptimizersContainer):
    """torchtitan's way to a custom optimizer: its container knows "Adam", "AdamW" and "DistMuon"
    by name (OptimizersContainer._resolve_optimizer_factory); a subclass adds names, and its own
    Config (which every Configurable subclass must declare) builds it."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "TieredAdamW":
            return TieredAdamW
        return OptimizersContainer._resolve_optimizer_factory(name)


def optimizer_config(name: str) -> OptimizersContainer.Config:
    # torchtitan's default_adamw, with the norms' weights in a group of their own without decay.
    # Its default implementation ("fused") puts fused=True in every group: torch's fused AdamW
    # (which runs on CPU too) for the reference; TieredAdamW runs its own kernel whatever it says.
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    return MemtideOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r"norm", optimizer_name=name,
                                       optimizer_kwargs={**kwargs, "weight_decay": 0.0}),
                      ParamGroupConfig(pattern=r".*", optimizer_name=name,
                                       optimizer_kwargs={**kwargs, "weight_decay": 0.1})])


def model_config() -> Llama3Model.Config:
    dim, heads = 32, 4
    config = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(n_layers=2, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=64,
                                    rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ, theta=500000,
                                                            scaling="llama"),
                                    attn_backend="flex"))
    # FlexAttention has no backward on CPU: SDPA instead, as torchtitan's own graph_trainer tests
    # swap it in (experiments/graph_trainer/common_utils.py; causal, no per-document masks).
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # The sharding plan parallelize_llama follows, as torchtitan's Trainer sets it (through
    # Llama3Model.Config.update_from_config, which imports torchtitan.trainer and with it
    # tensorboard, wandb and datasets: not needed here, and not installed).
    set_llama3_sharding_config(config, enable_sp=PARALLELISM.enable_sequence_parallel)
    return config


def build(parallel_dims: ParallelDims) -> torch.nn.Module:
    """As torchtitan's Trainer: built on the meta device, parallelized, materialized, initialized."""
    with torch.device("meta"):
        model = model_config().build()
    # fp32 compute (the default MixedPrecisionPolicy computes in bf16): bit-level comparisons.
    model = parallelize_llama(model, parallel_dims=parallel_dims,
                              training=TrainingConfig(mixed_precision_param="float32"),
                              parallelism=PARALLELISM, compile_config=CompileConfig(), ac_config=None,
                              dump_folder="out")
    # torchtitan turns FSDP's gradient division off (it divides the loss by the global token count
    # itself): a reduce-scatter with ReduceOp.PREMUL_SUM(1.0), which gloo cannot do ("Cannot use
    # ReduceOp.PREMUL_SUM with Gloo"). FSDP2's own switch to a plain SUM, the same sums:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def train(name: str, parallel_dims: ParallelDims, start=None):
    model = build(parallel_dims)
    if start is not None:  # the same start as the reference
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)
    first = [p.detach().clone() for p in model.parameters()]
    optimizers = optimizer_config(name).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers, training_steps=STEPS)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own batch
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        optimizers.zero_grad()
        logits = model(tokens[:, :-1])
        # As torchtitan's Trainer: the sum over this rank's tokens divided by the global token count.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                 reduction="sum") / (BATCH * SEQ * dist.get_world_size())
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        schedulers.step()
    return model, optimizers, first


def full(params) -> list:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in params]


def main() -> None:
    dist.init_process_group("gloo")
    # torchtitan.tools.utils.device_type is "cuda" when torch finds no accelerator; ParallelDims
    # builds its device mesh with it (init_device_mesh("cuda", ...)). On CPU: "cpu".
    parallel_dims_module.device_type = "cpu"
    parallel_dims = ParallelDims.from_config(PARALLELISM, dist.get_world_size())
    parallel_dims.build_mesh()

    ref, ref_opts, start = train("AdamW", parallel_dims)
    mine, opts, first = train("TieredAdamW", parallel_dims, start)
    tiered = list(opts)
    out = {"world": dist.get_world_size(), "fsdp": parallel_dims.fsdp_enabled,
           "sharded": all(isinstance(p, DTensor) for p in mine.parameters()),
           "start": full(start), "first": full(first), "params": full(mine.parameters()),
           "ref": full(ref.parameters()), "types": [type(o).__name__ for o in tiered],
           "ref_types": [type(o).__name__ for o in ref_opts],
           "decays": sorted(g["weight_decay"] for o in tiered for g in o.param_groups),
           "steps": [o.stats.steps for o in tiered], "skipped": [o.stats.skipped for o in tiered]}
    save_on_rank_zero(out, OUT)


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
