"""TieredAdamW's checkpoints: torch.optim.AdamW's state_dict layout over the engine's buffers,
checked whole before anything is loaded, and the masters re-read from the model; and checkpoints
saved while training goes on (save_async, read, load: a folder the engine's StateSnapshot writes)."""

from __future__ import annotations

import atexit
import io
import os
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _memtide
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
    finish_running_save(opt)  # it reads the buffers this overwrites
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
    finish_running_save(opt)  # it reads the masters this overwrites
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


# ---- saves while training goes on -----------------------------------------------------------------

FORMAT = 1


class AsyncSave:
    """A checkpoint being written while training goes on (TieredAdamW.save_checkpoint).

    The folder holds the state as it was when the save was asked for, whatever the steps since do:
    the engine keeps each subgroup's old state (a bounded copy, or a wait for the writer) until it
    is written. The folder appears whole when the save commits; until then a previous checkpoint
    at the same path stays as it was.
    """

    def __init__(self, snapshot: Any) -> None:
        self._snapshot = snapshot

    @property
    def path(self) -> str:
        return self._snapshot.target

    def wait(self) -> None:
        """Blocks until the checkpoint is committed. OSError when the save failed (a full disk,
        an I/O error, cancel()): the path then holds what it held before."""
        self._snapshot.wait()

    def done(self) -> bool:
        return bool(self._snapshot.progress()["done"])

    def cancel(self) -> None:
        """Stops the save and removes what it wrote; the path is left as it was."""
        self._snapshot.cancel()

    def progress(self) -> Dict[str, Any]:
        """bytes_total, bytes_written, elapsed_s, write_s (the writer's time in write calls),
        waited_s (time steps waited for the writer), copied_bytes, peak_buffer_bytes, buffer_bound
        (the copy-on-write buffer), done, committed, error."""
        return dict(self._snapshot.progress())

    def __repr__(self) -> str:
        p = self.progress()
        state = "committed" if p["committed"] else (f"failed: {p['error']}" if p["done"] else "running")
        return f"AsyncSave({self.path!r}, {p['bytes_written']}/{p['bytes_total']} bytes, {state})"


# Saves not yet over, whoever still holds their AsyncSave: the interpreter's exit waits for them.
# Without it a script that ends without save.wait() would lose its last checkpoint (the writer
# thread dies with the process, leaving the previous one and a partial folder).
_unfinished: set = set()
_unfinished_lock = threading.Lock()


@atexit.register
def _finish_saves_at_exit() -> None:
    with _unfinished_lock:
        saves = list(_unfinished)
        _unfinished.clear()
    for snapshot in saves:
        if snapshot.progress()["done"]:
            continue
        _memtide.log("info", f"checkpoint: waiting for the save to {snapshot.target} to finish before exiting")
        try:
            snapshot.wait()
        except OSError:
            pass  # logged by the save; the target is as it was


def finish_running_save(opt: Any) -> None:
    """Waits for a save still reading the buffers (before they are written outside a step). Its
    failure was logged and left the target as it was; it is not this caller's error."""
    running = opt.engine.running_save() if opt.engine is not None else None
    if running is not None:
        try:
            running.wait()
        except OSError:
            pass


def save_async(opt: Any, path: Any, buffer_bytes: int = 0) -> AsyncSave:
    who = "TieredAdamW.save_checkpoint"
    if not isinstance(path, (str, bytes, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{who}: path must be a non-empty path of the checkpoint folder, got {path!r}")
    if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 0:
        raise ValueError(f"{who}: buffer_bytes must be an int >= 0 (0: two of the largest subgroup), got {buffer_bytes!r}")
    if opt.engine is None:
        raise ValueError(f"{who}: the optimizer has no params with state to save")
    if opt.distribution.kind not in ("none", "ddp"):  # under DDP every rank holds the whole state
        raise NotImplementedError(
            f"{who}: the params here are {opt.distribution.kind} shards (each rank holds part of the state), "
            "which saves while training goes on do not cover yet: use "
            "torch.distributed.checkpoint.save({'optim': get_optimizer_state_dict(model, optimizer)})")
    if opt.spilled_subgroups:
        raise NotImplementedError(
            f"{who}: {opt.spilled_subgroups} subgroup(s) live on NVMe, which saves while training goes on do not "
            "cover yet: use torch.save(optimizer.state_dict())")
    packed = state_dict(opt)  # syncs the state (updates during backward rolled back, residents copied home)
    layout = opt.layout
    index = {id(p): i for i, p in enumerate(layout.params)}
    order = [p for g in opt.param_groups for p in g["params"]]
    ranges = {}
    skeleton = {}
    for idx, entry in packed["state"].items():
        i = index[id(order[idx])]
        lo, hi = layout.ranges[i]
        ranges[idx] = (lo, hi, tuple(local(layout.params[i]).shape))
        skeleton[idx] = {k: v for k, v in entry.items() if k not in ("exp_avg", "exp_avg_sq", "master_param")}
    meta = io.BytesIO()
    torch.save({"format": FORMAT, "numel": layout.numel, "ranges": ranges,
                "state_dict": {"state": skeleton, "param_groups": packed["param_groups"],
                               "memtide": packed["memtide"]}}, meta)
    snapshot = opt.engine.save_async(os.fspath(path), buffer_bytes, meta.getvalue())
    with _unfinished_lock:
        for s in [s for s in _unfinished if s.progress()["done"]]:
            _unfinished.discard(s)
        _unfinished.add(snapshot)
    return AsyncSave(snapshot)


def read(path: Any) -> Dict[str, Any]:
    """The checkpoint at `path` as a state dict of TieredAdamW's layout (torch.optim.AdamW's, with
    the fp32 params as "master_param"), every checksum checked first. Its tensors map the file
    (read-only, no copy in memory); load_state_dict copies them."""
    folder = os.fspath(path)
    manifest = _memtide.read_checkpoint_manifest(folder, True)
    meta_path = os.path.join(folder, manifest["meta"])
    try:
        meta = torch.load(meta_path, weights_only=True)
    except Exception as e:  # a file torch cannot read: name it, whatever torch raised
        raise OSError(f"checkpoint: {meta_path} cannot be read: {e}") from e
    n = manifest["params"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("numel") != n:
        raise OSError(f"checkpoint: {meta_path} does not describe the {n} params of {folder}")
    params, exp_avg, exp_avg_sq = _mapped(folder, manifest)
    sd = meta["state_dict"]
    state = {}
    for idx, entry in sd["state"].items():
        try:
            lo, hi, shape = meta["ranges"][idx]
            numel = 1
            for d in shape:
                numel *= int(d)
            ok = 0 <= lo <= hi <= n and numel == hi - lo
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise OSError(f"checkpoint: {meta_path} places param {idx} outside the {n} saved params")
        state[idx] = dict(entry, exp_avg=exp_avg[lo:hi].view(shape), exp_avg_sq=exp_avg_sq[lo:hi].view(shape),
                          master_param=params[lo:hi].view(shape))
    return {"state": state, "param_groups": sd["param_groups"], "memtide": sd["memtide"]}


def _mapped(folder: str, manifest: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checkpoint's params, exp_avg and exp_avg_sq: read-only tensors over the mapped file."""
    import numpy as np

    n = manifest["params"]
    flat = np.memmap(os.path.join(folder, manifest["data"]), dtype=np.float32, mode="r", shape=(3 * n,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only by design: loading copies
        t = torch.from_numpy(flat)
    return t[:n], t[n:2 * n], t[2 * n:]


@torch.no_grad()
def load(opt: Any, path: Any) -> None:
    folder = os.fspath(path)
    state = read(folder)  # every checksum checked first
    manifest = _memtide.read_checkpoint_manifest(folder, False)
    numel = opt.layout.numel if opt.engine is not None else 0
    if manifest["params"] != numel:
        raise ValueError(f"TieredAdamW.load_checkpoint: {folder} holds {manifest['params']} params, the optimizer "
                         f"has {numel}; nothing was loaded")
    load_state_dict(opt, state)
    if opt.engine is None:
        return
    # Every param takes its saved value, a param without optimizer state yet (saved before its
    # first step) too: the masters from the file, then the model's copies from them.
    layout, b = opt.layout, opt.buffers
    saved, _, _ = _mapped(folder, manifest)
    opt.host_changed()
    b.params.copy_(saved)
    for i, p in enumerate(layout.params):
        lo, hi = layout.ranges[i]
        if layout.lowp_of[i]:
            b.lowp[lo:hi].copy_(b.params[lo:hi])
            if not layout.aliased[i]:
                local(p).data.copy_(b.lowp[lo:hi].view(local(p).shape))
        elif not layout.aliased[i]:
            opt.distribution.write_back(p, b.params[lo:hi])
