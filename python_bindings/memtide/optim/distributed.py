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

from typing import Any, Dict, List, Optional

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
    return DTensor.from_local(local_view, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


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
        #: Every rank of the mesh (replicas included): the ranks whose settings must agree.
        self.ranks = sorted(mesh.mesh.flatten().tolist()) if mesh is not None else []

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


def check_agreement(settings: Dict[str, Any], group: Any, who: str) -> None:
    """Raises ValueError on every rank of `group` (a process group, or a list of ranks; None: the
    whole job) when the ranks' `settings` differ, naming the
    first setting that does and what each rank has: ranks that disagree on the optimizer (a
    policy, a subgroup size, NVMe on one rank only) would otherwise fail later, or silently
    train apart. Every rank of the group must call it: it waits for the others at most the
    process group's timeout, then raises TimeoutError naming the ranks that did not come.

    The settings travel through the process group's key-value store, not a collective: gloo
    frees a collective's tensors on its own thread after the collective ends, and a program that
    exits right after building its optimizer was at times aborted by that thread taking the GIL
    during interpreter shutdown."""
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
    text = json.dumps(settings, sort_keys=True, default=repr)
    store.set(prefix + str(dist.get_rank()), text)
    keys = [prefix + str(r) for r in ranks]
    try:
        store.wait(keys)  # at most the store's timeout: the process group's
    except RuntimeError as e:  # DistStoreError: a rank died, or never builds its optimizer
        absent = [r for r, k in zip(ranks, keys) if not store.check([k])]
        if not absent:
            raise
        raise TimeoutError(f"{who}: rank(s) {', '.join(map(str, absent))} did not build the optimizer within the "
                           f"process group's timeout ({store.timeout.total_seconds():g} s): a rank died, or builds "
                           "its optimizer at another point of the program than the others") from e
    gathered = [json.loads(store.get(k)) for k in keys]
    mine = json.loads(text)  # as the others see it (tuples become lists)
    for key in mine:
        values = [g.get(key) for g in gathered]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
            raise ValueError(f"{who}: the ranks disagree on {key} ({listed}); every rank must build its "
                             "optimizer with the same settings")


def shard_group(params: List[torch.Tensor]) -> Optional[ShardGroup]:
    """The params' ShardGroup, or None when none is a sharded DTensor."""
    if DTensor is None or not any(is_dtensor(p) for p in params):
        return None
    group = ShardGroup(params)
    return group if group else None


class DdpGradients:
    """DDP's communication hook for TieredAdamW (TieredAdamW.register_ddp): each bucket is
    all-reduced as DDP's default does (divided by the world size, then summed), and the reduced
    gradients enter the optimizer's gradient path the moment the bucket's all-reduce completes,
    during backward: never the local gradient first. DDP then writes the same values into the
    params' ``.grad`` (a copy, or nothing with ``gradient_as_bucket_view``); what each ``.grad``
    holds after that is recorded at the end of backward, so step() takes the gradients as sent
    unless they change later."""

    def __init__(self, opt: Any, ddp: Any) -> None:
        import weakref

        self._opt = weakref.ref(opt)  # DDP keeps the hook: it must not keep the optimizer
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
            if opt._eager is not None and opt.last_micro_batch:
                opt._eager.watch()  # backward's own thread: the gradients arrive on another
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(self._group))
        fut = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        params = bucket.parameters()
        return fut.then(lambda f: self._reduced(params, f.value()[0]))

    def _reduced(self, params: List[torch.Tensor], reduced: torch.Tensor) -> torch.Tensor:
        opt = self._opt()
        path = None if opt is None else opt._grads
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
        if opt is not None and opt._grads is not None:
            opt._grads.record(sent)
