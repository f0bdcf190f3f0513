"""TieredAdamW's checkpoints: torch.optim.AdamW's state_dict layout over the engine's buffers,
checked whole before anything is loaded, and the masters re-read from the model; and checkpoints
saved while training goes on (save_async, read, load: a folder the engine's StateSnapshot writes,
or, for sharded params, a folder of parts, one per shard, loadable on any number of ranks)."""

from __future__ import annotations

import atexit
import io
import os
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _memtide
from .arguments import check_state_dict
from .distributed import is_dtensor, local
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
    packed["memtide"] = _memtide_entry(opt)
    return packed


def _memtide_entry(opt: Any) -> Dict[str, Any]:
    return {"format": 1, "loss_scaler": None if opt.scaler is None else opt.scaler.state_dict()}


def load_state_dict(opt: Any, state_dict: Dict[str, Any], then: Optional[Callable[[], None]] = None) -> None:
    """TieredAdamW.load_state_dict. `then` (load_checkpoint's masters) runs once the entries are in,
    while every spilled subgroup is still in host memory: one spill at the end, not two."""
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
    if then is not None and opt.engine is not None:
        then()
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

# 2: every param's place (its range in the buffers, its shape, its global shape and offset), so
# that a checkpoint saved on some ranks loads on any others.
FORMAT = 2


class AsyncSave:
    """A checkpoint being written while training goes on (TieredAdamW.save_checkpoint).

    The folder holds the state as it was when the save was asked for, whatever the steps since do:
    the engine keeps each subgroup's old state (a bounded copy, or a wait for the writer) until it
    is written. The folder appears whole when the save commits; until then a previous checkpoint
    at the same path stays as it was. For sharded params each rank's save writes its part, and
    the folder appears once every part is in: wait() on every rank.
    """

    def __init__(self, snapshot: Any, path: str) -> None:
        self._snapshot = snapshot  # None: an HSDP replica whose shard another replica writes
        self._path = path

    @property
    def path(self) -> str:
        return self._snapshot.target if self._snapshot is not None else self._path

    def wait(self) -> None:
        """Blocks until this process's save is committed. OSError when it failed (a full disk,
        an I/O error, cancel()): the path then holds what it held before."""
        if self._snapshot is not None:
            self._snapshot.wait()

    def done(self) -> bool:
        return bool(self.progress()["done"])

    def cancel(self) -> None:
        """Stops the save and removes what it wrote; the path is left as it was."""
        if self._snapshot is not None:
            self._snapshot.cancel()

    def progress(self) -> Dict[str, Any]:
        """bytes_total, bytes_written, elapsed_s (to the save's end, the previous checkpoint
        removed), committed_s (until the checkpoint was in place), write_s (the writer's time in write calls),
        waited_s (time steps waited for the writer), copied_bytes and copy_s (what steps copied aside,
        and the time they spent on it), peak_buffer_bytes, buffer_bound (the copy-on-write buffer),
        done, committed, error, direct_bytes (written with O_DIRECT)."""
        if self._snapshot is None:
            return dict(bytes_total=0, bytes_written=0, elapsed_s=0.0, committed_s=0.0, write_s=0.0, waited_s=0.0, copied_bytes=0,
                        copy_s=0.0, peak_buffer_bytes=0, buffer_bound=0, done=True, committed=True, error="",
                        direct_bytes=0)
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


def _place(p: torch.Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Param `p`'s global shape, and where this rank's part of it starts (zeros for a whole one)."""
    if is_dtensor(p):
        chunks = p.__create_chunk_list__()  # DCP's view of a DTensor's local part: one box
        if len(chunks) == 1:
            return tuple(p.shape), tuple(int(o) for o in chunks[0].offsets)
        raise NotImplementedError(f"checkpoint: a DTensor param whose local part is {len(chunks)} boxes")
    return tuple(p.shape), (0,) * p.dim()


def save_async(opt: Any, path: Any, buffer_bytes: int = 0) -> AsyncSave:
    who = "TieredAdamW.save_checkpoint"
    if not isinstance(path, (str, bytes, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{who}: path must be a non-empty path of the checkpoint folder, got {path!r}")
    if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 0:
        raise ValueError(f"{who}: buffer_bytes must be an int >= 0 (0: two of the largest subgroup), got {buffer_bytes!r}")
    if opt.engine is None:
        raise ValueError(f"{who}: the optimizer has no params with state to save")
    path = os.path.abspath(os.fspath(path))
    part = None
    if opt.distribution.kind in ("fsdp2", "hsdp"):
        # Every rank writes its shard as one part; a previous save must be over on every rank
        # before the ranks agree on the next (its commit may be the last part's).
        finish_running_save(opt)
        save_id, names, index = opt.distribution.save_parts(path, who)
        if index is None:
            return AsyncSave(None, path)
        part = (save_id, names, index)
    # The groups and the steps; the tensors are not read here (state_dict() would load what spilled
    # to NVMe into host memory). The engine brings its residents home when the save starts.
    if opt.backward_updates is not None:
        opt.backward_updates.rollback()  # a checkpoint holds no update the next step may still take back
    opt.wait_for_copies()
    packed = torch.optim.Optimizer.state_dict(opt)
    packed["memtide"] = _memtide_entry(opt)
    layout = opt.layout
    index_of = {id(p): i for i, p in enumerate(layout.params)}
    order = [p for g in opt.param_groups for p in g["params"]]
    places = []
    for p in order:
        lo, hi = layout.ranges[index_of[id(p)]]
        shape, offsets = _place(p)
        places.append((lo, hi, tuple(local(p).shape), shape, offsets))
    skeleton = {idx: {k: v for k, v in entry.items() if k not in ("exp_avg", "exp_avg_sq", "master_param")}
                for idx, entry in packed["state"].items()}
    meta = io.BytesIO()
    torch.save({"format": FORMAT, "numel": layout.numel, "places": places,
                "state_dict": {"state": skeleton, "param_groups": packed["param_groups"],
                               "memtide": packed["memtide"]}}, meta)
    snapshot = opt.engine.save_async(path, buffer_bytes, meta.getvalue(), part)
    with _unfinished_lock:
        for s in [s for s in _unfinished if s.progress()["done"]]:
            _unfinished.discard(s)
        _unfinished.add(snapshot)
    return AsyncSave(snapshot, path)


def freeze(opt: Any, needed: List[Tuple[int, int, int]], buffer_bytes: int, stall_s: float, target: str) -> Any:
    """The optimizer's host state frozen for a writer that is not memtide's (dcp_writer.StateWriter):
    `needed` are the (array, first, end) ranges it will read. As save_async: updates made during
    backward are taken back first (a checkpoint holds none the next step may still take back),
    and a running save is waited for."""
    if opt.backward_updates is not None:
        opt.backward_updates.rollback()
    opt.wait_for_copies()
    return opt.engine.freeze(needed, buffer_bytes, stall_s, target)


class _Saved:
    """A committed checkpoint, whole or in parts: each part's manifest, meta and mapped arrays,
    and the params' saved values copied out by box, so that a state saved on some ranks fills the
    shards of any others. Every checksum of a part is checked (verify) before its values are read:
    a rank checks the parts it reads, not every rank's."""

    def __init__(self, path: Any) -> None:
        self.folder = os.fspath(path)
        names = _memtide.read_checkpoint_parts(self.folder)
        self.parts = []
        self.folders = [os.path.join(self.folder, n) for n in names] or [self.folder]
        self._verified = set()
        for folder in self.folders:
            manifest = _memtide.read_checkpoint_manifest(folder, False)  # its structure; checksums below
            self.parts.append((_read_meta(folder, manifest), _mapped(folder, manifest)))
        first = self.parts[0][0]
        self.count = len(first["places"])
        for meta, _ in self.parts[1:]:
            if [pl[3] for pl in meta["places"]] != [pl[3] for pl in first["places"]]:
                raise OSError(f"checkpoint: the parts of {self.folder} describe different params")
        self.shapes = [tuple(pl[3]) for pl in first["places"]]
        sd = first["state_dict"]
        self.state, self.param_groups, self.memtide = sd["state"], sd["param_groups"], sd["memtide"]

    def verify(self, parts: Optional[List[int]] = None) -> None:
        """Checks every checksum of `parts` (None: all) not checked yet. OSError naming the part,
        the subgroup and the file."""
        for k in range(len(self.parts)) if parts is None else parts:
            if k not in self._verified:
                _memtide.read_checkpoint_manifest(self.folders[k], True)
                self._verified.add(k)

    def parts_for(self, boxes: List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]) -> List[int]:
        """The parts that hold some of `boxes` (param, offsets, shape)."""
        needed = set()
        for idx, offsets, shape in boxes:
            for k, (meta, _) in enumerate(self.parts):
                _, _, lshape, _, loff = meta["places"][idx]
                if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(offsets, shape, loff, lshape)) and \
                        all(n > 0 for n in lshape) and all(n > 0 for n in shape):
                    needed.add(k)
        return sorted(needed)

    def exact(self, idx: int, which: int, offsets: Tuple[int, ...], shape: Tuple[int, ...]) -> Optional[torch.Tensor]:
        """The saved values of param `idx`'s box (offsets, shape) when one part holds exactly that
        box: a read-only view of the mapped file, no copy."""
        for meta, arrays in self.parts:
            lo, hi, lshape, _, loff = meta["places"][idx]
            if tuple(loff) == tuple(offsets) and tuple(lshape) == tuple(shape):
                return arrays[which][lo:hi].view(shape)
        return None

    def fill(self, idx: int, which: int, dst: torch.Tensor, offsets: Tuple[int, ...]) -> None:
        """Copies into `dst` (the box of param `idx` at `offsets`) the saved values of array
        `which` (0: params, 1: exp_avg, 2: exp_avg_sq) from every part that holds some of it."""
        view = self.exact(idx, which, offsets, tuple(dst.shape))
        if view is not None:
            dst.copy_(view)
            return
        covered, seen = 0, set()
        for meta, arrays in self.parts:
            lo, hi, lshape, _, loff = meta["places"][idx]
            box = (tuple(loff), tuple(lshape))
            if box in seen:  # a replicated param: every part holds all of it
                continue
            seen.add(box)
            starts = [max(a, b) for a, b in zip(offsets, loff)]
            ends = [min(a + n, b + m) for a, n, b, m in zip(offsets, dst.shape, loff, lshape)]
            if any(e <= s for s, e in zip(starts, ends)) and dst.dim() > 0:
                continue
            src = arrays[which][lo:hi].view(tuple(lshape))
            dst[tuple(slice(s - o, e - o) for s, e, o in zip(starts, ends, offsets))].copy_(
                src[tuple(slice(s - o, e - o) for s, e, o in zip(starts, ends, loff))])
            n = 1
            for s, e in zip(starts, ends):
                n *= e - s
            covered += n
        if covered != dst.numel():
            raise OSError(f"checkpoint: the parts of {self.folder} hold {covered} of the {dst.numel()} values of "
                          f"param {idx}'s part at {tuple(offsets)} (a part missing, or parts that overlap)")

    def value(self, idx: int, which: int, p: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's part of param `idx`'s saved array `which`, for param `p` (None: the whole
        param): a mapped view when one part holds exactly it, else a copy put together."""
        shape, offsets = (self.shapes[idx], (0,) * len(self.shapes[idx])) if p is None else \
            (tuple(local(p).shape), _place(p)[1])
        view = self.exact(idx, which, offsets, shape)
        if view is not None:
            return view
        out = torch.empty(shape, dtype=torch.float32)
        self.fill(idx, which, out, offsets)
        return out


def _read_meta(folder: str, manifest: Dict[str, Any]) -> Dict[str, Any]:
    meta_path = os.path.join(folder, manifest["meta"])
    try:
        meta = torch.load(meta_path, weights_only=True)
    except Exception as e:  # a file torch cannot read: name it, whatever torch raised
        raise OSError(f"checkpoint: {meta_path} cannot be read: {e}") from e
    n = manifest["params"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("numel") != n:
        raise OSError(f"checkpoint: {meta_path} does not describe the {n} params of {folder} "
                      f"(format {meta.get('format') if isinstance(meta, dict) else '?'}; this memtide reads {FORMAT})")
    what = "a param"
    try:
        for idx, (lo, hi, lshape, shape, offsets) in enumerate(meta["places"]):
            what = f"param {idx}"
            numel = 1
            for d in lshape:
                numel *= int(d)
            ok = 0 <= lo <= hi <= n and numel == hi - lo and len(lshape) == len(shape) == len(offsets) and all(
                0 <= o and o + d <= g for o, d, g in zip(offsets, lshape, shape))
            if not ok:
                raise ValueError
        what = "a param's state"
        count = len(meta["places"])
        ok = all(0 <= int(idx) < count for idx in meta["state_dict"]["state"])
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise OSError(f"checkpoint: {meta_path} places {what} outside the {n} saved params")
    return meta


def read(path: Any) -> Dict[str, Any]:
    """The checkpoint at `path` as a state dict of TieredAdamW's layout (torch.optim.AdamW's, with
    the fp32 params as "master_param") over whole params, every checksum checked first. A whole
    checkpoint's tensors map the file (read-only, no copy in memory); a checkpoint in parts (saved
    by sharded ranks) is put together in memory. load_state_dict copies them."""
    saved = _Saved(path)
    saved.verify()  # every checksum first
    state = {idx: dict(entry, exp_avg=saved.value(idx, 1, None), exp_avg_sq=saved.value(idx, 2, None),
                       master_param=saved.value(idx, 0, None))
             for idx, entry in saved.state.items()}
    return {"state": state, "param_groups": saved.param_groups, "memtide": saved.memtide}


def _mapped(folder: str, manifest: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checkpoint's params, exp_avg and exp_avg_sq: read-only tensors over the mapped file."""
    import numpy as np

    n = manifest["params"]
    if n == 0:
        empty = torch.empty(0)
        return empty, empty, empty
    flat = np.memmap(os.path.join(folder, manifest["data"]), dtype=np.float32, mode="r",
                     shape=(manifest["file_bytes"] // 4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only by design: loading copies
        t = torch.from_numpy(flat)
    p, m, v = (t[o // 4:o // 4 + n] for o in manifest["offsets"])  # each placed as it lay in memory
    return p, m, v


@torch.no_grad()
def load(opt: Any, path: Any) -> None:
    who = "TieredAdamW.load_checkpoint"
    saved = _Saved(path)
    order = [p for g in opt.param_groups for p in g["params"]]
    if len(order) != saved.count:
        raise ValueError(f"{who}: {saved.folder} holds {saved.count} param tensors, the optimizer has {len(order)}; "
                         "nothing was loaded")
    for idx, p in enumerate(order):
        if tuple(p.shape) != saved.shapes[idx]:
            raise ValueError(f"{who}: {saved.folder} holds param {idx} of shape {saved.shapes[idx]}, the optimizer's "
                             f"is {tuple(p.shape)}; nothing was loaded")
    # Every checksum of the parts this rank reads, before anything changes.
    saved.verify(saved.parts_for([(idx, _place(p)[1], tuple(local(p).shape)) for idx, p in enumerate(order)]))
    # The moments through load_state_dict; the masters below, every param's, straight into the
    # buffers (not also as "master_param" here: that would copy them twice).
    wrap = opt.distribution.wrap
    state = {idx: dict(entry, exp_avg=wrap(order[idx], saved.value(idx, 1, order[idx])),
                       exp_avg_sq=wrap(order[idx], saved.value(idx, 2, order[idx])))
             for idx, entry in saved.state.items()}

    def masters() -> None:
        # Every param takes its saved value, a param without optimizer state yet (saved before
        # its first step) too: the masters from the file, then the model's copies from them.
        layout, b = opt.layout, opt.buffers
        position = {id(p): idx for idx, p in enumerate(order)}
        for i, p in enumerate(layout.params):
            lo, hi = layout.ranges[i]
            saved.fill(position[id(p)], 0, b.params[lo:hi].view(local(p).shape), _place(p)[1])
            if layout.lowp_of[i]:
                b.lowp[lo:hi].copy_(b.params[lo:hi])
                if not layout.aliased[i]:
                    local(p).data.copy_(b.lowp[lo:hi].view(local(p).shape))
            elif not layout.aliased[i]:
                opt.distribution.write_back(p, b.params[lo:hi], False)

    load_state_dict(opt, {"state": state, "param_groups": saved.param_groups, "memtide": saved.memtide}, then=masters)
