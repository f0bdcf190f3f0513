"""TieredAdamW's checkpoints: torch.optim.AdamW's state_dict layout over the engine's buffers,
checked whole before anything is loaded, and the masters re-read from the model."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .arguments import check_state_dict
from .distributed import local
from .loss_scale import LossScaler


def state_dict(opt: Any) -> Dict[str, Any]:
    opt.sync_state()
    packed = torch.optim.Optimizer.state_dict(opt)
    layout = opt.layout
    index = {id(p): i for i, p in enumerate(layout.params)}
    state = {}
    order = [p for g in opt.param_groups for p in g["params"]]
    for idx, entry in packed["state"].items():
        entry = dict(entry)
        i = index[id(order[idx])]
        if layout.lowp_of[i]:
            lo, hi = layout.ranges[i]
            p = layout.params[i]
            entry["master_param"] = opt.distribution.wrap(p, opt.buffers.params[lo:hi].view(local(p).shape))
        state[idx] = entry
    packed["state"] = state
    packed["memtide"] = {"format": 1, "loss_scaler": None if opt.scaler is None else opt.scaler.state_dict()}
    return packed


def load_state_dict(opt: Any, state_dict: Dict[str, Any]) -> None:
    entries, groups, scaler_state = check_state_dict(state_dict, opt.param_groups, "TieredAdamW.load_state_dict")
    if opt.backward_updates is not None:
        opt.backward_updates.rollback()
    layout = opt.layout
    index = {id(p): i for i, p in enumerate(layout.params)}
    if opt.engine is not None:
        entries = _apart_from(opt.buffers, entries)
        # Everything is known good from here on.
        opt.wait_for_copies()
        if opt.spilled_subgroups:
            opt.sync_state()  # spilled ranges in host memory, so that what is written here counts
        opt.host_changed()
        # The model is the truth for fp32 params and the fallback for fp16/bf16 ones (a state
        # dict of torch.optim.AdamW has no master params); saved masters replace it below.
        opt.sync_master_from_model()
        b = opt.buffers
        steps = torch.from_dlpack(opt.engine.steps())
        with torch.no_grad():
            b.exp_avg.zero_()
            b.exp_avg_sq.zero_()
            steps.zero_()
            for p, exp_avg, exp_avg_sq, step, master in entries:
                i = index[id(p)]
                lo, hi = layout.ranges[i]
                b.exp_avg[lo:hi].copy_(local(exp_avg).reshape(-1))
                b.exp_avg_sq[lo:hi].copy_(local(exp_avg_sq).reshape(-1))
                steps[i] = float(step)
                if master is not None:
                    b.params[lo:hi].copy_(local(master).reshape(-1))
                    if layout.lowp_of[i]:
                        b.lowp[lo:hi].copy_(b.params[lo:hi])
                        if not layout.aliased[i]:
                            local(p).data.copy_(b.lowp[lo:hi].view(local(p).shape))
    for values, group in zip(groups, opt.param_groups):
        group.update(values)
    if scaler_state is not None:
        if opt.scaler is None:
            opt.scaler = LossScaler()
        opt.scaler.load_state_dict(scaler_state)
    opt.state.clear()
    opt.expose_state()
    if opt.spilled_subgroups:
        opt.engine.spill_host(layout.numel)  # back within the host budget now


def _apart_from(buffers: Any, entries: List[Tuple[Any, ...]]) -> List[Tuple[Any, ...]]:
    """The entries with every tensor that is a view of the optimizer's own buffers copied: the
    dict may be this optimizer's own state_dict(), or one torch.distributed.checkpoint loaded in
    place into it, and loading zeroes the buffers before it reads the entries."""
    # By address range, not by storage: a DTensor's local tensor may lie on a slice of a buffer's
    # storage (distributed.like).
    own = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
           for t in (buffers.params, buffers.exp_avg, buffers.exp_avg_sq, buffers.lowp) if t is not None]

    def apart(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        t = local(t)
        start = t.untyped_storage().data_ptr()
        end = start + t.untyped_storage().nbytes()
        return t.clone() if any(start < hi and lo < end for lo, hi in own) else t

    return [(p, apart(exp_avg), apart(exp_avg_sq), step, apart(master))
            for p, exp_avg, exp_avg_sq, step, master in entries]


@torch.no_grad()
def sync_master_from_model(opt: Any) -> None:
    if opt.engine is None:
        return
    opt.wait_for_copies()
    if opt.spilled_subgroups:
        opt.sync_state()  # the moments of spilled subgroups must be there beside the new params
    opt.host_changed()
    layout, b = opt.layout, opt.buffers
    for i, p in enumerate(layout.params):
        lo, hi = layout.ranges[i]
        if layout.lowp_of[i]:
            if not layout.aliased[i]:
                b.lowp[lo:hi].copy_(local(p).detach().reshape(-1))
            b.params[lo:hi].copy_(b.lowp[lo:hi])
        elif not layout.aliased[i]:
            b.params[lo:hi].copy_(local(p).detach().reshape(-1))
