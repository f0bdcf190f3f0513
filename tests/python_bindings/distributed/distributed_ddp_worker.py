"""One rank of the DDP-without-register_ddp test (test_distributed.py), 2 ranks under torchrun, gloo
on CPU. Each scenario trains a small model under DistributedDataParallel with TieredAdamW and,
from the same start, with torch.optim.AdamW (clipping, two param groups, an LR scheduler,
gradient accumulation under no_sync), the way frameworks that wrap DDP themselves drive it:

- auto: nobody calls register_ddp; TieredAdamW finds the DDP model at its first forward. Calling
  register_ddp afterwards with the same model does nothing;
- auto+eager: the same with updates during backward (without clipping, so that they stand);
- auto-inner: DDP's own call is bypassed (``ddp.forward(x)``): found at the first module inside;
- own-hook: the user registered a communication hook of their own first: it stays, one warning;
- builtin-hook: the same with one of DDP's built-in hooks;
- explicit: register_ddp before training; a second call with the same model does nothing;
- explicit-own-hook: register_ddp on a model with a hook of its own is refused, naming it;
- not-mine: a second TieredAdamW over a model outside DDP is left alone;
- collected: an optimizer dropped before any forward is collected, its watch with it.

Every rank writes what it found as JSON to rank<N>.json in the working directory."""

from __future__ import annotations

import gc
import json
import warnings
import weakref
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.nn.modules import module as torch_module
from torch.nn.parallel import DistributedDataParallel as DDP

from memtide.optim import TieredAdamW

STEPS, MICRO, CLIP = 4, 2, 0.05


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 13), torch.nn.GELU(),
                               torch.nn.Linear(13, 3))


def groups(model: torch.nn.Module):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3}]


def wrap(scenario: str) -> DDP:
    model = DDP(build())
    if scenario == "own-hook" or scenario == "explicit-own-hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    elif scenario == "builtin-hook":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    return model


def train(scenario: str, tiered: bool) -> Dict[str, Any]:
    model = wrap(scenario)
    clip = None if scenario == "auto+eager" else CLIP
    out: Dict[str, Any] = {}
    if tiered:
        opt = TieredAdamW(groups(model), lr=1e-2, policy="cpu", subgroup_size=64, max_grad_norm=clip,
                          update_during_backward=scenario == "auto+eager")
        if scenario.startswith("explicit"):
            try:
                opt.register_ddp(model)
                out["register"] = "no error"
            except ValueError as e:
                out["register"] = str(e)
    else:
        opt = torch.optim.AdamW(groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for mb in range(MICRO):
                x = torch.randn(4, 7, generator=gen)
                with model.no_sync() if mb + 1 < MICRO else torch.enable_grad():
                    y = model.forward(x) if scenario == "auto-inner" and step == 0 and mb == 0 else model(x)
                    y.square().mean().backward()
            if not tiered and clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            if tiered and step == 0:
                out["found_at_first_forward"] = opt.distribution.ddp is not None
    out["params"] = [p.detach().clone() for p in model.parameters()]
    if tiered:
        out["warnings"] = [str(w.message) for w in caught if "TieredAdamW" in str(w.message)]
        out["found"] = opt.distribution.ddp is not None
        out["regathered"] = opt.stats.regathered
        out["watching"] = opt.__dict__.get("ddp_watch") is not None
        if scenario in ("auto", "explicit"):
            try:
                opt.register_ddp(model)  # the same model again: nothing happens
                out["register_again"] = "no error"
            except ValueError as e:
                out["register_again"] = str(e)
        if scenario == "auto+eager":
            out["eager_kept"] = opt.backward_updates.native.stats.kept
    return out


def not_mine() -> Dict[str, Any]:
    """Two optimizers: one over the DDP model, one over a model outside it."""
    model, other = DDP(build()), torch.nn.Linear(3, 2)
    opt = TieredAdamW(model.parameters(), policy="cpu")
    alone = TieredAdamW(other.parameters(), policy="cpu")
    model(torch.randn(2, 7)).sum().backward()
    other(torch.randn(2, 3)).sum().backward()
    found = {"mine": opt.distribution.ddp is not None, "other": alone.distribution.ddp is not None,
             "other_watching_before_step": alone.__dict__.get("ddp_watch") is not None}
    opt.step()
    alone.step()
    other(torch.randn(2, 3))  # the first module call after its first step ends its watch
    found["other_watching_after_step"] = alone.__dict__.get("ddp_watch") is not None
    found["hooks_left"] = len(torch_module._global_forward_pre_hooks)
    return found


def collected() -> Dict[str, Any]:
    """An optimizer dropped before any forward: collected, its global hook gone, DDP untouched."""
    before = len(torch_module._global_forward_pre_hooks)
    model = DDP(build())
    opt = TieredAdamW(model.parameters(), policy="cpu")
    watching = len(torch_module._global_forward_pre_hooks) - before
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    model(torch.randn(2, 7)).sum().backward()
    return {"watching": watching, "alive": ref() is not None,
            "hooks_left": len(torch_module._global_forward_pre_hooks) - before,
            "ddp_hooks": len(model._comm_hooks)}


def main() -> None:
    dist.init_process_group("gloo")
    out: Dict[str, Any] = {}
    for scenario in ("auto", "auto+eager", "auto-inner", "own-hook", "builtin-hook", "explicit",
                     "explicit-own-hook"):
        mine, ref = train(scenario, True), train(scenario, False)
        start = [p.detach() for p in build().parameters()]
        mine["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(mine.pop("params"), ref["params"]))
        mine["moved"] = max(float((a - b).abs().max()) for a, b in zip(ref["params"], start))
        out[scenario] = mine
    out["not-mine"] = not_mine()
    out["collected"] = collected()
    out["hooks_at_end"] = len(torch_module._global_forward_pre_hooks)
    with open(f"rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from torchrun_rank import run_and_exit

    run_and_exit(main)
