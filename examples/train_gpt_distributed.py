"""A GPT-style model trained on many ranks with TieredAdamW, under FSDP2 or DDP.

    torchrun --nproc-per-node 2 examples/train_gpt_distributed.py --wrap fsdp2
    torchrun --nproc-per-node 8 examples/train_gpt_distributed.py --wrap ddp --steps 100
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/train_gpt_distributed.py --wrap fsdp2

Runs unchanged on CPUs (gloo; memtide's simulated device) and on GPUs (NCCL, one per rank, the
rank's GPU picked by LOCAL_RANK). The model is defined here and the data is synthetic (arithmetic
sequences: learnable, so the loss falls within a few steps); nothing is downloaded. Each step
trains on one global batch split evenly among the ranks, so every world size computes the same
update. ``--optimizer torch`` trains with torch.optim.AdamW instead, for comparison; ``--save``
writes the final full parameters (rank 0) for a check against another run. ``--timeline
REPORT.html`` records memtide's timeline of the training steps on every rank (each writes
REPORT.rank<R>.html and REPORT.rank<R>.trace.jsonl); then

    memtide timeline REPORT.rank*.trace.jsonl -o REPORT.html

draws all ranks in one report, with lanes per rank on one time axis.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def batch(step: int, size: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 8, (size, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1], seqs[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wrap", choices=("fsdp2", "ddp"), default="fsdp2")
    ap.add_argument("--optimizer", choices=("memtide", "torch"), default="memtide")
    ap.add_argument("--policy", default="auto", help="TieredAdamW's policy (cpu, static, interleaved, auto)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--save", metavar="FILE", help="rank 0 writes the final full parameters here (torch.save)")
    ap.add_argument("--timeline", metavar="REPORT.html",
                    help="record memtide's timeline of the steps: each rank writes REPORT.rank<R>.html and "
                    "REPORT.rank<R>.trace.jsonl (memtide timeline REPORT.rank*.trace.jsonl -o REPORT.html merges them)")
    args = ap.parse_args()
    if args.steps < 1 or args.global_batch < 1:
        ap.error("--steps and --global-batch must be at least 1")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split evenly among {world} ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # every rank builds the same model
    model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq).to(device)
    if args.wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)

    if args.optimizer == "memtide":
        from memtide.optim import TieredAdamW

        opt = TieredAdamW(model.parameters(), lr=args.lr, policy=args.policy, subgroup_size=1 << 16,
                          max_grad_norm=args.max_grad_norm)
        if args.wrap == "ddp":
            opt.register_ddp(model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)

    share = args.global_batch // world
    recording = contextlib.nullcontext()
    if args.timeline:
        import memtide
        import memtide.timeline

        memtide.install_phase_hooks(model, opt)  # the forward, backward and update bands
        # Each rank records its own files, named by its rank (RANK, which torchrun sets).
        recording = memtide.timeline.record(args.timeline, opt if args.optimizer == "memtide" else None,
                                            wrap=args.wrap)
    t0 = time.perf_counter()
    with recording:
        train(args, model, opt, device, rank, world, share, t0)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for p in model.parameters()]
    if args.save and rank == 0:
        torch.save(params, args.save)


def train(args, model, opt, device, rank: int, world: int, share: int, t0: float) -> None:
    for step in range(args.steps):
        x, y = batch(step, args.global_batch, args.seq, args.vocab)
        x, y = x[rank * share:(rank + 1) * share].to(device), y[rank * share:(rank + 1) * share].to(device)
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if args.optimizer == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:4d}  loss {float(mean) / world:.4f}  {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
    # With the model, its device mesh and the optimizer gone (main's locals), the process group
    # ends here rather than during the interpreter's shutdown, where gloo's threads, freeing
    # the last collectives' tensors, could abort the process.
    import gc

    gc.collect()
    dist.destroy_process_group()
    # Even so, gloo's threads can abort the interpreter's own shutdown ("terminate called without
    # an active exception"): nothing is left to clean up, so leave without it.
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
