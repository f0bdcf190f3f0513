"""What TieredAdamW needs of torch.distributed.

FSDP2 (``fully_shard``) makes each param a DTensor sharded on dim 0 (under HSDP, also replicated
over a second mesh dimension): every rank owns one local shard (uneven sizes and empty shards included), and its gradient arrives as a DTensor of the same
sharding after the reduce-scatter. TieredAdamW keeps and updates only the local shards' state, so
each rank's engine holds 1/N of the optimizer state, and writes the new values into the local
shards. What must agree across ranks, this module reduces over the params' process group: the
squared gradient norm for clipping (sharded params summed over ranks, replicated ones once) and
whether any rank saw a non-finite gradient (a loss scaler then skips the step everywhere).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

try:  # torch without distributed support has no DTensor: nothing is ever sharded then
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - every torch this package supports has it
    DTensor = None


def is_dtensor(t: Optional[torch.Tensor]) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (sharing its storage), else `t`."""
    return t._local_tensor if is_dtensor(t) else t


def like(param: torch.Tensor, local_view: torch.Tensor) -> torch.Tensor:
    """`local_view` (this rank's shard of a state tensor of `param`) as `param` is seen: a DTensor
    of the same mesh and placements for a DTensor param, so that torch.distributed.checkpoint
    saves and reshards it like the param; `local_view` itself otherwise."""
    if not is_dtensor(param):
        return local_view
    return DTensor.from_local(_from_offset_zero(local_view), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _from_offset_zero(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) as a tensor over a storage of its own that starts where `t` does, sharing
    `t`'s memory (a storage slice keeps the whole storage alive). torch.save cannot pickle a
    DTensor whose local tensor starts inside its storage ("Attempted to access the data pointer
    on an invalid python storage", torch 2.11-2.15: the wrapper then has a nonzero data pointer
    and is taken for a plain tensor), and a view of the engine's flat buffers does."""
    offset = t.storage_offset()
    if offset == 0:
        return t
    size = t.element_size()
    storage = t.untyped_storage()[offset * size:(offset + t.numel()) * size]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage).view(t.shape)


class ShardGroup:
    """The process group over which an optimizer's DTensor params are sharded, and which of
    them are sharded (their squares sum over ranks) or replicated (counted once).

    Under HSDP (``fully_shard`` over a 2-D mesh: replicate, shard) a param is
    ``(Replicate(), Shard(0))``: the ranks of one shard group hold its pieces, and every replica
    group holds the same pieces with the same reduced gradients. Norms are summed over the shard
    group; a non-finite verdict and the settings must agree over the whole mesh."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.sharded = [False] * len(params)
        meshes = {}
        for i, p in enumerate(params):
            if not is_dtensor(p):
                continue
            mesh = p.device_mesh
            if mesh.ndim > 2:
                raise ValueError(f"TieredAdamW: param {i} lies on a {mesh.ndim}-dimensional device mesh; FSDP2's "
                                 "one dimension (shard) or two (HSDP: replicate, shard) are supported")
            *outer, placement = p.placements
            if any(not isinstance(q, Replicate) for q in outer):
                raise ValueError(f"TieredAdamW: param {i} has placements {tuple(p.placements)}; on a 2-D mesh HSDP's "
                                 "(Replicate(), Shard(0)) is supported")
            if isinstance(placement, Shard):
                if placement.dim != 0:
                    raise ValueError(f"TieredAdamW: param {i} is sharded on dim {placement.dim}; FSDP2's Shard(0) "
                                     "is supported")
                self.sharded[i] = True
            elif not isinstance(placement, Replicate):
                raise ValueError(f"TieredAdamW: param {i} has placement {placement}; Shard(0) and Replicate are "
                                 "supported")
            # fully_shard without a mesh makes one per call: equal meshes (same device type and
            # ranks) are one.
            meshes[(mesh.device_type, tuple(mesh.mesh.flatten().tolist()))] = mesh
        if len(meshes) > 1:
            raise ValueError("TieredAdamW: the params lie on more than one device mesh; make one TieredAdamW per mesh")
        mesh = next(iter(meshes.values())) if meshes and any(self.sharded) else None
        self.group = mesh.get_group(mesh.ndim - 1) if mesh is not None else None  # the shard dimension's
        # HSDP's replicate dimension: a verdict must be the same in every replica, whatever one saw.
        self.replicas = mesh.get_group(0) if mesh is not None and mesh.ndim == 2 else None

    def __bool__(self) -> bool:
        return self.group is not None

    def sum(self, value: float) -> float:
        """`value` summed over the group's ranks."""
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank of the mesh (its shard group, then its replicas)."""
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self._device())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        if self.replicas is not None:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.replicas)
        return bool(t.item() > 0)

    def _device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo either.
        backend = self._dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


_agreements = 0  # check_agreement calls so far: every rank makes them in the same order


def check_agreement(settings: Dict[str, Any], group: Any, who: str, doing: str = "build the optimizer") -> str:
    """Raises ValueError on every rank of `group` (a process group, or a list of ranks; None: the
    whole job) when the ranks' `settings` differ: ranks that disagree on the optimizer (a policy,
    a subgroup size, NVMe on one rank only, a hyper-parameter, a param left out) would otherwise
    fail later, or silently train apart. The error names the first setting that differs and each
    rank's value (ranks with the same value together), and which other settings differ too. A
    setting whose name starts with "params" is a list of param descriptions (describe_param),
    compared item by item: the error names the counts and the first param that differs, not the
    whole list. Every rank must call it: it waits for the others at most the process group's
    timeout, then raises TimeoutError naming the ranks that did not come (`doing` says at what).
    Returns the store key prefix of this agreement: unique in the job, the same on every rank.

    The settings travel through the process group's key-value store, not a collective: gloo
    frees a collective's tensors on its own thread after the collective ends, and a program that
    exits right after building its optimizer was at times aborted by that thread taking the GIL
    during interpreter shutdown. Each rank posts its settings and their digest, and reads every
    rank's digest; only where the digests differ does it read the settings of one rank per
    digest, so that the store carries little more than a digest per rank pair."""
    import hashlib
    import json

    import torch.distributed as dist

    global _agreements
    _agreements += 1
    store = dist.distributed_c10d._get_default_store()
    if isinstance(group, (list, tuple)):
        ranks = list(group)
    else:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    prefix = f"memtide/agreement/{_agreements}/{'-'.join(map(str, ranks))}/"
    text = json.dumps(settings, default=repr)
    digest = hashlib.sha256(text.encode()).hexdigest()
    rank = dist.get_rank()
    store.set(prefix + "settings/" + str(rank), text)
    store.set(prefix + str(rank), digest)  # after the settings: a digest there means they are too
    keys = [prefix + str(r) for r in ranks]
    try:
        store.wait(keys)  # at most the store's timeout: the process group's
    except RuntimeError as e:  # DistStoreError: a rank died, or never builds its optimizer
        absent = [r for r, k in zip(ranks, keys) if not store.check([k])]
        if not absent:
            raise
        raise TimeoutError(f"{who}: rank(s) {', '.join(map(str, absent))} did not {doing} within the "
                           f"process group's timeout ({store.timeout.total_seconds():g} s): a rank died, or does "
                           "it at another point of the program than the others") from e
    digests = [store.get(k).decode() for k in keys]
    if len(set(digests)) == 1:
        return prefix
    # One rank's settings per digest (the lowest rank's): every rank builds the same message.
    first: Dict[str, int] = {}
    for r, d in zip(ranks, digests):
        first.setdefault(d, r)
    read = {d: (settings if r == rank else json.loads(store.get(prefix + "settings/" + str(r))))
            for d, r in first.items()}
    read = {d: json.loads(json.dumps(v, default=repr)) for d, v in read.items()}  # as the others see it
    gathered = [read[d] for d in digests]
    names: List[str] = []
    for g in [read[d] for d in first]:
        names += [k for k in g if k not in names]
    differ = [k for k in names if len({_canonical(g.get(k)) for g in gathered}) > 1]
    if not differ:
        return prefix  # the same settings, their keys in another order
    what = _disagreement(differ[0], ranks, [g.get(differ[0]) for g in gathered])
    also = differ[1:]
    more = "" if not also else (f"; they also disagree on {', '.join(also[:3])}" +
                                (f" and {len(also) - 3} more" if len(also) > 3 else ""))
    raise ValueError(f"{who}: the ranks disagree on {what}{more}. Every rank must build its optimizer with the "
                     "same settings over the same params")


def _canonical(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def _rank_names(ranks: List[int]) -> str:
    """"rank 3", "ranks 0, 1", "ranks 0-30, 32-63"."""
    runs: List[List[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _by_rank(ranks: List[int], values: List[Any], show: Callable[[Any], str]) -> str:
    """Each value and the ranks that have it: "rank 0: 0.01; rank 1: 0.1" (at most four values)."""
    groups: Dict[str, Tuple[Any, List[int]]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(_canonical(v), (v, []))[1].append(r)
    parts = [f"{_rank_names(rs)}: {show(v)}" for v, rs in groups.values()]
    if len(parts) > 4:
        parts = parts[:4] + [f"{len(parts) - 4} other values"]
    return "; ".join(parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _disagreement(name: str, ranks: List[int], values: List[Any]) -> str:
    """What the message says of one setting the ranks disagree on."""
    if not name.startswith("params"):
        return f"{name} ({_by_rank(ranks, values, _short)})"
    lists = [v if isinstance(v, list) else [] for v in values]
    counts = [len(v) for v in lists]
    i = next((i for i in range(max(counts)) if len({_canonical(v[i] if i < len(v) else None)
                                                    for v in lists}) > 1), min(counts))
    item = _by_rank(ranks, [v[i] if i < len(v) else None for v in lists],
                    lambda d: "none" if d is None else str(d))
    if len(set(counts)) == 1:
        return f"{name}: param {i} is the first that differs ({item})"
    n = _by_rank(ranks, counts, lambda c: f"{c} param{'' if c == 1 else 's'}")
    return f"{name} ({n}), and param {i} is the first that differs ({item})"


def describe_param(p: torch.Tensor) -> str:
    """What the ranks must agree on of a param: its (global) shape and dtype, a DTensor's
    placements, whether it is frozen. E.g. "[61, 7] float32 (Shard(dim=0))"."""
    text = f"{list(p.shape)} {str(p.dtype).replace('torch.', '')}"
    if is_dtensor(p):
        text += f" ({', '.join(map(repr, p.placements))})"
    return text if p.requires_grad else text + " frozen"


def plain(value: Any) -> Any:
    """A group's hyper-parameter as JSON compares it: numbers, strings and lists as they are, a
    small tensor as its values, anything else as its repr without memory addresses."""
    import numbers
    import re

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 8 else f"tensor of shape {list(value.shape)}, {value.dtype}"
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def mesh_ranks(params: List[torch.Tensor]) -> List[int]:
    """Every rank of the device meshes the DTensor params lie on (HSDP's replicas included): the
    ranks whose optimizers must agree. Empty when no param is a DTensor."""
    ranks: set = set()
    meshes: set = set()
    for p in params:
        if is_dtensor(p) and id(p.device_mesh) not in meshes:
            meshes.add(id(p.device_mesh))
            ranks.update(p.device_mesh.mesh.flatten().tolist())
    return sorted(ranks)


def shard_group(params: List[torch.Tensor]) -> Optional[ShardGroup]:
    """The params' ShardGroup, or None when none is a sharded DTensor."""
    if DTensor is None or not any(is_dtensor(p) for p in params):
        return None
    group = ShardGroup(params)
    return group if group else None


class Distribution:
    """How one TieredAdamW's params are spread over ranks, and all that follows from it, in one
    place: ``none`` (one process, or ranks that share nothing), ``ddp`` (replicated params whose
    gradients DDP all-reduces), ``fsdp2`` (DTensor params sharded on dim 0) or ``hsdp`` (sharded,
    and replicated over a second mesh dimension). Made anew with the optimizer's layout; the DDP
    model, once found (attach_ddp), is carried over.

    What it owns:

    - this rank's part of a param or a gradient (:meth:`local`) and a state tensor seen as the
      param is seen, a DTensor of the same mesh and placements (:meth:`wrap`);
    - which params may become views of memtide's buffers (:meth:`can_view`): never a DTensor.
      FSDP2 keeps each shard in its own padded storage (``FSDPParam._sharded_param_data``), which
      its all-gather reads; the DTensor's local tensor is a view of that storage, so swapping it
      for a view of memtide's flat buffer would leave FSDP2 gathering stale values, and one flat
      pinned array cannot be made to alias many separate allocations. A shard is therefore
      written back after each step (:meth:`write_back`, 2 or 4 B/param) and its gradient, the
      reduce-scatter's output, is copied in as it arrives;
    - what must agree in a step (:meth:`protocol_kwargs`: the StepProtocol's Collective, the
      shard group's sums and the mesh-wide verdict);
    - the settings agreement across the ranks (:meth:`agree`).
    """

    def __init__(self, params: List[torch.Tensor], ddp: Optional["DdpGradients"] = None) -> None:
        #: The process groups of the sharded params (None: nothing sharded).
        self.shards = shard_group(params)
        #: The DDP model's communication hook, once found (register_ddp, or DdpWatch).
        self.ddp = ddp
        self._mesh = mesh_ranks(params)
        self._params = params
        #: Whether any param is a DTensor (its gradient too: `local` must unwrap them).
        self.dtensors = any(is_dtensor(p) for p in params)

    @property
    def kind(self) -> str:
        if self.shards:
            return "hsdp" if self.shards.replicas is not None else "fsdp2"
        return "ddp" if self.ddp is not None else "none"

    local = staticmethod(local)
    wrap = staticmethod(like)

    @staticmethod
    def can_view(p: torch.Tensor, buffer: torch.Tensor) -> bool:
        """Whether param `p` can become a view of `buffer` (memtide's): same device, not a DTensor."""
        return buffer.device == p.device and not is_dtensor(p)

    @staticmethod
    def write_target(p: torch.Tensor) -> torch.Tensor:
        """What the step's new values of `p` are copied into: this rank's part of it, as a tensor
        whose writes do not count as in-place writes of `p` (torch's version counter, which
        TieredAdamW reads to find writes that are not its own)."""
        return local(p).data

    @staticmethod
    def write_back(p: torch.Tensor, values: torch.Tensor, non_blocking: bool) -> None:
        """Copies the step's new `values` (flat) into this rank's part of `p`."""
        target = Distribution.write_target(p)
        target.copy_(values.view(target.shape), non_blocking=non_blocking)

    def protocol_kwargs(self) -> Dict[str, Any]:
        """The StepProtocol's view of the ranks: which params' squares sum over the shard group,
        and the reductions (None in one process)."""
        shards = self.shards
        if not shards:
            return dict(sharded=[], sum_sharded=None, any=None)
        return dict(sharded=list(shards.sharded), sum_sharded=shards.sum, any=shards.any)

    def save_parts(self, path: str, who: str) -> Tuple[str, List[str], Optional[int]]:
        """For a save of sharded params, every rank of the mesh calling it: the save's id (random,
        the same on every rank: stale parts of another save never join it), the parts' names (one
        per shard of the mesh's shard dimension) and this rank's part (None for an HSDP replica
        other than the first: the first replica's ranks write the shards). Raises ValueError on
        every rank when the ranks name different paths."""
        import secrets

        import torch.distributed as dist

        prefix = check_agreement({"checkpoint path": path}, self._mesh, who, doing="ask for the checkpoint")
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == self._mesh[0]:
            store.set(prefix + "save-id", secrets.token_hex(8))
        save_id = store.get(prefix + "save-id").decode()  # waits at most the store's timeout
        mesh = next(p.device_mesh for p in self._params if is_dtensor(p))
        coordinate = mesh.get_coordinate()
        count = mesh.size(mesh.ndim - 1)
        names = [f"shard-{i:05d}-of-{count:05d}" for i in range(count)]
        writes = mesh.ndim == 1 or coordinate[0] == 0
        return save_id, names, (coordinate[-1] if writes else None)

    def agree(self, settings: Dict[str, Any], who: str) -> bool:
        """Checks that every rank of the params' device mesh built its optimizer alike
        (check_agreement); False when no param is a DTensor (DDP's ranks agree at attach_ddp)."""
        if not self._mesh:
            return False
        check_agreement(settings, self._mesh, who)
        return True


class DdpGradients:
    """DDP's communication hook for TieredAdamW (TieredAdamW.register_ddp): each bucket is
    all-reduced as DDP's default does (divided by the world size, then summed), and the reduced
    gradients enter the optimizer's gradient path the moment the bucket's all-reduce completes,
    during backward: never the local gradient first. DDP then writes the same values into the
    params' ``.grad`` (a copy, or nothing with ``gradient_as_bucket_view``); what each ``.grad``
    holds after that is recorded at the end of backward, so step() takes the gradients as sent
    unless they change later."""

    def __init__(self, opt: Any, ddp: Any) -> None:
        self._opt = weakref.ref(opt)  # DDP keeps the hook: it must not keep the optimizer
        self.model = weakref.ref(ddp)
        self._group = ddp.process_group
        self.params = {id(p) for p in ddp.module.parameters()}
        self._sent: List[int] = []
        self._queued = False

    # DDP checks the signature: a parameter named `bucket`, and no annotation but its own types
    # (which `from __future__ import annotations` would turn into strings).
    def hook(self, _state, bucket):  # noqa: ANN001
        import torch.distributed as dist

        opt = self._opt()
        if opt is not None and not self._queued:
            # At the end of this backward, after DDP's own end-of-backward callback (queued later
            # than this one, it runs before the one this one queues).
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._queue_record)
            if opt.backward_updates is not None and opt.last_micro_batch:
                opt.backward_updates.watch()  # backward's own thread: the gradients arrive on another
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(self._group))
        fut = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        params = bucket.parameters()
        return fut.then(lambda f: self._reduced(params, f.value()[0]))

    def _reduced(self, params: List[torch.Tensor], reduced: torch.Tensor) -> torch.Tensor:
        opt = self._opt()
        path = None if opt is None else opt.gradient_path
        if path is not None:
            index = path.index
            offset = 0
            for p in params:
                n = p.numel()
                i = index.get(id(p))
                if i is not None:
                    path.reduced(i, reduced[offset:offset + n])
                    self._sent.append(i)
                offset += n
        return reduced

    def _queue_record(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._record)

    def _record(self) -> None:
        self._queued = False
        sent, self._sent = self._sent, []
        opt = self._opt()
        if opt is not None and opt.gradient_path is not None:
            opt.gradient_path.record(sent)


def comm_hook_of(model: Any) -> Optional[str]:
    """The communication hook a DDP model has already (its name), None without one: DDP takes one
    (its reducer refuses a second after DDP's Python side has recorded it, so it is checked first)."""
    hooks = getattr(model, "_comm_hooks", None) or []  # register_comm_hook's (Python) hooks
    if hooks:
        hook = hooks[0][0]
        if isinstance(getattr(hook, "__self__", None), DdpGradients):
            return "another TieredAdamW's"
        return getattr(hook, "__qualname__", None) or repr(hook)
    try:  # a built-in hook (_register_builtin_comm_hook) is in DDP's logging data only
        name = model._get_ddp_logging_data().get("comm_hook")
    except Exception:  # noqa: BLE001 - an older or newer DDP without it: none known
        name = None
    return str(name) if name else None


def attach_ddp(opt: Any, model: Any, who: str, explicit: bool) -> None:
    """Makes DDP model `model` the source of TieredAdamW `opt`'s gradients (register_ddp, or found at
    the model's first forward by DdpWatch): the ranks of its process group must agree on the
    optimizer (check_agreement), then DdpGradients becomes DDP's communication hook. Where DDP
    cannot take it (a hook of its own, its Python reducer, every all-reduce delayed), step() copies
    the reduced gradients as before: explicit=True raises ValueError for a hook already there
    (register_ddp asked for what cannot be), else a warning says what is lost."""
    import warnings

    check_agreement(opt.settings(), model.process_group, who)
    hook = comm_hook_of(model)
    why = None
    if hook is not None:
        why = f"the DDP model has a communication hook of its own already ({hook}), and DDP takes only one"
        if explicit:
            raise ValueError(f"{who}: {why}. Leave register_ddp out to keep that hook: TieredAdamW then takes "
                             "the reduced gradients at step() (copying them does not overlap backward; the "
                             "results are the same)")
    elif getattr(model, "_use_python_reducer", False):
        why = "DDP runs its Python reducer (torch.compile's optimize_ddp='python_reducer'), which has no buckets"
    elif getattr(model, "_delay_all_reduce_all_params", False):
        why = "DDP all-reduces every param after backward (delay_all_reduce_named_params)"
    if why is not None:
        warnings.warn(f"{who}: {why}: TieredAdamW leaves it and takes the reduced gradients at step(), so "
                      "copying them does not overlap backward; results are unaffected", UserWarning, stacklevel=3)
        return
    ddp = DdpGradients(opt, model)
    model.register_comm_hook(None, ddp.hook)
    opt.distribution.ddp = ddp
    opt.gradient_path.follow_ddp(ddp)


def _module_called(watch: "weakref.ref[DdpWatch]", module: torch.nn.Module, _args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced by torch.compile: nothing of this in the graph (the eager calls find DDP)
    w = watch()
    if w is not None:
        w.called(module)


class DdpWatch:
    """Finds the DistributedDataParallel model that holds a TieredAdamW's params at its first
    forward, and registers it as TieredAdamW.register_ddp does (attach_ddp): frameworks (Hugging
    Face Trainer, Accelerate, Lightning) wrap the model in DDP themselves, and nobody calls
    register_ddp there.

    A global module forward pre-hook sees every module call: DDP's own (the module is the DDP
    model, before DDP's forward starts; or ``torch.compile(ddp)``, before anything is traced), or,
    were DDP's call bypassed, the first module inside its forward (DDP names itself in
    ``DistributedDataParallel._active_ddp_module`` there; a torch without it: nothing is found).
    While torch.compile traces, the hook does nothing. A DDP model that holds none of the
    optimizer's params is remembered and left alone. The hook goes at the first DDP model found;
    once the optimizer has stepped (found nothing by then: the next module call removes it); with
    the optimizer (it holds the optimizer weakly); or by stop()."""

    def __init__(self, opt: Any, ddp_class: type) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._opt = weakref.ref(opt)
        self._ddp_class = ddp_class
        self._seen: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        handle = register_module_forward_pre_hook(functools.partial(_module_called, weakref.ref(self)))
        self._remove = weakref.finalize(self, handle.remove)  # this watch (its optimizer) collected: the hook goes

    def stop(self) -> None:
        """Removes the global hook (once)."""
        self._remove()
        opt = self._opt()
        if opt is not None and opt.__dict__.get("ddp_watch") is self:
            opt.ddp_watch = None

    def called(self, module: torch.nn.Module) -> None:
        opt = self._opt()
        if opt is None or opt.distribution.ddp is not None or opt.stats.steps or opt.stats.skipped:
            self.stop()
            return
        cls = self._ddp_class
        ddp = module if isinstance(module, cls) else getattr(module, "_orig_mod", None)  # torch.compile(ddp)
        if not isinstance(ddp, cls):
            ddp = getattr(cls, "_active_ddp_module", None)
        if ddp is None or ddp in self._seen:
            return
        self._seen.add(ddp)
        if getattr(ddp, "_use_python_reducer", False):
            return  # no buckets: step() takes the reduced gradients as they are
        mine = opt.gradient_path.index if opt.gradient_path is not None else {}
        if not any(id(p) in mine for p in ddp.module.parameters()):
            return
        self.stop()
        attach_ddp(opt, ddp, "TieredAdamW", explicit=False)


def watch_for_ddp(opt: Any) -> Optional[DdpWatch]:
    """A DdpWatch for `opt` where a DDP model may come (torch.distributed initialized with more
    than one rank, or a launcher's WORLD_SIZE above 1), else None."""
    import os

    try:
        import torch.distributed as dist
        from torch.nn.modules.module import register_module_forward_pre_hook  # noqa: F401
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed support
        return None
    if not dist.is_available():
        return None
    try:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return None
    return DdpWatch(opt, DistributedDataParallel) if world > 1 else None
