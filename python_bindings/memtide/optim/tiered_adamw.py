"""TieredAdamW: torch's optimizer interface over memtide's engine (memtide._memtide.UpdateEngine,
tiering::UpdateEngine), which owns the step.

The engine keeps fp32 master params, exp_avg, exp_avg_sq and fp32 gradients in four flat host
arrays (pinned, NUMA-bound, in the device's HostArena), cut into subgroups of ``subgroup_size``
elements whose bounds ignore tensor bounds. It also knows where each param lies, its param group
and its step count: each step this adapter hands it the groups' hyper-parameters, which params
have a gradient, the gradient scale and the clip factor, and the engine cuts the step into
segments, plans it (the PerfModel, under the policy), runs it (the UpdateScheduler), learns from
it (the Calibration) and reports what it did (a StepReport). Placement never changes the
arithmetic, so every policy gives bit-identical results.

What stays here is what only torch knows: param groups, the model's tensors (made views of the
engine's buffers where they can be), the gradient hooks of backward, loss scaling, clipping's
norm and state_dict. ``k`` has one meaning everywhere in memtide: the stride of the paper's
Algorithm 1, one in every k subgroups updated on the GPU (k = 1 all, k = 2 every other one).
"""

from __future__ import annotations

import collections
import operator
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .. import _memtide, torch_bridge
from . import checkpoint, torch_reads
from .arguments import (NvmeTier, check_group, check_max_grad_norm, check_options, device_of, engine_unavailable,
                        nvme_tier, step_params, torch_group_defaults)
from .backward_updates import BackwardUpdates
from .distributed import Distribution, is_dtensor
from .gradients import SUPPORTED_DTYPES, VERSION, GradientPath
from .loss_scale import LossScaler, make_scaler
from .plan import UpdatePlan, requested

_LOWP = (torch.float16, torch.bfloat16)
#: How many steps' figures stats.history and measured_ns keep: the newest, so that a run of
#: millions of steps does not grow the optimizer by an entry per step.
HISTORY_STEPS = 4096
_is_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

try:  # what would see torch's wrapper of step (TieredAdamW.step): a profiler, process-wide step hooks
    from torch._C._autograd import _profiler_enabled
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    def _global_hooks() -> bool:
        return bool(_global_optimizer_pre_hooks) or bool(_global_optimizer_post_hooks)
except ImportError:  # a torch that keeps them elsewhere: every step goes through its wrapper
    def _profiler_enabled() -> bool:
        return True

    def _global_hooks() -> bool:
        return True


@dataclass
class FlatBuffers:
    """The engine's host state as tensors. All fp32 except ``lowp`` (the model's fp16/bf16 copy:
    the engine's device buffer, or a host copy rounded from the masters after each step)."""

    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grads: torch.Tensor
    lowp: Optional[torch.Tensor]
    pinned: bool

    def nbytes(self) -> int:
        tensors = [self.params, self.exp_avg, self.exp_avg_sq, self.grads] + ([self.lowp] if self.lowp is not None
                                                                                else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Layout:
    params: List[torch.nn.Parameter]
    ranges: List[Tuple[int, int]]
    lowp_of: List[bool]  # the model param is fp16/bf16: the kernel writes its copy
    aliased: List[bool]  # the model param's storage is a view of the flat buffers
    subgroups: Tuple[Tuple[int, int], ...]
    numel: int
    #: Each param's (dtype, device) when the layout was made: a param that no longer has them was
    #: cast or moved, and the engine is rebuilt around it.
    kinds: List[Tuple[torch.dtype, torch.device]]
    copied: List[int] = field(init=False)  # the params that are not views: step() copies them back

    def __post_init__(self) -> None:
        self.copied = [i for i, a in enumerate(self.aliased) if not a]


@dataclass
class UpdateStats:
    """What step() has done so far."""

    steps: int = 0
    skipped: int = 0
    #: Gradients step() copied itself: neither the hooks nor DDP's bucket hook had sent them as
    #: they stand (changed in place since, or never sent).
    regathered: int = 0
    params_updated: int = 0
    #: Params whose values the optimizer took from the model because something else replaced or
    #: wrote them since the last step (``module.to(...)``, ``p.data = x``, ``model.load_state_dict``).
    followed: int = 0
    engine_seconds: float = 0.0
    step_seconds: float = 0.0
    last_engine_seconds: float = 0.0
    last_step_seconds: float = 0.0
    last_params: int = 0
    #: (params, engine s, step s) of the last HISTORY_STEPS steps.
    history: Deque[Tuple[int, float, float]] = field(default_factory=lambda: collections.deque(maxlen=HISTORY_STEPS))


class _ParamGroup(dict):
    """A param group that tells its optimizer when its "params" are replaced (Accelerate's FSDP2
    prepare assigns each group the sharded params after the optimizer was built), so that the
    gradient hooks are on the new params before the next backward."""

    def __init__(self, opt: "TieredAdamW", group: Dict[str, Any]) -> None:
        super().__init__(group)
        self._opt = weakref.ref(opt)  # the groups must not keep the optimizer (and its pinned memory)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        opt = self._opt()
        if key == "params" and opt is not None and opt._ready and any(g is self for g in opt.param_groups):
            opt._follow_params()

    def __reduce__(self):  # copies and pickles are plain dicts: a weak reference cannot be pickled
        return dict, (dict(self),)


class TieredAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) over flat host buffers in subgroups.

    Args:
        params, lr, betas, eps, weight_decay: as torch.optim.AdamW; per-group values are honoured
            at every step (LR schedulers work). ``amsgrad=True`` is rejected.
        maximize: as torch.optim.AdamW (steps along the gradient), the same for every group.
        foreach, fused, capturable: accepted as torch.optim.AdamW takes them, so that code and
            configs written for it build this optimizer unchanged; memtide's own fused kernel
            runs whatever they say (its step is not captured in CUDA graphs). They are kept in
            each param group, as torch keeps them, with ``differentiable`` (False only: the step
            runs outside autograd) and ``decoupled_weight_decay`` (True only: this is AdamW).
        policy: where subgroups are updated: "cpu", "static", "interleaved" or "auto". Placement
            never changes the result.
        subgroup_size: elements per subgroup (the last one may be smaller).
        gpu_static_fraction: share of subgroups kept on the GPU through the whole iteration
            (static, interleaved, and auto with k), placed last; capped by the device memory the
            whole iteration leaves.
        k: the stride of the interleaved update: one in every k (>= 1, may be fractional)
            subgroups is updated on the GPU (interleaved, default 2; auto: fixes the stride
            instead of letting the performance model choose).
        loss_scale: None, "dynamic" (GradScaler's defaults), a number (static scale) or a
            :class:`LossScaler`. Scale the loss with :meth:`scale_loss`; step() unscales, and a
            non-finite gradient skips the step, leaving params and state untouched.
        max_grad_norm: clip the global gradient norm (as torch.nn.utils.clip_grad_norm_ after
            GradScaler.unscale_) inside the fused step.
        host_budget: host memory the optimizer state may take (bytes, or a size such as
            "64GiB"). The state takes 16 B/param (fp32 params, two moments, gradient); when that
            is more, the fewest subgroups that bring it within the budget keep their params and
            moments on NVMe (spread over the update order) and each step streams them through
            pinned staging, ``nvme_read_ahead`` subgroups ahead, writing them back behind.
            Needs the model's params in fp16/bf16 on the optimizer's device (an fp32 model would
            be a host copy of the very state that spills).
        nvme_dir: the directory (on an NVMe drive) in which a private spill directory is made.
            Its space is reserved at construction; files left by a crashed run are reported.
        update_during_backward: True (a quarter of the subgroups) or a number: update that many
            subgroups whose state is in host memory on a worker while backward goes on
            (speculatively, bit-exact; see memtide.optim.backward_updates).

    With an NVMe tier, the tensors of ``state`` hold the spilled subgroups' values only after
    :meth:`sync_state` (state_dict() calls it); write to them only after it, too.

    The model's params stay where they are. CPU params become views of the optimizer's buffers
    (fp32: of the master params; fp16/bf16: of the low-precision copy the kernel writes), so
    their update costs no copy; params on a GPU are copied back after each step. Like
    torch.optim.AdamW it trains the Parameter objects it was given, whatever their storage
    becomes: a param a framework moves or replaces after this optimizer was built (HF Trainer's
    and Accelerate's ``model.to("cpu:0")``, ``p.data = x``, ``model.half()``) is followed at the
    next step, its new values becoming the master (see :meth:`_follow_params`).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = True, policy: str = "auto",
                 subgroup_size: int = 100_000_000, gpu_static_fraction: float = 0.0, k: Optional[float] = None,
                 loss_scale: Union[None, str, float, LossScaler] = None,
                 max_grad_norm: Optional[float] = None, host_budget: Union[None, int, str] = None,
                 nvme_dir: Any = None, nvme_read_ahead: int = 2,
                 update_during_backward: Union[bool, int] = False) -> None:
        check_options(policy, subgroup_size, gpu_static_fraction, k, max_grad_norm, update_during_backward)
        self.nvme: Optional[NvmeTier] = nvme_tier(nvme_dir, host_budget, nvme_read_ahead)
        defaults = {**torch_group_defaults(), **dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                     amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                                     capturable=capturable, differentiable=differentiable,
                                                     fused=fused)}
        if "decoupled_weight_decay" in defaults or decoupled_weight_decay is not True:
            defaults["decoupled_weight_decay"] = decoupled_weight_decay
        check_group({**defaults, "params": []})
        self._ready = False
        self.policy = policy
        self.subgroup_size = subgroup_size
        self.gpu_static_fraction = float(gpu_static_fraction)
        self.k = None if k is None else float(k)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.scaler = make_scaler(loss_scale)
        self.stats = UpdateStats()
        self.last_step_skipped = False
        self.last_grad_norm: Optional[float] = None
        #: The engine's report of the last step it ran (a memtide._memtide.StepReport).
        self.last_report: Optional[Any] = None
        #: The measured update phase in ns of the last HISTORY_STEPS steps the engine ran, on
        #: :attr:`clock` (skipped steps excluded).
        self.measured_ns: Deque[float] = collections.deque(maxlen=HISTORY_STEPS)
        self.mark_update = False
        self._pending_copies: Optional[Any] = None  # CUDA event after the last write-back
        #: torch's in-place write counters of the host state and of the params that are views of
        #: it, as the last step took them (_take_versions; None: not taken since host_changed).
        self._host_versions: Optional[Tuple[int, int, int]] = None
        self._view_versions = torch_reads.int64s(0)
        #: The step's native read of every param (torch_reads; None: read in Python), and what it
        #: read at the last step whose check found every param as the optimizer left it.
        self._reads: Optional[torch_reads.ParamReads] = None
        self._seen: Optional[Tuple[Any, Any]] = None
        self._follow_natively = False
        self._copies: Optional[Tuple[List[torch.Tensor], List[torch.Tensor], bool]] = None
        #: Whether the next backward is the last before step() (gradient accumulation: set False for
        #: the micro-batches before the last). Updates during backward happen only in the last.
        self.last_micro_batch = True
        #: The updates during backward (None without update_during_backward).
        self.backward_updates: Optional[BackwardUpdates] = (BackwardUpdates(self, update_during_backward)
                                                            if update_during_backward else None)
        self._update_during_backward = update_during_backward  # as given: compared across ranks (settings)
        #: The hooks that hand each gradient to the protocol (made anew with the layout).
        self.gradient_path: Optional[GradientPath] = None
        #: The engine's step protocol (memtide._memtide.StepProtocol), made anew with the layout.
        self.protocol: Optional[Any] = None
        #: How the params are spread over ranks (none, DDP, FSDP2, HSDP): made anew with the layout.
        self.distribution: Optional[Distribution] = None
        #: The outcome of the last step the protocol decided (a memtide._memtide.StepOutcome).
        self.last_outcome: Optional[Any] = None
        super().__init__(params, defaults)
        self._ready = True
        self._build()
        self._agreed = False
        self._check_agreement()

    def _check_agreement(self) -> None:
        """Every rank must build its optimizer alike (_settings): compared over every rank of the
        params' device mesh (HSDP's replicas included) once they are DTensors (at construction, or
        once a wrapper swapped them for FSDP2's), and over the process group of the DDP model that
        holds plain params, found at its first forward (DdpWatch) or given to register_ddp."""
        if getattr(self, "_agreed", False):
            return
        from .distributed import watch_for_ddp

        watch = self.__dict__.get("ddp_watch")
        if self.distribution.agree(self.settings(), "TieredAdamW"):
            if watch is not None:
                watch.stop()
            self._agreed = True
        elif watch is None and self.distribution.ddp is None and not (self.stats.steps or self.stats.skipped):
            self.ddp_watch = watch_for_ddp(self)

    # -- param groups -----------------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(_ParamGroup(self, param_group))
        try:
            check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise
        if self._ready:
            self._build()

    def _follow_params(self, reads: Optional[torch_reads.ParamReads] = None) -> bool:
        """Keeps training the Parameter objects the user holds, as torch.optim.AdamW does, whatever
        happened to them since the last step. Frameworks move params after the optimizer is built:

        - a wrapper swapped the groups' params for others (Accelerate's FSDP2 prepare replaces each
          param with its sharded DTensor): rebuilt over the new ones. As with torch.optim.AdamW,
          whose state is keyed by param, a param new to the optimizer starts without state;
        - a param's storage was replaced (``module.to("cpu:0")`` copies every param, since
          ``cpu:0`` is not ``cpu`` to torch; ``p.data = x``; HF Trainer and Accelerate do the
          former) or written in place while it is not a view of the optimizer's buffers
          (``model.load_state_dict`` on a GPU or FSDP2 param): its new values become the master
          (an fp16/bf16 param's only if they differ from the copy the optimizer wrote, so that a
          plain move keeps the fp32 master's bits), its moments and step stay, and a param that
          was a view of the optimizer's buffers becomes one again;
        - a param was cast or moved to another device (``model.half()``, ``model.cuda()``): the
          engine is rebuilt around it, its moments and step kept. A param whose size changed after
          its first step is refused, naming it.

        The check reads one data pointer and one version counter per param: per step, not per
        element. `reads`: the step's native read of the params, made just now (None: read here);
        when every param holds what it held at the last step's check, nothing else is read.
        Returns whether every param was as the optimizer left it (nothing taken, nothing rebuilt)."""
        layout = self.layout
        groups = self.param_groups
        held = groups[0]["params"] if len(groups) == 1 else [p for group in groups for p in group["params"]]
        swapped = len(held) != len(layout.params) or not all(map(operator.is_, held, layout.params))
        seen = self._seen
        if not swapped and reads is not None and seen is not None and reads.data == seen[0] and reads.version == seen[1]:
            return True
        now = self._bindings()
        left = now == self._bound
        if not left:
            keep = {id(p) for p in held} if swapped else None
            changed = sorted(i for watched, ours, theirs in zip(self._watched, now, self._bound)
                             for i, a, b in zip(watched, ours, theirs)
                             if a != b and (keep is None or id(layout.params[i]) in keep))
            if changed:
                self._follow_values(changed)
            else:
                self._bound = now
        if swapped:
            self._build()
            self._check_agreement()
        elif reads is not None and self._follow_natively and left:
            self._seen = (reads.data[:], reads.version[:])  # what "nothing moved" reads like, natively
        return left and not swapped

    def _rebind(self) -> None:
        """What each watched param holds now is what the optimizer follows from (_follow_params)."""
        self._bound = self._bindings()
        self._seen = None
        self._copies = None  # where the params that are not views are written: found again

    def _bindings(self) -> List[Any]:
        """What each watched param holds now: for a view of the optimizer's buffers its data
        pointer (a write into it is a write of the master itself), for any other its data pointer
        and torch's count of in-place writes to it. (torch.Tensor's own data_ptr: Accelerate's
        FSDP2 prepare sets an int attribute of that name on the params it replaces.)"""
        data_ptr = torch.Tensor.data_ptr
        views, others = self._watched_params
        return (list(map(data_ptr, views)),
                [(data_ptr(t := p._local_tensor if dt else p), t._version) for p, dt in others])

    @torch.no_grad()
    def _follow_values(self, changed: List[int]) -> None:
        """Takes the values of the params in `changed` (indices) from the model (_follow_params)."""
        layout = self.layout
        if self.engine is None:  # nothing to update: only a size that is no longer 0 matters
            if any(self.distribution.local(layout.params[i]).numel() for i in changed):
                self._build()
            else:
                self._rebind()
            return
        b = self.buffers
        steps = torch.from_dlpack(self.engine.steps()).tolist()
        recast, adopt = [], []
        for i in changed:
            p, (lo, hi) = layout.params[i], layout.ranges[i]
            t = self.distribution.local(p)
            if t.numel() != hi - lo:
                if steps[i] > 0:
                    gi, k = self._where(i)
                    raise ValueError(f"TieredAdamW: param {k} of group {gi} now has {t.numel()} elements "
                                     f"(shape {tuple(t.shape)}), {hi - lo} when the optimizer took its first step: "
                                     "its exp_avg and exp_avg_sq no longer fit it. Resize params before building "
                                     "the optimizer, or build a new one")
                recast.append(i)
            elif (t.dtype, t.device) != layout.kinds[i]:
                recast.append(i)
            else:
                adopt.append(i)
        self.stats.followed += len(recast) + len(adopt)
        if self.backward_updates is not None:
            self.backward_updates.rollback()
        self.wait_for_copies()
        if recast:
            self._build(fresh={id(layout.params[i]) for i in recast + adopt})
            return
        if self.spilled_subgroups:
            self.sync_state()  # the spilled ranges in host memory, so that what is written here counts
        for i in adopt:
            p, (lo, hi) = layout.params[i], layout.ranges[i]
            t = self.distribution.local(p).detach().reshape(-1)
            if layout.lowp_of[i]:
                if not torch.equal(t, b.lowp[lo:hi].to(t.device)):
                    b.lowp[lo:hi].copy_(t)
                    b.params[lo:hi].copy_(b.lowp[lo:hi])
            else:
                b.params[lo:hi].copy_(t)
            if layout.aliased[i]:
                p.data = (b.lowp if layout.lowp_of[i] else b.params)[lo:hi].view(p.shape)
        self.host_changed()
        if self.spilled_subgroups:
            self.engine.spill_host(layout.numel)
        self._rebind()

    def _where(self, i: int) -> Tuple[int, int]:
        """(group, index in the group) of the layout's param i."""
        for gi, group in enumerate(self.param_groups):
            if i < len(group["params"]):
                return gi, i
            i -= len(group["params"])
        return -1, i

    def _params(self) -> Tuple[List[torch.nn.Parameter], List[int], Optional[torch.dtype]]:
        """Every param in group order, its group, and the one low-precision dtype among them."""
        params, group_of = [], []
        lowp_dtype: Optional[torch.dtype] = None
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.dtype not in SUPPORTED_DTYPES:
                    raise ValueError(f"TieredAdamW: param of dtype {p.dtype} is not supported; "
                                     "accepted: torch.float32, torch.float16, torch.bfloat16")
                if p.is_sparse:
                    raise ValueError("TieredAdamW: sparse params are not supported")
                if p.dtype in _LOWP:
                    if lowp_dtype is not None and p.dtype != lowp_dtype:
                        raise ValueError(f"TieredAdamW: params mix {lowp_dtype} and {p.dtype}; one low-precision "
                                         "dtype per optimizer is supported (fp32 params may be mixed in)")
                    lowp_dtype = p.dtype
                params.append(p)
                group_of.append(gi)
        return params, group_of, lowp_dtype

    def _build(self, fresh: Iterable[int] = ()) -> None:
        """(Re)creates the engine from param_groups, keeping the state of known params. The known
        params in `fresh` (by id) keep their moments and step but take their values from the model
        (they were cast or moved since)."""
        if self.backward_updates is not None:
            self.backward_updates.rollback()
        old = getattr(self, "layout", None)
        old_buffers: Optional[FlatBuffers] = getattr(self, "buffers", None)
        old_index = {id(p): i for i, p in enumerate(old.params)} if old else {}
        fresh = set(fresh)
        old_steps = torch.from_dlpack(self.engine.steps()).tolist() if old and self.engine is not None else None
        if old_buffers is not None and self.engine is not None:
            self.engine.sync_host()  # residents may hold newer state than the old host buffers

        params, group_of, lowp_dtype = self._params()
        self.distribution = Distribution(params, ddp=self.distribution.ddp if self.distribution else None)
        ranges, offset = [], 0
        for p in params:  # a DTensor's own shard: each rank keeps the state of what it holds
            n = self.distribution.local(p).numel()
            ranges.append((offset, offset + n))
            offset += n
        numel = offset
        try:
            bounds = tuple(_memtide.cut_subgroups(numel, self.subgroup_size))
        except ValueError as e:
            raise ValueError(f"TieredAdamW: {e}") from None
        lowp_of = [p.dtype in _LOWP for p in params]
        why = engine_unavailable(numel)
        if why and numel > 0:
            raise ValueError(f"TieredAdamW: memtide's engine cannot run here: {why}")
        self.engine = None if numel == 0 else self._make_engine(numel, bounds, params, lowp_dtype)
        engine = self.engine
        aliased = [False] * len(params)
        if engine is not None:
            engine.set_layout(ranges, group_of, lowp_of)
            engine.set_policy(self.policy, k=self.k, static_fraction=self.gpu_static_fraction)
            steps = torch.from_dlpack(engine.steps())
            buffers = self.buffers
            with torch.no_grad():
                for i, (p, (lo, hi)) in enumerate(zip(params, ranges)):
                    j = old_index.get(id(p))
                    if j is not None and old.ranges[j][1] - old.ranges[j][0] != hi - lo:
                        j = None  # resized before its first step (_follow_params refuses it after): starts anew
                    if j is not None and old_buffers is not None:
                        olo, ohi = old.ranges[j]
                        if id(p) not in fresh:
                            buffers.params[lo:hi].copy_(old_buffers.params[olo:ohi])
                        buffers.exp_avg[lo:hi].copy_(old_buffers.exp_avg[olo:ohi])
                        buffers.exp_avg_sq[lo:hi].copy_(old_buffers.exp_avg_sq[olo:ohi])
                        steps[i] = float(old_steps[j])
                    if j is None or old_buffers is None or id(p) in fresh:
                        buffers.params[lo:hi].copy_(self.distribution.local(p).detach().reshape(-1))
                    if lowp_of[i]:
                        buffers.lowp[lo:hi].copy_(self.distribution.local(p).detach().reshape(-1))
                    source = buffers.lowp if lowp_of[i] else buffers.params
                    # FSDP2 owns a sharded param's storage (its all-gather reads it): written back.
                    if self.distribution.can_view(p, source):
                        # The param becomes a view of the buffer the step writes: no copy-back.
                        p.data = source[lo:hi].view(p.shape)
                        aliased[i] = True
                    if self.spilled_subgroups:
                        # Spilled subgroups filled so far go to NVMe now: at most about a subgroup of
                        # them is in host memory at once.
                        engine.spill_host(hi)
            if self.spilled_subgroups:
                if not (self.model_attached and all(lowp_of) and all(aliased)):
                    bad = next((i for i in range(len(params)) if not (lowp_of[i] and aliased[i])), 0)
                    p = params[bad]
                    if not lowp_of[bad]:
                        why = (f"param {bad} is {p.dtype}: an fp32 model would be a host copy of the very state that "
                               "spilled")
                    elif is_dtensor(p):
                        why = (f"param {bad} is an FSDP2 shard (a DTensor, {p.dtype} on {p.device}): FSDP2 owns the "
                               "shard's storage (its all-gather reads it), so it cannot become a view of the buffer "
                               "the step writes, and a copy of it would keep the very state that spilled in host "
                               "memory; under FSDP2 give a host_budget that holds this rank's whole state")
                    else:
                        why = (f"param {bad} is {p.dtype} on {p.device}, but the optimizer's buffers are in "
                               f"{'host' if engine.host_memory else 'GPU'} memory: move the model there first")
                    raise ValueError(
                        f"TieredAdamW: with {self.spilled_subgroups} subgroup(s) on NVMe each step must write the "
                        f"model's params in place (fp16/bf16, on the optimizer's device, not FSDP2 shards); {why}")
                engine.spill_host(numel)
            # Only when every param is a view of the engine's model buffer does nothing read the
            # fp32 masters between steps (checkpoints sync them on demand).
            self.sync_after_step = not (self.model_attached and all(l and a for l, a in zip(lowp_of, aliased)))
            engine.set_sync_after_step(self.sync_after_step)

        self.layout = _Layout(params, ranges, lowp_of, aliased, bounds, numel,
                               [(t.dtype, t.device) for t in map(self.distribution.local, params)])
        # What _follow_params checks each step: every param but a LayerWindow's, which moves them
        # between device slots and their home in the optimizer's buffers itself.
        # The views of the buffers apart from the rest: one C-level pass reads their pointers.
        watched = [i for i, p in enumerate(params) if not getattr(p, "_memtide_windowed", False)]
        self._watched = ([i for i in watched if aliased[i]], [i for i in watched if not aliased[i]])
        self._watched_params = ([params[i] for i in self._watched[0]],
                                [(params[i], is_dtensor(params[i])) for i in self._watched[1]])
        self._views = [p for p, a in zip(params, aliased) if a]
        self._rebind()
        # The step's reads of every param in one native call (torch_reads), where there is one
        # (FSDP2's DTensors through their local shards). Windowed params move every iteration:
        # the check that follows params then reads in Python.
        self._reads = torch_reads.for_params(params)
        self._follow_natively = len(watched) == len(params)
        self._host_versions = None
        self._view_versions = torch_reads.int64s(len(self._views))
        self._requested = requested(self.policy, bounds, self.k, self.gpu_static_fraction)
        if engine is not None:
            engine.plan  # planned now: the first backward's gradient path follows this plan
        if self.backward_updates is not None:
            self.backward_updates.rebuild()
        self.protocol = None if engine is None else self._make_protocol()
        # The gradient path: each gradient leaves for the host the moment backward finishes it.
        if self.gradient_path is not None:
            self.gradient_path.remove()
        self.gradient_path = GradientPath(self)
        self.state.clear()
        self.expose_state()

    def _make_protocol(self) -> Any:
        """The engine's step protocol over this layout: what must agree across ranks is reduced over
        the FSDP2 shard group's process groups (ShardGroup.sum and .any), called from the step."""
        eager = self.backward_updates
        return _memtide.StepProtocol(self.engine, max_grad_norm=self.max_grad_norm,
                                     loss_scaler=self.scaler is not None,
                                     backward_updates=None if eager is None else eager.native,
                                     **self.distribution.protocol_kwargs())

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The global gradient norm the step clips to (None: no clipping); may be changed between steps."""
        return self.__dict__.get("_max_grad_norm")

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        check_max_grad_norm(value)
        value = None if value is None else float(value)
        if self.__dict__.get("protocol") is not None:
            self.protocol.set_max_grad_norm(value)
        self._max_grad_norm = value

    @property
    def scaler(self) -> Optional[LossScaler]:
        """The loss scaler (None without loss scaling); a checkpoint with one may bring it."""
        return self.__dict__.get("_scaler")

    @scaler.setter
    def scaler(self, value: Optional[LossScaler]) -> None:
        if self.__dict__.get("protocol") is not None:
            self.protocol.set_loss_scaler(value is not None)
        self._scaler = value

    def _make_engine(self, numel: int, bounds, params: List[torch.Tensor], lowp_dtype: Optional[torch.dtype]):
        """The engine over `numel` elements cut at `bounds`, with :attr:`buffers` as tensors over it."""
        lowp_bytes = 4 if lowp_dtype is None else torch.empty(0, dtype=lowp_dtype).element_size()
        tier = {} if self.nvme is None else dict(nvme_dir=self.nvme.dir, host_budget=self.nvme.host_budget,
                                                 nvme_read_ahead=self.nvme.read_ahead)
        if self.nvme is not None and self.nvme.dir:
            from .. import _cleanup

            _cleanup.remove_stale_spills(self.nvme.dir)  # a killed run's spill folder, named in the log
        # The CPU step on torch's intra-op threads: on memtide's own pool it shared the cores with
        # torch's OpenMP workers, still spinning after backward (0.77-0.92x of torch's fused step on
        # 2 cores). Without the bridge, or after use_torch_threads(False), it stays on memtide's pool.
        torch_bridge.default_torch_threads()
        engine = _memtide.UpdateEngine(numel, list(bounds), low_precision_bytes=lowp_bytes,
                                       device=device_of(params), **tier)
        #: Subgroups whose params and moments live on NVMe (0: no NVMe tier in use).
        self.spilled_subgroups = int(engine.nvme_info()["spilled"])
        arrays = [torch.from_dlpack(a) for a in engine.arrays()]
        pinned = torch.cuda.is_available() and not engine.host_memory
        self.buffers = FlatBuffers(*arrays, lowp=None, pinned=pinned)
        #: The model's low-precision params are views of the engine's device buffer, which every
        #: step writes inside the update phase (no copy pass, no write-back).
        self.model_attached = False
        lowp_params = [p for p in params if p.dtype in _LOWP]
        if lowp_dtype is not None:
            if all(p.is_cuda != engine.host_memory for p in lowp_params):
                self.buffers.lowp = torch.from_dlpack(
                    engine.model_params("bf16" if lowp_dtype == torch.bfloat16 else "fp16"))
                self.model_attached = True
            else:  # a host copy that step() rounds from the masters
                self.buffers.lowp = torch.zeros(numel, dtype=lowp_dtype, pin_memory=pinned)
        return engine

    @property
    def plan(self) -> UpdatePlan:
        """The plan the next step runs (after a step under auto: the plan that step ran)."""
        return UpdatePlan(self.policy, self.k, self.gpu_static_fraction, self.layout.subgroups, self._requested,
                          _memtide.Plan() if self.engine is None else self.engine.plan)

    @property
    def clock(self) -> str:
        """"simulated" on a SimDevice (virtual clocks), "wall" on a real device."""
        return "simulated" if self.engine is None or self.engine.simulated else "wall"

    def _take_versions(self, reads: Optional[torch_reads.ParamReads] = None) -> bool:
        """Takes torch's in-place write counters of the host state and of the params that are views
        of it (a write through ``p.data`` in place is not counted: call sync_master_from_model after
        one); returns whether they changed since they were last taken. `reads`: the step's native
        read, made just now (the params' counters, when every param is a view). Nothing is
        allocated: the first sizable allocation after backward costs tens of us (glibc consolidates
        the small blocks backward freed)."""
        b = self.buffers
        taken = (b.params._version, b.exp_avg._version, b.exp_avg_sq._version)
        views = self._view_versions
        now = (reads.version if reads is not None and len(reads.version) == len(views)
               else torch_reads.int64s_of(map(VERSION, self._views)))
        changed = self._host_versions is not None and (taken != self._host_versions or now != views)
        self._host_versions = taken
        views[:] = now
        return changed

    def host_changed(self) -> None:
        self.engine.host_changed()
        self._host_versions = None

    def expose_state(self) -> None:
        """torch.optim's view of every stepped param's state: views of the flat buffers, and the
        step count, a view of the engine's own (so a step changes it without a call here)."""
        params = self.layout.params
        if self.engine is None or len(self.state) == len(params):
            return
        steps = torch.from_dlpack(self.engine.steps())
        for i, taken in enumerate(steps.tolist()):
            p = params[i]
            if taken > 0 and p not in self.state:
                lo, hi = self.layout.ranges[i]
                shape = self.distribution.local(p).shape
                wrap = self.distribution.wrap
                self.state[p] = {"step": steps[i], "exp_avg": wrap(p, self.buffers.exp_avg[lo:hi].view(shape)),
                                 "exp_avg_sq": wrap(p, self.buffers.exp_avg_sq[lo:hi].view(shape))}

    # -- phases, loss scale -----------------------------------------------------------------------

    def register_ddp(self, model: torch.nn.Module) -> None:
        """Names the DistributedDataParallel model that holds this optimizer's params. Rarely
        needed: TieredAdamW finds that model itself at its first forward, whoever wrapped it (the
        user, Hugging Face Trainer, Accelerate, Lightning), and does what this call does. Call it
        where that cannot work (a DDP model compiled in place with ``ddp.compile()``, whose calls
        are all traced; a first forward after the first step()), or to fail early:

        - the ranks of the model's process group must have built their optimizers alike (else
          ValueError on every rank, naming the setting and each rank's value);
        - the reduced gradients then enter this optimizer bucket by bucket during backward
          (DdpGradients, a communication hook doing DDP's default all-reduce) instead of being
          copied again at step().

        DDP takes one communication hook: a model that has one of its own is refused here
        (ValueError naming it); found at its first forward instead, it keeps its hook, with one
        warning (step() copies the reduced gradients; the results are the same). Calling this
        again with the model already registered, or found, does nothing."""
        from torch.nn.parallel import DistributedDataParallel

        from .distributed import attach_ddp

        who = "TieredAdamW.register_ddp"
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(f"{who}: expected a DistributedDataParallel model, got {type(model).__name__}")
        if self.distribution.ddp is not None:
            if self.distribution.ddp.model() is model:
                return
            raise ValueError(f"{who}: another DDP model is registered already; one per optimizer")
        mine = self.gradient_path.index
        if mine and not any(id(p) in mine for p in model.module.parameters()):
            raise ValueError(f"{who}: the DDP model holds none of this optimizer's params")
        watch = self.__dict__.get("ddp_watch")
        if watch is not None:
            watch.stop()
        attach_ddp(self, model, who, explicit=True)

    def settings(self) -> Dict[str, Any]:
        """What every rank's optimizer must agree on (check_agreement): each setting of the
        constructor, each group's hyper-parameters (every key but "params") and its params
        (count, global shape, dtype, a DTensor's placements). The NVMe directory may differ."""
        from .distributed import describe_param, plain

        scaler, nvme = self.scaler, self.nvme
        eager = self.__dict__.get("_update_during_backward",
                                  None if self.backward_updates is None else self.backward_updates.max_subgroups)
        settings: Dict[str, Any] = {
            "policy": self.policy, "subgroup_size": self.subgroup_size, "k": self.k,
            "gpu_static_fraction": self.gpu_static_fraction, "max_grad_norm": self.max_grad_norm,
            "loss_scale": None if scaler is None else "dynamic" if scaler.dynamic else scaler.scale,
            "nvme": "off" if nvme is None else "on NVMe" if nvme.dir else "host budget only",
            "host_budget": None if nvme is None else nvme.host_budget,
            "nvme_read_ahead": None if nvme is None else nvme.read_ahead,
            "update_during_backward": eager if eager else False,
            "param_groups": len(self.param_groups)}
        if scaler is not None and scaler.dynamic:
            settings.update({f"loss_scale.{k}": v for k, v in scaler.state_dict().items() if k != "dynamic"})
        first = ("lr", "betas", "eps", "weight_decay")
        for gi, group in enumerate(self.param_groups):
            keys = [k for k in first if k in group] + sorted(k for k in group if k not in first and k != "params")
            settings.update({f"{k} of group {gi}": plain(group[k]) for k in keys})
            settings[f"params of group {gi}"] = [describe_param(p) for p in group["params"]]
        return settings

    def attach(self, model: torch.nn.Module):
        """Installs memtide phase marks on `model` and this optimizer (see memtide.install_phase_hooks)."""
        from .. import install_phase_hooks

        return install_phase_hooks(model, self)

    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (``loss`` itself without loss scaling); call backward on it."""
        return loss if self.scaler is None else loss * self.scaler.scale

    # -- the step ---------------------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW step over every param with a gradient (``closure``, if given, recomputes the
        loss first and its value is returned), as torch.optim.AdamW's step."""
        # torch.optim.Optimizer wraps a subclass's step in a profiler range and the calls of the
        # step hooks (Optimizer.profile_hook_step). Entered cold, right after backward and right
        # after the engine's step, that wrapper cost about 0.1 ms a step here, half of what the
        # step costs in Python (bench/results/step-overhead/); it runs when something would see it.
        if type(self).step is not TieredAdamW.step:
            return self._plain_step(closure)  # a subclass's step calling this one: torch's wrapper of it ran the hooks
        if _profiler_enabled() or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_hooks():
            return self._profiled_step(closure)
        return self._plain_step(closure)

    step.hooked = True  # torch's Optimizer._patch_step_function wraps a step that is not: this one decides itself

    def _plain_step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        grad_mode = _is_grad_enabled()
        _set_grad_enabled(False)  # torch.no_grad() without the context object it makes per call
        try:
            return self._step(closure)
        finally:
            _set_grad_enabled(grad_mode)
            if self.gradient_path is not None:
                # The next backward sends its own. Gradients the step read where they lay are let
                # go now: held until the next step, they outlived zero_grad(set_to_none=True), and
                # the next backward's gradients could not reuse their memory (fresh pages, faulted
                # in during backward).
                self.gradient_path.reset()

    _profiled_step = torch.optim.Optimizer.profile_hook_step(_plain_step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim.Optimizer.zero_grad; like step, it opens its profiler range only when a
        profiler runs."""
        if not set_to_none or _profiler_enabled():
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None

    def _step(self, closure: Optional[Callable[[], Any]]) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.mark_update:
            _memtide.mark_phase("update")
        reads = self._reads
        if reads is not None and not reads.read():
            reads = None  # one of them cannot be read natively (a sparse gradient): in Python
        if not self._follow_params(reads):
            reads = None  # taken from the model or rebuilt since the read: read again where needed
        if self.engine is None:
            return loss
        t0 = time.perf_counter()
        self.wait_for_copies()
        groups = self.step_groups()  # checked: a bad value set since the last step is refused before anything moves
        has_grad, stale = self.gradient_path.gather(reads)
        self._note_host_writes(reads)
        t1 = time.perf_counter()
        # The verdict, the norm, the clip factor, skip or step, the updates made during backward:
        # the engine's protocol decides them all (tiering::StepProtocol).
        out = self.last_outcome = self.protocol.step(groups, has_grad, self.grad_scale(), stale)
        self._decided(out, has_grad, time.perf_counter() - t1, t0)
        return loss

    def _decided(self, out: Any, has_grad: bytes, engine_seconds: float, t0: float) -> None:
        """What the optimizer keeps of the protocol's decision and of the step the engine ran, the
        loss scale it moves, and the params it writes back. (One call: each Python call made
        right after the engine's step runs cold.)"""
        stats = self.stats
        stats.regathered += len(self.gradient_path.stale)
        skipped = self.last_step_skipped = out.skipped
        if out.grad_norm is not None:
            self.last_grad_norm = out.grad_norm
        if self.backward_updates is not None:
            self.backward_updates.step_ended()
        if not out.any_gradient:
            return
        nonfinite = out.nonfinite
        if self.scaler is not None:
            self.scaler.update(nonfinite)
        elif nonfinite:
            warnings.warn("TieredAdamW: non-finite gradient " +
                          ("(gradient norm is not finite): step skipped" if skipped else
                           "without loss scaling: params and state now hold NaN/Inf"), RuntimeWarning, stacklevel=3)
        if out.ran:
            self._engine_ran(out.engine, has_grad)
        if skipped:
            stats.skipped += 1
            return
        self.expose_state()  # the engine counted the step of every param with a gradient
        self._write_back(has_grad)
        self._count(has_grad, engine_seconds, time.perf_counter() - t0)

    def _note_host_writes(self, reads: Optional[torch_reads.ParamReads] = None) -> None:
        """The model's params or the state changed in place since the last step (model.load_state_dict,
        an init): copies the engine keeps on a GPU are stale. The engine's own writes leave torch's
        version counters as they are: one reading serves until the next step."""
        if self._take_versions(reads):
            self.host_changed()

    def _engine_ran(self, report: Any, has_grad: bytes) -> None:
        self.last_report = report
        self.measured_ns.append(float(report.measured_ns))
        if self._round_host_copy(has_grad):
            self._take_versions()  # torch wrote the model's copy

    def _count(self, has_grad: bytes, engine_seconds: float, step_seconds: float) -> None:
        params_in_step = (self.layout.numel if all(has_grad) else
                          sum(hi - lo for (lo, hi), g in zip(self.layout.ranges, has_grad) if g))
        s = self.stats
        s.steps += 1
        s.params_updated += params_in_step
        s.engine_seconds += engine_seconds
        s.step_seconds += step_seconds
        s.last_engine_seconds, s.last_step_seconds, s.last_params = engine_seconds, step_seconds, params_in_step
        s.history.append((params_in_step, engine_seconds, step_seconds))

    def _round_host_copy(self, has_grad: bytes) -> bool:
        """A model copy in fp16/bf16 that is not the engine's is rounded from the fp32 masters
        here (round to nearest even, as the fused kernel writes it). Whether it wrote any."""
        b, layout = self.buffers, self.layout
        if b.lowp is None or self.model_attached:
            return False
        wrote = False
        for i, (lo, hi) in enumerate(layout.ranges):
            if has_grad[i] and layout.lowp_of[i]:
                b.lowp[lo:hi].copy_(b.params[lo:hi])
                wrote = True
        return wrote

    def grad_scale(self) -> float:
        """The factor the kernel multiplies each gradient by: the loss scale's inverse, negative
        under ``maximize=True`` (torch's AdamW steps along ``-grad`` then: the same bits)."""
        scale = 1.0 if self.scaler is None else 1.0 / self.scaler.scale
        return -scale if self._maximize() else scale

    def _maximize(self) -> bool:
        directions = {bool(g.get("maximize", False)) for g in self.param_groups}
        if len(directions) > 1:
            raise ValueError("TieredAdamW: the param groups mix maximize=True and maximize=False; one direction per "
                             "optimizer is supported (make one TieredAdamW per direction)")
        return directions == {True}

    def step_groups(self) -> List[Any]:
        """Each param group's hyper-parameters as the engine takes them, checked (ValueError naming
        a bad one)."""
        return [step_params(g) for g in self.param_groups]

    def _write_back(self, has_grad: bytes) -> None:
        """Copies the new values into model params that are not views of the flat buffers (FSDP2's
        shards, GPU params), in one foreach copy: from Python, torch charges about 10 us for each
        copy_ call, most of an FSDP2 step's Python side with a few hundred shards. Where the params
        are and what they are copied from is kept between steps (_copies), since both stay unless
        a param is moved, which makes it anew (_rebind)."""
        layout = self.layout
        copied = layout.copied
        if not copied:
            return
        copies = self._copies
        if copies is None:
            copies = self._copy_plan()
            if not any(getattr(layout.params[i], "_memtide_windowed", False) for i in copied):
                self._copies = copies  # a LayerWindow moves its params every iteration: found again each step
        targets, sources, any_cuda = copies
        if not all(has_grad):
            keep = [k for k, i in enumerate(copied) if has_grad[i]]
            targets, sources = [targets[k] for k in keep], [sources[k] for k in keep]
        torch._foreach_copy_(targets, sources, non_blocking=self.buffers.pinned)  # a CPU target ignores it
        if any_cuda:
            # The next step overwrites the pinned sources: it waits for these copies first.
            event = torch.cuda.Event()
            event.record()
            self._pending_copies = event

    def _copy_plan(self) -> Tuple[List[torch.Tensor], List[torch.Tensor], bool]:
        """For the params _write_back copies into (layout.copied): the tensors it writes, as
        Distribution.write_back would, their new values in the flat buffers, and whether any is on
        a GPU."""
        layout, b = self.layout, self.buffers
        targets = [self.distribution.write_target(layout.params[i]) for i in layout.copied]
        sources = [(b.lowp if layout.lowp_of[i] else b.params)[layout.ranges[i][0]:layout.ranges[i][1]].view(t.shape)
                   for i, t in zip(layout.copied, targets)]
        return targets, sources, any(t.is_cuda for t in targets)

    def wait_for_copies(self) -> None:
        if self._pending_copies is not None:
            self._pending_copies.synchronize()
            self._pending_copies = None

    # -- checkpoints ------------------------------------------------------------------------------

    def sync_state(self) -> None:
        """Makes the host buffers (``buffers``, the tensors in ``state``) hold the newest state.

        Subgroups kept on the GPU between steps hold theirs there; when every param is a view of
        the engine's device buffer, nothing else reads the host copy, so it is refreshed only on
        demand. state_dict() calls this itself.
        """
        if self.backward_updates is not None:
            self.backward_updates.rollback()  # a checkpoint holds no update the next step may still take back
        self.wait_for_copies()
        if self.engine is not None:
            self.engine.sync_host()

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's layout (per param: step, exp_avg, exp_avg_sq), plus the fp32
        master params of fp16/bf16 params under "master_param" and memtide's own state.

        Like torch's, the tensors are references to the live state (views of the flat buffers):
        copy or save the dict before the next step if it must not change.
        """
        self._follow_params()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of TieredAdamW or torch.optim.AdamW (same param order and sizes).

        The whole dict is checked before anything changes: a bad one raises ValueError naming
        what is wrong and leaves the optimizer exactly as it was.
        """
        self._follow_params()
        checkpoint.load_state_dict(self, state_dict)
        self._rebind()

    def save_checkpoint(self, path: Any, *, blocking: bool = False, buffer_bytes: int = 0) -> checkpoint.AsyncSave:
        """Saves the optimizer's state and the fp32 params it holds to the folder `path` while
        training goes on, and returns at once (``blocking=True``: when it is written).

        The folder holds the state as it is now: steps go on, and before one changes a subgroup
        the writer has not reached, the engine copies that subgroup into a buffer of at most
        `buffer_bytes` (0: two of the largest subgroup) or waits for the writer. No second copy of
        the state is made, in memory or in the page cache. The folder appears whole when the save
        commits, replacing a previous checkpoint there; a save that fails or is killed leaves the
        path as it was. One save at a time: a second waits for the first. Read it back with
        load_checkpoint(), memtide.optim.read_checkpoint(), or torch.distributed.checkpoint.load
        through memtide.optim.CheckpointReader.

        Subgroups spilled to NVMe are read from the spill file. Under FSDP2/HSDP every rank calls
        it with the same path and writes its shards as one part; the folder appears once every
        part is in (wait() on every rank), and loads on any number of ranks. Under DDP, call it
        on one rank.
        """
        if not isinstance(blocking, bool):
            raise ValueError(f"TieredAdamW.save_checkpoint: blocking must be True or False, got {blocking!r}")
        self._follow_params()
        save = checkpoint.save_async(self, path, buffer_bytes)
        if blocking:
            save.wait()
        return save

    def load_checkpoint(self, path: Any) -> None:
        """Loads a checkpoint folder save_checkpoint() wrote, on any number of ranks (the parts of
        a sharded save are put together for this rank's shards): every checksum is checked before
        anything changes (OSError naming what is missing or corrupt); the model's params take the
        saved values."""
        self._follow_params()
        checkpoint.load(self, path)
        self._rebind()

    spilled_subgroups = 0  #: subgroups whose params and moments live on NVMe (0 without an NVMe tier)
    engine = None  #: memtide._memtide.UpdateEngine (None while there is nothing to update)
    model_attached = False
    sync_after_step = True

    def nvme_info(self) -> Optional[Dict[str, Any]]:
        """The NVMe tier (see memtide._memtide.UpdateEngine.nvme_info), None without one."""
        return self.engine.nvme_info() if self.spilled_subgroups else None

    @torch.no_grad()
    def sync_master_from_model(self) -> None:
        """Re-reads the master params from the model's params.

        step(), state_dict() and load_state_dict() notice by themselves a param whose storage was
        replaced (``module.to(...)``, ``p.data = x``) or that torch counted as written in place
        (``model.load_state_dict``, ``torch.nn.init``). A write torch does not count, through
        ``p.data`` in place (``p.data.copy_(x)``) into a param that is not a view of the
        optimizer's buffers (a GPU param, an FSDP2 shard), is not: call this after one. For an
        fp16/bf16 param this rebuilds the fp32 master from the low-precision values.
        """
        self._follow_params()
        checkpoint.sync_master_from_model(self)
        self._rebind()

    def __repr__(self) -> str:
        plan = self.plan.summary() if self.engine is not None else "nothing to update"
        return (f"TieredAdamW({self.layout.numel} params in {len(self.layout.subgroups)} subgroup(s) of "
                f"{self.subgroup_size}, {plan}, loss scale {self.scaler!r})")

    def __getstate__(self) -> Dict[str, Any]:
        # torch.optim.Optimizer pickles its groups and state and rebuilds nothing: a copy of this
        # one would have no engine, buffers or hooks, and would fail at its first step instead of here.
        raise TypeError("TieredAdamW cannot be pickled or copied (copy.deepcopy, torch.save of the optimizer "
                        "itself): its state lives in the engine's pinned host buffers and on its device. Save "
                        "opt.state_dict() and load it into a TieredAdamW built over the params it should train")
