"""One rank of the many-ranks tests (test_distributed.py runs it under torchrun, gloo on CPU).

Trains the same small model twice from the same start, under FSDP2 (``fully_shard`` on each block
and the root, uneven shards) or DDP: with TieredAdamW, and with torch.optim.AdamW driven the way
its users drive it (the loss scaled by hand and unscaled, ``clip_grad_norm_``, an inf on one rank
skipping the step on every rank). Two param groups, an LR scheduler, gradient accumulation. Rank 0
writes what it found as JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from memtide.optim import TieredAdamW

# fsdp2, fsdp2-mp (bf16 params, fp32 reduce), ddp or ddp-view (gradient_as_bucket_view)
WRAP, SCENARIO, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS, MICRO, SCALE = 5, 2, 1024.0
CLIP = 0.05 if SCENARIO.split("+")[0] in ("clip", "frozen") else None
EAGER = SCENARIO.endswith("+eager")  # updates during backward too
# At this step of the scaled scenario rank 1 meets an inf: under FSDP2 in one gradient element after
# the reduce-scatter (only that rank sees it: the ranks must agree to skip), under DDP in its input
# (the all-reduce spreads it to every rank).
INF_STEP = 2


FROZEN = SCENARIO.startswith("frozen")  # the first block frozen, and a side branch used on even steps only


class Net(torch.nn.Sequential):
    """The blocks in a row; in the frozen scenario also a side branch, which only even steps use
    (on odd steps its params have no gradient: torch.optim.AdamW leaves them, step count included)."""

    def __init__(self) -> None:
        # 61 and 13 rows do not divide by 2 (or 4) ranks: uneven shards, and an empty one at 4 ranks for the bias of 3.
        super().__init__(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 13), torch.nn.GELU(),
                         torch.nn.Linear(13, 3))
        if FROZEN:
            self.side = torch.nn.Linear(7, 3)
            self[0].requires_grad_(False)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        y = x
        for layer in self:
            if layer is not getattr(self, "side", None):
                y = layer(y)
        return y + self.side(x) if side else y


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def wrap(model: torch.nn.Module):
    if WRAP.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        world = dist.get_world_size()
        # HSDP: two replicas of the model, each sharded over half the ranks.
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if WRAP == "fsdp2-hsdp"
                else init_device_mesh("cpu", (world,)))
        # fp32 sharded params (what the optimizer sees), bf16 unsharded ones (what computes).
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if WRAP == "fsdp2-mp"
              else MixedPrecisionPolicy())
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        return fully_shard(model, mesh=mesh, mp_policy=mp)
    # Params without a gradient in a step: DDP must be told (it then reduces none for them).
    return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=WRAP == "ddp-view",
                                                     find_unused_parameters=FROZEN)


def groups(model: torch.nn.Module):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3}]


def no_sync(model, first: bool):
    if WRAP.startswith("fsdp2"):
        model.set_requires_gradient_sync(not first)
        return torch.enable_grad()
    return model.no_sync() if first else torch.enable_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class PythonHooks:
    """Counts the gradient path's Python hook calls (GradientPath.ready) while it is entered."""

    def __enter__(self):
        from memtide.optim.gradients import GradientPath

        self.calls, self._ready = 0, GradientPath.ready

        def counted(path, i, p):
            self.calls += 1
            return self._ready(path, i, p)

        GradientPath.ready = counted
        return self

    def __exit__(self, *exc):
        from memtide.optim.gradients import GradientPath

        GradientPath.ready = self._ready


def train(tiered: bool):
    if tiered:
        with PythonHooks() as hooks:
            out = _train(True)
        out["python_hooks"] = hooks.calls
        return out
    return _train(False)


def _train(tiered: bool):
    model = wrap(build())
    if tiered:
        opt = TieredAdamW(groups(model), lr=1e-2, policy="cpu", subgroup_size=64,
                          max_grad_norm=CLIP, loss_scale=None if CLIP is not None else SCALE,
                          update_during_backward=EAGER)
        if WRAP.startswith("ddp"):
            opt.register_ddp(model)
    else:
        opt = torch.optim.AdamW(groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    rank, skipped = dist.get_rank(), 0
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        for mb in range(MICRO):
            x = torch.randn(4, 7, generator=gen)
            if WRAP == "fsdp2-mp":
                x = x.to(torch.bfloat16)
            if WRAP.startswith("ddp") and CLIP is None and step == INF_STEP and rank == 1 and mb + 1 == MICRO:
                x[0, 0] = float("inf")
            with no_sync(model, mb + 1 < MICRO):
                loss = model(x, FROZEN and step % 2 == 0).float().square().mean()
                (opt.scale_loss(loss) if tiered else loss * (SCALE if CLIP is None else 1.0)).backward()
        if WRAP.startswith("fsdp2") and CLIP is None and step == INF_STEP and rank == 1:
            g = next(model.parameters()).grad
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
        if tiered:
            opt.step()
            skipped += opt.last_step_skipped
        else:
            params = [p for p in model.parameters() if p.grad is not None]
            if CLIP is None:
                for p in params:
                    p.grad.div_(SCALE)
                bad = torch.tensor([0.0 if all(torch.isfinite(full(p.grad)).all() for p in params) else 1.0])
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                if bad.item() > 0:
                    opt.zero_grad()
                    skipped += 1
                    sched.step()
                    continue
            else:
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
        sched.step()
        opt.zero_grad()
        if step == 0:
            first = [full(p) for p in model.parameters()]
    out = {"params": [full(p) for p in model.parameters()], "first": first, "skipped": skipped}
    if FROZEN:
        net = getattr(model, "module", model)  # DDP's inner model
        out["frozen_moved"] = max(float((full(p) - full(q)).abs().max())
                                  for p, q in zip(net[0].parameters(), build()[0].parameters()))
        # Updated on the even steps only: torch.optim.AdamW counts 3 of 5.
        out["side_steps"] = int(opt.state[net.side.weight]["step"])
    if tiered:
        out["host_bytes"] = opt.buffers.nbytes()
        out["numel"] = opt.layout.numel
        out["regathered"] = opt.stats.regathered
        out["native_reads"] = opt._reads is not None  # the step read its params natively (torch_reads)
        native = opt.gradient_path.native
        out["native_hooks"] = None if native is None else native.sent  # gradients its C++ hooks sent
        if opt._reads is not None:
            # What it reads is what Python reads: a DTensor's local shard, and its gradient's
            # (none after zero_grad; then one after another backward).
            out["reads_match"] = [reads_match(opt)]
            x = torch.randn(4, 7, generator=gen).to(torch.bfloat16 if WRAP == "fsdp2-mp" else torch.float32)
            model(x, False).float().square().mean().backward()
            out["reads_match"].append(reads_match(opt))
        if EAGER:
            stats = opt.backward_updates.native.stats
            out["eager"] = {"speculated": stats.speculated, "kept": stats.kept, "rolled_back": stats.rolled_back}
    return out


def reads_match(opt) -> bool:
    """Whether the step's native read of the params gives what Python reads of them."""
    from memtide.optim.distributed import local
    from memtide.optim.torch_reads import NO_GRAD

    ps, reads = opt.layout.params, opt._reads
    grads = [None if p.grad is None else local(p.grad) for p in ps]
    return (reads.read() and list(reads.data) == [local(p).data_ptr() for p in ps]
            and list(reads.version) == [local(p)._version for p in ps]
            and list(reads.grad_data) == [NO_GRAD if g is None else g.data_ptr() for g in grads]
            and list(reads.grad_version) == [NO_GRAD if g is None else g._version for g in grads])


def main() -> None:
    dist.init_process_group("gloo")
    mine, ref = train(True), train(False)
    diff = max(float((a - b).abs().max()) for a, b in zip(mine["params"], ref["params"]))
    first_diff = max(float((a - b).abs().max()) for a, b in zip(mine["first"], ref["first"]))
    moved = max(float((a - b).abs().max()) for a, b in zip(mine["params"], [full(p) for p in wrap(build()).parameters()]))
    # Every rank's own findings (its params against the reference's, its counters): the test reads
    # them all, not rank 0's alone.
    record = {"max_diff": diff, "moved": moved, "skipped": [mine["skipped"], ref["skipped"]],
              "numel": mine["numel"], "regathered": mine["regathered"], "eager": mine.get("eager"),
              "native_reads": mine["native_reads"], "reads_match": mine.get("reads_match"),
              "python_hooks": mine["python_hooks"], "native_hooks": mine["native_hooks"],
              "host_bytes": mine["host_bytes"], "first_diff": first_diff, "frozen_moved": mine.get("frozen_moved"),
              "side_steps": [mine.get("side_steps"), ref.get("side_steps")]}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        with open(OUT, "w") as f:
            json.dump({"world": dist.get_world_size(), "ranks": records}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
