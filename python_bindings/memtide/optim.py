"""TieredAdamW: AdamW whose state lives in flat host buffers split into subgroups.

The optimizer keeps fp32 master params, exp_avg, exp_avg_sq and fp32 gradients in four flat,
contiguous, pinned host buffers owned by its engine, cut into subgroups of ``subgroup_size``
elements; subgroup boundaries ignore tensor boundaries. The model keeps its own params (fp32,
fp16 or bf16, on its own device); after each update the new values are written back to them.

Every numerical update goes through one seam, an engine: it owns the flat buffers, gets the
update plan (which subgroup runs where) and the step's arguments, and returns whether a
non-finite gradient was seen. :class:`SchedulerEngine` is memtide's C++ engine
(``tiering::UpdateEngine``): the buffers live in the device's pinned, NUMA-bound HostArena, and it
plans and runs every step on the UpdateScheduler. :class:`SubgroupEngine`, the fallback where the
runtime cannot run it, steps everything with the fused CPU kernel over torch tensors. Placement
never changes the arithmetic, so every policy gives bit-identical results.

``k`` has one meaning everywhere in memtide: the stride of the paper's Algorithm 1, one in every
k subgroups updated on the GPU (k = 1 all, k = 2 every other one, k = 1.5 two in three).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import _memtide
from ._memtide import format_bytes
from .backward_updates import BackwardUpdates

__all__ = [
    "POLICIES",
    "LossScaler",
    "Segment",
    "StepArgs",
    "SchedulerEngine",
    "SubgroupEngine",
    "TieredAdamW",
    "UpdatePlan",
]

POLICIES = _memtide.POLICIES

_LOWP = (torch.float16, torch.bfloat16)
_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _accepted(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


# ---- loss scaling -------------------------------------------------------------------------------


class LossScaler:
    """Loss scale with torch.amp.GradScaler's rules.

    Dynamic: an overflowing step (a non-finite gradient after unscaling) is skipped and the scale
    multiplied by ``backoff_factor``; after ``growth_interval`` consecutive good steps the scale is
    multiplied by ``growth_factor``. Static (``dynamic=False``): the scale never changes, an
    overflowing step is still skipped.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True) -> None:
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"LossScaler: init_scale must be a finite number > 0, got {init_scale!r}")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1.0 and math.isfinite(growth_factor)):
            raise ValueError(f"LossScaler: growth_factor must be a finite number > 1, got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval > 0):
            raise ValueError(f"LossScaler: growth_interval must be an integer > 0, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.dynamic = bool(dynamic)
        self.growth_tracker = 0

    def update(self, found_nonfinite: bool) -> None:
        """Applies one step's outcome to the scale."""
        if not self.dynamic:
            return
        if found_nonfinite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "dynamic": self.dynamic,
            "growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.dynamic = bool(state["dynamic"])
        self.growth_tracker = int(state["growth_tracker"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, growth_interval={self.growth_interval})"


def _make_scaler(loss_scale: Union[None, str, float, LossScaler]) -> Optional[LossScaler]:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"TieredAdamW: loss_scale {loss_scale!r} is not accepted; "
                             "accepted: None, 'dynamic', a finite number > 0, or a LossScaler")
        return LossScaler()
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"TieredAdamW: loss_scale must be a finite number > 0, got {loss_scale!r}")
        return LossScaler(init_scale=float(loss_scale), dynamic=False)
    raise ValueError(f"TieredAdamW: loss_scale {loss_scale!r} is not accepted; "
                     "accepted: None, 'dynamic', a finite number > 0, or a LossScaler")


# ---- plan and engine ----------------------------------------------------------------------------


def _requested(policy: str, subgroups: Tuple[Tuple[int, int], ...], k: Optional[float],
               gpu_static_fraction: float) -> Optional[Tuple[str, ...]]:
    """What `policy` asks for when memory is no object ("cpu" or "gpu" per subgroup), from the one
    placement function (the PerfModel's plan); None for auto without k (the model decides)."""
    if policy == "auto" and k is None:
        return None
    sizes = [e - s for s, e in subgroups]
    if not sizes:
        return ()
    plan = _memtide.plan_update(sizes, policy=policy, static_fraction=gpu_static_fraction,
                                k=None if policy in ("cpu", "static") else k,
                                gpu_slot_limit=len(sizes), gpu_static_limit=len(sizes))
    return tuple("cpu" if c == "c" else "gpu" for c in plan["placement"])


@dataclass(frozen=True)
class UpdatePlan:
    """Where each subgroup is updated.

    ``requested`` is what the policy asks for (None: left to the engine's performance model);
    ``placement`` is what the engine runs; ``reason`` says why they differ.
    """

    policy: str
    k: Optional[float]
    gpu_static_fraction: float
    subgroups: Tuple[Tuple[int, int], ...]  # [start, end) in the flat buffers
    requested: Optional[Tuple[str, ...]]
    placement: Tuple[str, ...]
    reason: str = ""
    #: The engine's own plan when it has one (SchedulerEngine: the PerfModel's plan dict, with
    #: "placement" as one letter per subgroup: c CPU, g streamed through the GPU, s GPU-static).
    engine_plan: Optional[Dict[str, Any]] = field(default=None, compare=False, hash=False)

    def counts(self) -> Dict[str, int]:
        return {"cpu": self.placement.count("cpu"), "gpu": self.placement.count("gpu")}

    def summary(self) -> str:
        n = len(self.placement)
        c = self.counts()
        if c["gpu"] == 0:
            where = "all on CPU" if n != 1 else "on CPU"
        elif c["cpu"] == 0:
            where = "all on GPU"
        else:
            where = f"{c['cpu']} on CPU, {c['gpu']} on GPU"
        knobs = []
        if self.k is not None:
            knobs.append(f"k={self.k:g}")
        if self.gpu_static_fraction:
            knobs.append(f"gpu_static_fraction={self.gpu_static_fraction:g}")
        head = f"policy {self.policy}" + (f" ({', '.join(knobs)})" if knobs else "")
        text = f"{head}: {n} subgroup{'s' if n != 1 else ''}, {where}"
        if self.requested is not None and self.requested != self.placement:
            text += f"; the policy asked for {self.requested.count('gpu')} on GPU"
        if self.engine_plan is not None:
            ep = self.engine_plan
            statics = ep["placement"].count("s")
            if statics:
                text += f" ({statics} GPU-static)"
            if len(ep["placement"]) <= 64:
                text += f" [{ep['placement']}]"
        if self.reason:
            text += f" ({self.reason})"
        budget = (self.engine_plan or {}).get("budget")
        if budget:
            text += "; " + _budget_words(budget)
        return text


def _budget_words(budget: Dict[str, Any]) -> str:
    """How much device memory each phase left and what the plan took from it."""
    left = ", ".join(f"{phase} {format_bytes(free)}" for phase, free in budget["phase_min_free"].items()
                     if free is not None and phase != "other")
    text = (f"device memory: update phase {format_bytes(budget['update_bytes'])} for slots (took "
            f"{format_bytes(budget['slots_taken'])}), whole iteration {format_bytes(budget['resident_bytes'])} for "
            f"residents (took {format_bytes(budget['residents_taken'])}), from {budget['source']}")
    if left:
        text += f"; lowest free per phase: {left}"
    return text


@dataclass
class Segment:
    """A run of one subgroup whose elements share hyperparameters and step count."""

    subgroup: int
    start: int
    end: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1-based step count after this update
    lowp: bool  # write the low-precision copy of the new params for these elements


@dataclass
class StepArgs:
    segments: List[Segment]
    grad_scale: float = 1.0  # multiplier applied to each gradient (1 / loss scale)
    clip: float = 1.0  # multiplier from gradient-norm clipping
    # Check every segment first; a non-finite gradient then leaves everything untouched.
    skip_if_nonfinite: bool = False
    # The gradient path's verdict when every gradient came through it (no host rescan needed).
    grads_finite: Optional[bool] = None
    # Segments already updated (during backward): nothing to do, but the engine sees them.
    done: List[Segment] = field(default_factory=list)


@dataclass
class FlatBuffers:
    """The optimizer's host state. All fp32 except ``lowp`` (the model's low-precision dtype)."""

    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grads: torch.Tensor
    lowp: Optional[torch.Tensor]
    pinned: bool

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in (self.params, self.exp_avg, self.exp_avg_sq, self.grads))
        if self.lowp is not None:
            total += self.lowp.numel() * self.lowp.element_size()
        return total


class SubgroupEngine:
    """Owns the flat buffers (torch tensors, pinned where CUDA is) and runs the update of every
    subgroup of a plan over them with the fused CPU kernel.

    The fallback engine: it has no GPU update path, so every subgroup, whatever the policy, is
    stepped on the CPU. ``plan`` turns a policy into the placement it will actually execute.
    """

    name = "cpu-fused"

    def __init__(self, numel: int, lowp_dtype: Optional[torch.dtype], subgroups: Tuple[Tuple[int, int], ...],
                 device: int = 0) -> None:
        pinned = torch.cuda.is_available()

        def flat(dtype: torch.dtype) -> torch.Tensor:
            # At least one element: a zero-size pinned allocation is refused on some builds.
            return torch.zeros(max(numel, 1), dtype=dtype, pin_memory=pinned)

        self.buffers = FlatBuffers(params=flat(torch.float32), exp_avg=flat(torch.float32),
                                   exp_avg_sq=flat(torch.float32), grads=flat(torch.float32),
                                   lowp=flat(lowp_dtype) if lowp_dtype is not None else None, pinned=pinned)
        self.subgroups = subgroups
        self.device = device

    def gpu_update_unavailable(self) -> str:
        """Why subgroups cannot be updated on a GPU here ("" if they can)."""
        if not torch.cuda.is_available():
            return f"no GPU: {_device_words()}"
        return "this engine updates on CPU only"

    def plan(self, policy: str, k: Optional[float], gpu_static_fraction: float) -> UpdatePlan:
        subgroups = self.subgroups
        requested = _requested(policy, subgroups, k, gpu_static_fraction)
        placement = tuple("cpu" for _ in subgroups)
        reason = ""
        if requested is None or "gpu" in requested:
            reason = self.gpu_update_unavailable()
        return UpdatePlan(policy, k, gpu_static_fraction, subgroups, requested, placement, reason)

    def predict_seconds(self, plan: UpdatePlan) -> Optional[float]:
        """Predicted update time of `plan`, when a performance model is available."""
        return None

    def host_changed(self) -> None:
        """The flat buffers were changed outside step() (nothing is cached elsewhere here)."""

    def sync_host(self) -> None:
        """Makes the flat buffers hold the newest state (they always do here)."""

    def model_buffer(self, lowp_dtype: Optional[torch.dtype], lowp_params: Sequence[torch.Tensor]
                     ) -> Optional[torch.Tensor]:
        """A flat buffer for the model's low-precision params that step() writes itself, or None
        (then the optimizer writes them back after each step)."""
        return None

    def step(self, plan: UpdatePlan, args: StepArgs) -> bool:
        """Updates every segment; True if a non-finite gradient was seen.

        With ``args.skip_if_nonfinite`` all segments are checked first and nothing changes if
        one is non-finite.
        """
        b = self.buffers
        if args.skip_if_nonfinite:
            for s in args.segments:
                if not _memtide.grads_finite_cpu(b.grads[s.start:s.end], args.grad_scale, args.clip):
                    return True
        nonfinite = False
        for s in args.segments:
            lo, hi = s.start, s.end
            out = b.lowp[lo:hi] if s.lowp else None
            nonfinite |= _memtide.adamw_step_cpu(
                b.params[lo:hi], b.grads[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi],
                lr=s.lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps, weight_decay=s.weight_decay, step=s.step,
                grad_scale=args.grad_scale, clip=args.clip, l2=False, out=out)
        return nonfinite


class SchedulerEngine(SubgroupEngine):
    """memtide's C++ engine (``_memtide.UpdateEngine``, ``tiering::UpdateEngine``) on the
    optimizer's device: the GPU with CUDA, else a data-mode SimDevice whose "GPU" updates really
    run (on the host) while its clocks are virtual.

    The fp32 state lives in the device's HostArena (exact sizes, pinned, on the GPU's NUMA node)
    and the tensors of :attr:`buffers` are views of it. Each plan is sized from the phase
    tracker (slots from the update phase's memory, static residents from the whole iteration's)
    on the rates a Calibration learns from every step; ``auto`` re-plans each step.
    """

    name = "scheduler"

    def __init__(self, numel: int, lowp_dtype: Optional[torch.dtype], subgroups: Tuple[Tuple[int, int], ...],
                 device: int = 0, nvme: Optional["NvmeTier"] = None) -> None:
        lowp_bytes = 4 if lowp_dtype is None else torch.empty(0, dtype=lowp_dtype).element_size()
        tier = {} if nvme is None else dict(nvme_dir=nvme.dir, host_budget=nvme.host_budget,
                                            nvme_read_ahead=nvme.read_ahead)
        self.native = _memtide.UpdateEngine(numel, list(subgroups), low_precision_bytes=lowp_bytes, device=device,
                                            **tier)
        #: Subgroups whose params and moments live on NVMe (0: no NVMe tier in use).
        self.spilled = int(self.native.nvme_info()["spilled"])
        params, exp_avg, exp_avg_sq, grads = (torch.from_dlpack(a) for a in self.native.arrays())
        pinned = torch.cuda.is_available() and not self.native.simulated
        # The low-precision copy is made by model_buffer(): the engine's own, or a pinned one.
        self.buffers = FlatBuffers(params=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, grads=grads, lowp=None,
                                   pinned=pinned)
        self.subgroups = subgroups
        self.device = device
        #: The model's low-precision params are views of the engine's device buffer, which every
        #: step writes inside the update phase (no copy pass, no write-back).
        self.model_attached = False
        #: Copy the newest state of GPU-static residents into the host buffers after each step:
        #: set by the optimizer when something reads them every step (params that are views of
        #: the fp32 masters, or are copied back from them).
        self.sync_every_step = True
        self.last_report: Optional[Dict[str, Any]] = None
        #: Every step's measured update phase in ns, on ``clock`` (skipped steps excluded).
        self.measured_ns: List[float] = []

    @staticmethod
    def available(numel: int) -> str:
        """Why the runtime's device cannot run the engine here ("" if it can)."""
        if numel == 0:
            return "no params to update"
        try:
            backend = _memtide.backend()
            if backend == "sim" and _memtide.options().get("sim_phantom") == "true":
                return "the runtime's SimDevice is in phantom mode (MEMTIDE_SIM_PHANTOM=true)"
            if _memtide.device_count() < 1:
                return f"the memtide backend {backend} has no device"
        except Exception as e:  # a bad MEMTIDE_* setting must not break the optimizer
            return f"memtide runtime unavailable: {e}"
        return ""

    def gpu_update_unavailable(self) -> str:
        return ""

    def plan(self, policy: str, k: Optional[float], gpu_static_fraction: float) -> UpdatePlan:
        requested = _requested(policy, self.subgroups, k, gpu_static_fraction)
        ep = self.native.plan(policy, k=None if k is None else float(k), static_fraction=float(gpu_static_fraction))
        placement = tuple("cpu" if c == "c" else "gpu" for c in ep["placement"])
        return UpdatePlan(policy, k, gpu_static_fraction, self.subgroups, requested, placement, ep["reason"], ep)

    def predict_seconds(self, plan: UpdatePlan) -> Optional[float]:
        if plan.engine_plan is None:
            return None
        return plan.engine_plan["prediction"]["total_ns"] * 1e-9

    def host_changed(self) -> None:
        """The flat buffers were changed outside step(): GPU-static copies are stale."""
        self.native.host_changed()

    def sync_host(self) -> None:
        """GPU-static residents hold the newest state of their subgroups: copy it to the host."""
        self.native.sync_host()

    def model_buffer(self, lowp_dtype: Optional[torch.dtype], lowp_params: Sequence[torch.Tensor]
                     ) -> Optional[torch.Tensor]:
        """The engine's device buffer for the model's fp16/bf16 params, when they live on the
        engine's kind of device (CUDA params with a GPU, CPU params with the SimDevice); else a
        pinned host copy (``buffers.lowp``) that step() rounds from the masters, and None."""
        if lowp_dtype is None or not lowp_params:
            return None
        on_gpu = not self.native.simulated
        if any(p.is_cuda != on_gpu for p in lowp_params):
            self.buffers.lowp = torch.zeros(self.buffers.params.numel(), dtype=lowp_dtype, pin_memory=self.buffers.pinned)
            return None
        buffer = torch.from_dlpack(self.native.model_params("bf16" if lowp_dtype == torch.bfloat16 else "fp16"))
        self.model_attached = True
        self.buffers.lowp = buffer
        return buffer

    @property
    def clock(self) -> str:
        """"simulated" on a SimDevice (virtual clocks), "wall" on a real device."""
        return "simulated" if self.native.simulated else "wall"

    def step(self, plan: UpdatePlan, args: StepArgs) -> bool:
        if not args.segments and not args.done:
            return False
        ep = plan.engine_plan
        if ep is None or plan.subgroups != self.subgroups:
            plan = self.plan(plan.policy, plan.k, plan.gpu_static_fraction)
            ep = plan.engine_plan
        # Subgroups updated during backward are "done" (d): the engine's scheduler, cached by its
        # subgroups, stays the one a full step uses, and its residents stay where they are.
        every = sorted(args.segments + args.done, key=lambda s: s.start)
        segments = [(s.subgroup, s.start, s.end, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step)
                    for s in every]
        placement = ep["placement"]
        if args.done:
            marks = list(placement)
            for s in args.done:
                marks[s.subgroup] = "d"
            placement = "".join(marks)
        report = self.native.step(placement, ep["gpu_slots"], ep["prediction"]["total_ns"], segments,
                                  grad_scale=args.grad_scale, clip=args.clip, l2=False,
                                  skip_if_nonfinite=args.skip_if_nonfinite, grads_finite=args.grads_finite)
        self.last_report = report
        if not report["skipped"]:
            self.measured_ns.append(float(report["measured_ns"]))
            if self.sync_every_step:
                self.native.sync_host()
        b = self.buffers
        if not report["skipped"] and b.lowp is not None and not self.model_attached:
            # The model's low-precision copy is not the engine's: round it from the fp32 masters
            # here (round to nearest even, as the fused kernel writes it).
            for s in args.segments:
                if s.lowp:
                    b.lowp[s.start:s.end].copy_(b.params[s.start:s.end])
        return bool(report["nonfinite"])


def _grad_hook(optimizer: "weakref.ref[TieredAdamW]", i: int, p: torch.Tensor) -> None:
    opt = optimizer()
    if opt is not None:
        opt._grad_ready(i, p)


def _device_of(params: Sequence[torch.Tensor]) -> int:
    """The CUDA device the params live on (0 when all are on the CPU); one per optimizer."""
    devices = sorted({p.device.index or 0 for p in params if p.is_cuda})
    if len(devices) > 1:
        raise ValueError(f"TieredAdamW: params live on cuda:{devices[0]} and cuda:{devices[1]}; one device per "
                         "optimizer is supported (make one TieredAdamW per device)")
    return devices[0] if devices else 0


def _device_words() -> str:
    try:
        backend = _memtide.backend()
    except Exception:  # a bad MEMTIDE_DEVICE must not break the optimizer
        return "CPU only"
    return "SimDevice" if backend == "sim" else f"memtide backend {backend}"


# ---- the optimizer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmeTier:
    """Where and when the optimizer state spills to NVMe (TieredAdamW's nvme_dir and host_budget)."""

    dir: Optional[str]
    host_budget: int
    read_ahead: int


def _nvme_tier(nvme_dir: Any, host_budget: Any, nvme_read_ahead: Any) -> Optional[NvmeTier]:
    """Checks TieredAdamW's NVMe arguments; None when no host budget is set."""
    import os

    if not (isinstance(nvme_read_ahead, int) and not isinstance(nvme_read_ahead, bool) and nvme_read_ahead >= 1):
        raise ValueError(f"TieredAdamW: nvme_read_ahead must be an integer >= 1, got {nvme_read_ahead!r}")
    if host_budget is None:
        if nvme_dir is not None:
            raise ValueError("TieredAdamW: nvme_dir needs host_budget, the host memory the optimizer state may take "
                             "(e.g. host_budget='64GiB'); the subgroups that do not fit it go to NVMe")
        return None
    if isinstance(host_budget, bool) or not isinstance(host_budget, (int, str)):
        raise ValueError(f"TieredAdamW: host_budget must be bytes (an int) or a size such as '64GiB', "
                         f"got {host_budget!r}")
    budget = _memtide.parse_bytes(host_budget) if isinstance(host_budget, str) else host_budget
    if budget <= 0:
        raise ValueError(f"TieredAdamW: host_budget must be > 0 bytes, got {host_budget!r}")
    if nvme_dir is not None:
        if not isinstance(nvme_dir, (str, os.PathLike)):
            raise ValueError(f"TieredAdamW: nvme_dir must be a path, got {nvme_dir!r}")
        nvme_dir = os.fspath(nvme_dir)
        if not nvme_dir:
            raise ValueError("TieredAdamW: nvme_dir is empty; expected a directory on an NVMe drive")
    return NvmeTier(nvme_dir, int(budget), nvme_read_ahead)


@dataclass
class _Layout:
    params: List[torch.nn.Parameter]
    group_of: List[int]
    ranges: List[Tuple[int, int]]
    lowp_of: List[bool]  # the model param is fp16/bf16: the kernel writes its copy
    aliased: List[bool]  # the model param's storage is a view of the flat buffers
    pieces: List[List[Tuple[int, int, int]]]  # per subgroup: (param index, start, end)
    subgroups: Tuple[Tuple[int, int], ...]
    numel: int


@dataclass
class _Flushed:
    """A gradient the hook sent on its way: which tensor, at which in-place version, its norm."""

    address: int
    version: int
    norm: Optional[torch.Tensor]
    on_device: bool  # through the engine's gradient path (with its NaN/Inf verdict)


@dataclass
class UpdateStats:
    """What step() has done so far."""

    steps: int = 0
    skipped: int = 0
    params_updated: int = 0
    engine_seconds: float = 0.0
    step_seconds: float = 0.0
    last_engine_seconds: float = 0.0
    last_step_seconds: float = 0.0
    last_params: int = 0
    history: List[Tuple[int, float, float]] = field(default_factory=list)  # (params, engine s, step s)


class TieredAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) over flat host buffers in subgroups.

    Args:
        params, lr, betas, eps, weight_decay: as torch.optim.AdamW; per-group values are honoured
            at every step (LR schedulers work). ``amsgrad=True`` is rejected.
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

    With an NVMe tier, the tensors of ``state`` hold the spilled subgroups' values only after
    :meth:`sync_state` (state_dict() calls it); write to them only after it, too.

    The model's params stay where they are. CPU params become views of the optimizer's buffers
    (fp32: of the master params; fp16/bf16: of the low-precision copy the kernel writes), so
    their update costs no copy; params on a GPU are copied back after each step.
    """

    #: The engine class: built with (numel, low-precision dtype, subgroups, CUDA device), it owns
    #: the flat buffers and plans and runs every update. None (the default): SchedulerEngine when
    #: the memtide runtime's device can run it, else SubgroupEngine.
    engine_class: Optional[type] = None

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, policy: str = "auto",
                 subgroup_size: int = 100_000_000, gpu_static_fraction: float = 0.0, k: Optional[float] = None,
                 loss_scale: Union[None, str, float, LossScaler] = None,
                 max_grad_norm: Optional[float] = None, host_budget: Union[None, int, str] = None,
                 nvme_dir: Any = None, nvme_read_ahead: int = 2,
                 update_during_backward: Union[bool, int] = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"TieredAdamW: policy {policy!r} is not accepted; accepted: {_accepted(POLICIES)}")
        if not (isinstance(subgroup_size, int) and not isinstance(subgroup_size, bool) and subgroup_size > 0):
            raise ValueError(f"TieredAdamW: subgroup_size must be an integer > 0, got {subgroup_size!r}")
        if not (isinstance(gpu_static_fraction, (int, float)) and not isinstance(gpu_static_fraction, bool)
                and 0.0 <= gpu_static_fraction <= 1.0):
            raise ValueError(f"TieredAdamW: gpu_static_fraction must be in [0, 1], got {gpu_static_fraction!r}")
        if k is not None and not (isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k)
                                  and k >= 1):
            raise ValueError(f"TieredAdamW: k must be None or a stride >= 1 (one in every k subgroups on the GPU), "
                             f"got {k!r}")
        if policy == "cpu" and (gpu_static_fraction or k is not None):
            raise ValueError("TieredAdamW: policy 'cpu' updates everything on the CPU; "
                             f"gpu_static_fraction={gpu_static_fraction!r} and k={k!r} would be ignored")
        if policy == "static" and k is not None:
            raise ValueError(f"TieredAdamW: k={k!r} applies to policies 'interleaved' and 'auto', not 'static'")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                              and not isinstance(max_grad_norm, bool)
                                              and math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"TieredAdamW: max_grad_norm must be None or a finite number > 0, got {max_grad_norm!r}")
        if not (isinstance(update_during_backward, bool) or (isinstance(update_during_backward, int)
                                                              and update_during_backward >= 1)):
            raise ValueError("TieredAdamW: update_during_backward must be True, False or a number of subgroups >= 1, "
                             f"got {update_during_backward!r}")
        self.nvme = _nvme_tier(nvme_dir, host_budget, nvme_read_ahead)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self._ready = False
        self.policy = policy
        self.subgroup_size = subgroup_size
        self.gpu_static_fraction = float(gpu_static_fraction)
        self.k = None if k is None else float(k)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.scaler = _make_scaler(loss_scale)
        self.stats = UpdateStats()
        self.last_step_skipped = False
        self.last_grad_norm: Optional[float] = None
        self._mark_update = False
        self._steps: List[int] = []
        self._pending_copies: Optional[Any] = None  # CUDA event after the last write-back
        self._host_versions: Optional[Tuple[int, ...]] = None  # _versions() after the last update
        #: Whether the next backward is the last before step() (gradient accumulation: set False for
        #: the micro-batches before the last). Updates during backward happen only in the last.
        self.last_micro_batch = True
        self._eager: Optional[BackwardUpdates] = None
        self._stale: set = set()
        super().__init__(params, defaults)
        self._ready = True
        self._build()
        if update_during_backward:
            cap = (max(1, math.ceil(len(self._layout.subgroups) / 4)) if update_during_backward is True
                   else int(update_during_backward))
            self._eager = BackwardUpdates(self, cap)
            self._eager.rebuild()

    # -- param groups -----------------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        if self._ready:
            self._build()

    def _build(self) -> None:
        """(Re)creates the flat buffers from param_groups, keeping the state of known params."""
        if getattr(self, "_eager", None) is not None:
            self._eager.rollback()
        old_layout: Optional[_Layout] = getattr(self, "_layout", None)
        old_buffers: Optional[FlatBuffers] = getattr(self, "buffers", None)
        old_index = {id(p): i for i, p in enumerate(old_layout.params)} if old_layout else {}
        old_steps = self._steps
        if old_buffers is not None:
            self.engine.sync_host()  # residents may hold newer state than the old host buffers

        params, group_of, ranges = [], [], []
        lowp_dtype: Optional[torch.dtype] = None
        offset = 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.dtype not in _SUPPORTED_PARAM_DTYPES:
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
                ranges.append((offset, offset + p.numel()))
                offset += p.numel()
        numel = offset
        if -(-numel // self.subgroup_size) > _memtide.MAX_SUBGROUPS:
            raise ValueError(f"TieredAdamW: subgroup_size {self.subgroup_size} cuts {numel} params into "
                             f"{-(-numel // self.subgroup_size)} subgroups, at most {_memtide.MAX_SUBGROUPS} are "
                             f"supported: use subgroup_size >= {-(-numel // _memtide.MAX_SUBGROUPS)}")
        bounds = tuple((s, min(s + self.subgroup_size, numel)) for s in range(0, numel, self.subgroup_size))
        engine_class = self._engine_class(numel)
        if self.nvme is not None:
            if not issubclass(engine_class, SchedulerEngine):
                why = SchedulerEngine.available(numel) or f"engine_class is {engine_class.__name__}"
                raise ValueError(f"TieredAdamW: host_budget needs memtide's engine, which cannot run here: {why}")
            engine = engine_class(numel, lowp_dtype, bounds, _device_of(params), nvme=self.nvme)
        else:
            engine = engine_class(numel, lowp_dtype, bounds, _device_of(params))
        engine.model_buffer(lowp_dtype, [p for p in params if p.dtype in _LOWP])
        buffers = engine.buffers
        steps = [0] * len(params)
        lowp_of = [p.dtype in _LOWP for p in params]
        aliased = [False] * len(params)
        with torch.no_grad():
            for i, (p, (lo, hi)) in enumerate(zip(params, ranges)):
                j = old_index.get(id(p))
                if j is not None and old_buffers is not None:
                    olo, ohi = old_layout.ranges[j]
                    buffers.params[lo:hi].copy_(old_buffers.params[olo:ohi])
                    buffers.exp_avg[lo:hi].copy_(old_buffers.exp_avg[olo:ohi])
                    buffers.exp_avg_sq[lo:hi].copy_(old_buffers.exp_avg_sq[olo:ohi])
                    steps[i] = old_steps[j]
                else:
                    buffers.params[lo:hi].copy_(p.detach().reshape(-1))
                if lowp_of[i]:
                    buffers.lowp[lo:hi].copy_(p.detach().reshape(-1))
                source = buffers.lowp if lowp_of[i] else buffers.params
                if source.device == p.device:
                    # The param becomes a view of the buffer the step writes: no copy-back.
                    p.data = source[lo:hi].view(p.shape)
                    aliased[i] = True
                if getattr(engine, "spilled", 0):
                    # Spilled subgroups filled so far go to NVMe now: at most about a subgroup of
                    # them is in host memory at once.
                    engine.native.spill_host(hi)
        if getattr(engine, "spilled", 0):
            model_only = engine.model_attached and all(lowp_of) and all(aliased)
            if not model_only:
                bad = next(i for i in range(len(params)) if not (lowp_of[i] and aliased[i]))
                raise ValueError(
                    f"TieredAdamW: with {engine.spilled} subgroup(s) on NVMe the model's params must be fp16/bf16 on "
                    f"the optimizer's device, so that each step writes them directly; param {bad} is "
                    f"{params[bad].dtype} on {params[bad].device} (an fp32 or host copy of the model would need the "
                    "very state that spilled in host memory)")
            engine.native.spill_host(numel)

        pieces: List[List[Tuple[int, int, int]]] = [[] for _ in bounds]
        for i, (lo, hi) in enumerate(ranges):
            if hi == lo:
                continue
            for sg in range(lo // self.subgroup_size, (hi - 1) // self.subgroup_size + 1):
                s, e = bounds[sg]
                pieces[sg].append((i, max(lo, s), min(hi, e)))

        self._layout = _Layout(params, group_of, ranges, lowp_of, aliased, pieces, bounds, numel)
        # The gradient path: each gradient leaves for the host the moment backward finishes it.
        for handle in getattr(self, "_grad_hooks", ()):
            handle.remove()
        # A weak reference: the params outlive the optimizer and must not keep it (and its pinned
        # memory) alive through their hooks.
        me = weakref.ref(self)
        # Frozen params get none (step() gathers whatever gradient they have later).
        self._grad_hooks = [p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, me, i))
                            for i, p in enumerate(params) if p.requires_grad and p.is_leaf]
        self._flushed: List[Optional[_Flushed]] = [None] * len(params)
        self._device_path = (isinstance(engine, SchedulerEngine) and not engine.native.simulated)
        self.buffers = buffers
        self._steps = steps
        self.engine = engine
        # Only when every param is a view of the engine's model buffer does nothing read the fp32
        # masters between steps (checkpoints sync them on demand).
        model_only = getattr(engine, "model_attached", False) and all(l and a for l, a in zip(lowp_of, aliased))
        if hasattr(engine, "sync_every_step"):
            engine.sync_every_step = not model_only
        self._host_versions = None
        self.plan = self.engine.plan(self.policy, self.k, self.gpu_static_fraction)
        if getattr(self, "_eager", None) is not None:
            self._eager.rebuild()
        self.state.clear()
        for i in range(len(params)):
            if steps[i] > 0:
                self._expose_state(i)

    def _versions(self) -> Tuple[int, ...]:
        """torch's in-place write counters of the host state and of the params that are views of it
        (a write through ``p.data`` is not counted: call sync_master_from_model after one)."""
        b, layout = self.buffers, self._layout
        return (b.params._version, b.exp_avg._version, b.exp_avg_sq._version,
                *(p._version for p, a in zip(layout.params, layout.aliased) if a))

    def _host_changed(self) -> None:
        self.engine.host_changed()
        self._host_versions = None

    def _engine_class(self, numel: int) -> type:
        if self.engine_class is not None:
            return self.engine_class
        return SchedulerEngine if not SchedulerEngine.available(numel) else SubgroupEngine

    def _expose_state(self, i: int) -> None:
        """torch.optim's view of param i's state: views of the flat buffers, and the step."""
        p = self._layout.params[i]
        lo, hi = self._layout.ranges[i]
        self.state[p] = {
            "step": torch.tensor(float(self._steps[i]), dtype=torch.float32),
            "exp_avg": self.buffers.exp_avg[lo:hi].view(p.shape),
            "exp_avg_sq": self.buffers.exp_avg_sq[lo:hi].view(p.shape),
        }

    # -- phases, loss scale -----------------------------------------------------------------------

    def attach(self, model: torch.nn.Module):
        """Installs memtide phase marks on `model` and this optimizer (see memtide.install_phase_hooks)."""
        from . import install_phase_hooks

        return install_phase_hooks(model, self)

    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (``loss`` itself without loss scaling); call backward on it."""
        return loss if self.scaler is None else loss * self.scaler.scale

    # -- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._mark_update:
            _memtide.mark_phase("update")
        t0 = time.perf_counter()
        self._wait_for_copies()
        layout, b = self._layout, self.buffers
        for group in self.param_groups:
            _check_group(group)

        speculated = self._eager.settle() if self._eager is not None else {}
        has_grad, path_verdict = self._gather_grads()
        self.last_step_skipped = False
        if not any(has_grad):
            self._flushed = [None] * len(layout.params)
            if self._eager is not None:
                self._eager.rollback()
            return loss

        grad_scale = self._grad_scale()
        clip = 1.0
        nonfinite = False
        if self.max_grad_norm is not None:
            norm = math.sqrt(self._grad_norm_squares(has_grad)) * grad_scale
            self.last_grad_norm = norm
            if math.isfinite(norm):
                clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
            else:
                nonfinite = True
        self._flushed = [None] * len(layout.params)  # the next backward sends its own

        segments = self._segments(has_grad)
        params_in_step = sum(s.end - s.start for s in segments)
        engine_seconds = 0.0
        engine_ran = False
        done: set = set()
        if not nonfinite and self._host_versions is not None and self._host_versions != self._versions():
            # The model's params or the state were changed in place since the last step
            # (model.load_state_dict, an init): copies the engine keeps on a GPU are stale.
            self._host_changed()
            self._host_versions = self._versions()
        if speculated:
            # Updates made during backward stand where they used exactly the step's inputs; the
            # others are put back and run below (backward_updates.py).
            done = self._eager.accept(segments, grad_scale, clip, self._stale, self.scaler is not None)
            if nonfinite or (self.scaler is not None and self._eager.nonfinite()):
                self._eager.rollback()  # the whole step is skipped
                done = set()
                nonfinite = True
        if not nonfinite:
            pending = [s for s in segments if s.subgroup not in done]
            args = StepArgs(pending, grad_scale=grad_scale, clip=clip, skip_if_nonfinite=self.scaler is not None,
                            grads_finite=path_verdict)
            args.done = [s for s in segments if s.subgroup in done]
            nonfinite_done = self._eager is not None and self._eager.nonfinite()
            if self.policy == "auto" and self.k is None and isinstance(self.engine, SchedulerEngine):
                # The PerfModel's plan follows the calibrated rates and the headroom: every step.
                self.plan = self.engine.plan(self.policy, self.k, self.gpu_static_fraction)
            t1 = time.perf_counter()
            nonfinite = self.engine.step(self.plan, args) if (args.segments or args.done) else False
            engine_seconds = time.perf_counter() - t1
            engine_ran = not (nonfinite and args.skip_if_nonfinite)
            if not engine_ran and done:
                self._eager.rollback()  # skipped: the updates made during backward go too
            elif done:
                self._eager.publish()
            nonfinite |= nonfinite_done
            self._host_versions = self._versions()

        if self._eager is not None:
            self._eager.finish()
        if self.scaler is not None:
            self.scaler.update(nonfinite)
        # Skipped: with a loss scaler the engine left everything untouched; with clipping the
        # norm told before anything ran. Without either, the step ran as torch.optim.AdamW would.
        skipped = nonfinite and not engine_ran
        if nonfinite and self.scaler is None:
            warnings.warn("TieredAdamW: non-finite gradient " +
                          ("(gradient norm is not finite): step skipped" if skipped else
                           "without loss scaling: params and state now hold NaN/Inf"),
                          RuntimeWarning, stacklevel=2)
        self.last_step_skipped = skipped
        if skipped:
            self.stats.skipped += 1
            return loss

        for i, flag in enumerate(has_grad):
            if flag:
                self._steps[i] += 1
                p = layout.params[i]
                st = self.state.get(p)
                if st is None:
                    self._expose_state(i)
                else:
                    st["step"].fill_(float(self._steps[i]))
        self._write_back(has_grad)
        step_seconds = time.perf_counter() - t0
        s = self.stats
        s.steps += 1
        s.params_updated += params_in_step
        s.engine_seconds += engine_seconds
        s.step_seconds += step_seconds
        s.last_engine_seconds, s.last_step_seconds, s.last_params = engine_seconds, step_seconds, params_in_step
        s.history.append((params_in_step, engine_seconds, step_seconds))
        return loss

    @torch.no_grad()
    def _grad_ready(self, i: int, p: torch.Tensor) -> None:
        """Backward has finished param i's gradient (a post-accumulate-grad hook): send it to the
        host gradient buffer now, overlapping the rest of backward, and take its norm where it is.

        CUDA gradients go through the engine's gradient path (upcast on the GPU, D2H on its own
        streams, checked for NaN/Inf on the way); CPU gradients are copied (upcast) at once. With
        gradient accumulation every micro-batch sends the accumulated gradient again: the last,
        complete one is what step() finds.
        """
        g = p.grad
        lo, hi = self._layout.ranges[i]
        if g is None or g.is_sparse or hi == lo:
            return
        b = self.buffers
        if g.is_cuda:
            if not (self._device_path and g.device.index == self.engine.device and g.is_contiguous()
                    and g.dtype in _SUPPORTED_PARAM_DTYPES):
                return  # gathered by step()
            self.engine.native.push_grad(lo, g.data_ptr(), str(g.dtype).replace("torch.", ""), hi - lo,
                                         torch.cuda.current_stream(g.device).cuda_stream)
            norm = None if self.max_grad_norm is None else torch.linalg.vector_norm(g, dtype=torch.float32)
            self._flushed[i] = _Flushed(g.data_ptr(), g._version, norm, on_device=True)
            if self._eager is not None:
                self._eager.grad_ready(i)
        else:
            b.grads[lo:hi].copy_(g.reshape(-1))
            norm = None if self.max_grad_norm is None else torch.linalg.vector_norm(b.grads[lo:hi])
            self._flushed[i] = _Flushed(g.data_ptr(), g._version, norm, on_device=False)
            if self._eager is not None:
                self._eager.grad_ready(i)

    def _gather_grads(self) -> Tuple[List[bool], Optional[bool]]:
        """Makes the flat fp32 gradient buffer hold every gradient: waits for the gradient path,
        then copies (upcast) those it did not carry or that changed since (an in-place edit
        between backward and step). Returns which params have a gradient, and the gradient path's
        NaN/Inf verdict when it carried all of them (else None: the engine scans the host)."""
        layout, grads = self._layout, self.buffers.grads
        has_grad = [False] * len(layout.params)
        verdict = self.engine.native.finish_grads() if self._device_path else True
        all_on_device = True
        stale = []
        for i, p in enumerate(layout.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("TieredAdamW does not support sparse gradients")
            has_grad[i] = True
            f = self._flushed[i]
            if f is not None and f.address == g.data_ptr() and f.version == g._version:
                all_on_device &= f.on_device
                continue
            if f is not None and getattr(g, "_memtide_copy_of", None) == (f.address, f.version, g._version):
                # An unchanged copy of the gradient the hook took (the layer window sent it home).
                all_on_device &= f.on_device
                continue
            self._flushed[i] = None
            stale.append(i)
        self._stale = set(stale)
        if stale and self._device_path:
            # Gradients the path kept on the GPU go to the host first, so the copies below win.
            self.engine.native.grads_to_host()
        any_cuda = False
        for i in stale:
            g, (lo, hi) = layout.params[i].grad, layout.ranges[i]
            any_cuda |= g.is_cuda
            all_on_device = False
            grads[lo:hi].copy_(g.reshape(-1), non_blocking=g.is_cuda)
        if any_cuda:
            torch.cuda.synchronize()
        return has_grad, (verdict if all_on_device and any(has_grad) else None)

    def _grad_norm_squares(self, has_grad: List[bool]) -> float:
        """Sum of the squared gradient norms, each taken where its gradient is (in the hook)."""
        b, sq = self.buffers, 0.0
        for i, (lo, hi) in enumerate(self._layout.ranges):
            if has_grad[i] and hi > lo:
                f = self._flushed[i]
                norm = f.norm if f is not None and f.norm is not None else torch.linalg.vector_norm(b.grads[lo:hi])
                sq += float(norm) ** 2
        return sq

    def _grad_scale(self) -> float:
        return 1.0 if self.scaler is None else 1.0 / self.scaler.scale

    def _hyper(self) -> List[Tuple[float, float, float, float, float]]:
        hyper = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper.append((float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                          float(group["weight_decay"])))
        return hyper

    def _subgroup_segments(self, sg: int) -> List[Segment]:
        """Subgroup sg's segments as step() would make them now (for an update during backward)."""
        params = self._layout.params
        has_grad = {i: params[i].grad is not None for i, _, _ in self._layout.pieces[sg]}
        return self._segments(has_grad, only=sg)

    def _segments(self, has_grad: Union[Sequence[bool], Dict[int, bool]], only: Optional[int] = None
                  ) -> List[Segment]:
        """The step's segments: `has_grad[i]` says whether param i has a gradient (only the params
        of subgroup `only` are read when it is given)."""
        layout = self._layout
        hyper = self._hyper()
        segments: List[Segment] = []
        for sg, pieces in enumerate(layout.pieces):
            if only is not None and sg != only:
                continue
            current: Optional[Segment] = None
            current_group = -1
            for i, lo, hi in pieces:
                if not has_grad[i]:
                    current = None
                    continue
                gi, step, lowp = layout.group_of[i], self._steps[i] + 1, layout.lowp_of[i]
                if (current is not None and current.end == lo and current.step == step and current.lowp == lowp
                        and gi == current_group):
                    current.end = hi
                    continue
                lr, beta1, beta2, eps, wd = hyper[gi]
                current = Segment(sg, lo, hi, lr, beta1, beta2, eps, wd, step, lowp)
                current_group = gi
                segments.append(current)
        return segments

    def _write_back(self, has_grad: List[bool]) -> None:
        """Copies the new values into model params that are not views of the flat buffers."""
        layout, b = self._layout, self.buffers
        any_cuda = False
        for i, p in enumerate(layout.params):
            if not has_grad[i] or layout.aliased[i]:
                continue
            lo, hi = layout.ranges[i]
            source = b.lowp if layout.lowp_of[i] else b.params
            p.data.copy_(source[lo:hi].view(p.shape), non_blocking=b.pinned and p.is_cuda)
            any_cuda |= p.is_cuda
        if any_cuda:
            # The next step overwrites the pinned sources: it waits for these copies first.
            event = torch.cuda.Event()
            event.record()
            self._pending_copies = event

    def _wait_for_copies(self) -> None:
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
        if self._eager is not None:
            self._eager.rollback()  # a checkpoint holds no update the next step may still take back
        self._wait_for_copies()
        self.engine.sync_host()

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's layout (per param: step, exp_avg, exp_avg_sq), plus the fp32
        master params of fp16/bf16 params under "master_param" and memtide's own state.

        Like torch's, the tensors are references to the live state (views of the flat buffers):
        copy or save the dict before the next step if it must not change.
        """
        self.sync_state()
        packed = super().state_dict()
        layout = self._layout
        index = {id(p): i for i, p in enumerate(layout.params)}
        state = {}
        order = [p for g in self.param_groups for p in g["params"]]
        for idx, entry in packed["state"].items():
            entry = dict(entry)
            i = index[id(order[idx])]
            if layout.lowp_of[i]:
                lo, hi = layout.ranges[i]
                entry["master_param"] = self.buffers.params[lo:hi].view(layout.params[i].shape)
            state[idx] = entry
        packed["state"] = state
        packed["memtide"] = {
            "format": 1,
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
        }
        return packed

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of TieredAdamW or torch.optim.AdamW (same param order and sizes).

        The whole dict is checked before anything changes: a bad one raises ValueError naming
        what is wrong and leaves the optimizer exactly as it was.
        """
        where = "TieredAdamW.load_state_dict"
        entries, groups, scaler_state = _check_state_dict(state_dict, self.param_groups, where)
        if self._eager is not None:
            self._eager.rollback()
        layout = self._layout
        index = {id(p): i for i, p in enumerate(layout.params)}

        # Everything is known good from here on.
        self._wait_for_copies()
        if self.spilled_subgroups:
            self.sync_state()  # spilled ranges in host memory, so that what is written here counts
        self._host_changed()
        # The model is the truth for fp32 params and the fallback for fp16/bf16 ones (a state dict
        # of torch.optim.AdamW has no master params); saved masters replace it below.
        self.sync_master_from_model()
        b = self.buffers
        with torch.no_grad():
            b.exp_avg.zero_()
            b.exp_avg_sq.zero_()
            for i in range(len(self._steps)):
                self._steps[i] = 0
            for p, exp_avg, exp_avg_sq, step, master in entries:
                i = index[id(p)]
                lo, hi = layout.ranges[i]
                b.exp_avg[lo:hi].copy_(exp_avg.reshape(-1))
                b.exp_avg_sq[lo:hi].copy_(exp_avg_sq.reshape(-1))
                self._steps[i] = step
                if master is not None:
                    b.params[lo:hi].copy_(master.reshape(-1))
                    if layout.lowp_of[i]:
                        b.lowp[lo:hi].copy_(b.params[lo:hi])
                        if not layout.aliased[i]:
                            p.data.copy_(b.lowp[lo:hi].view(p.shape))
        for values, group in zip(groups, self.param_groups):
            group.update(values)
        if scaler_state is not None:
            if self.scaler is None:
                self.scaler = LossScaler()
            self.scaler.load_state_dict(scaler_state)
        self.state.clear()
        for i in range(len(self._steps)):
            if self._steps[i] > 0:
                self._expose_state(i)
        if self.spilled_subgroups:
            self.engine.native.spill_host(layout.numel)  # back within the host budget now

    @property
    def spilled_subgroups(self) -> int:
        """Subgroups whose params and moments live on NVMe (0 without an NVMe tier)."""
        return int(getattr(self.engine, "spilled", 0))

    def nvme_info(self) -> Optional[Dict[str, Any]]:
        """The NVMe tier (see memtide._memtide.UpdateEngine.nvme_info), None without one."""
        return self.engine.native.nvme_info() if self.spilled_subgroups else None

    @torch.no_grad()
    def sync_master_from_model(self) -> None:
        """Re-reads the master params from the model's params.

        Needed only after the model's params changed outside step() and load_state_dict (e.g.
        ``model.load_state_dict`` after this optimizer was created) for params that are not views
        of the optimizer's buffers: params on a GPU, and fp16/bf16 params (whose fp32 master is
        then rebuilt from the low-precision values). In-place changes to the other params
        (``model.load_state_dict``, ``torch.nn.init``) are noticed at the next step; a write
        through ``p.data`` is not, so call this after one.
        """
        self._wait_for_copies()
        if self.spilled_subgroups:
            self.sync_state()  # the moments of spilled subgroups must be there beside the new params
        self._host_changed()
        layout, b = self._layout, self.buffers
        for i, p in enumerate(layout.params):
            lo, hi = layout.ranges[i]
            if layout.lowp_of[i]:
                if not layout.aliased[i]:
                    b.lowp[lo:hi].copy_(p.detach().reshape(-1))
                b.params[lo:hi].copy_(b.lowp[lo:hi])
            elif not layout.aliased[i]:
                b.params[lo:hi].copy_(p.detach().reshape(-1))

    def __repr__(self) -> str:
        return (f"TieredAdamW({self._layout.numel} params in {len(self._layout.subgroups)} subgroup(s) of "
                f"{self.subgroup_size}, {self.plan.summary()}, loss scale {self.scaler!r})")


def _check_state_dict(state_dict: Any, param_groups: List[Dict[str, Any]], where: str):
    """Checks a whole optimizer state dict against `param_groups` without changing anything.

    Returns the per-param entries to load ((param, exp_avg, exp_avg_sq, step, master or None)),
    each group's hyperparameters, and the loss scaler's state (or None). Raises ValueError naming
    the first problem: structure, counts, sizes, dtypes, a step that is not a count >= 0, a
    hyperparameter or loss-scaler value outside its range, amsgrad state.
    """
    def bad(message: str) -> ValueError:
        return ValueError(f"{where}: {message}")

    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), (list, tuple)) \
            or not isinstance(state_dict.get("state"), dict):
        raise bad("expected a dict with 'state' (a dict) and 'param_groups' (a list)")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise bad(f"the state dict has {len(saved_groups)} param groups, this optimizer has {len(param_groups)}")
    groups = []
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise bad(f"param group {gi} is not a dict with a 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise bad(f"param group {gi} has {len(saved['params'])} params in the state dict, "
                      f"{len(group['params'])} here")
        if saved.get("amsgrad", False):
            raise bad("the state dict comes from amsgrad=True, which TieredAdamW does not support")
        values = {k: v for k, v in saved.items() if k != "params"}
        try:
            _check_group({**group, **values})
        except ValueError as e:
            raise bad(f"param group {gi}: {e}") from None
        groups.append(values)
    order = [p for g in param_groups for p in g["params"]]
    saved_order = [idx for g in saved_groups for idx in g["params"]]
    saved_state = state_dict["state"]
    entries = []
    for idx, p in zip(saved_order, order):
        entry = saved_state.get(idx)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise bad(f"state of param {idx} is not a dict")
        if "max_exp_avg_sq" in entry:
            raise bad("the state dict has max_exp_avg_sq (amsgrad), which TieredAdamW does not support")
        tensors = {}
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            value = entry.get(key)
            if value is None:
                if key == "master_param":
                    continue
                raise bad(f"state of param {idx} has no {key!r}")
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise bad(f"{key} of param {idx} must be a floating-point tensor, got "
                          f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}")
            if value.numel() != p.numel():
                raise bad(f"{key} of param {idx} has {value.numel()} elements, the param has {p.numel()}")
            tensors[key] = value
        step = entry.get("step", 0)
        if isinstance(step, torch.Tensor):
            step = step.item() if step.numel() == 1 else None
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) \
                or step < 0 or step != int(step):
            raise bad(f"step of param {idx} must be a whole number >= 0, got {entry.get('step')!r}")
        entries.append((p, tensors["exp_avg"], tensors["exp_avg_sq"], int(step), tensors.get("master_param")))
    memtide_state = state_dict.get("memtide") or {}
    if not isinstance(memtide_state, dict):
        raise bad("'memtide' must be a dict")
    scaler_state = memtide_state.get("loss_scaler")
    if scaler_state is not None:
        try:
            check = LossScaler(init_scale=scaler_state["scale"], growth_factor=scaler_state["growth_factor"],
                               backoff_factor=scaler_state["backoff_factor"],
                               growth_interval=scaler_state["growth_interval"], dynamic=scaler_state["dynamic"])
            tracker = scaler_state["growth_tracker"]
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"the loss scaler's state is not valid: {e}") from None
        if isinstance(tracker, bool) or not isinstance(tracker, int) or not 0 <= tracker < check.growth_interval:
            raise bad(f"the loss scaler's growth_tracker must be an int in [0, growth_interval), got {tracker!r}")
    return entries, groups, scaler_state


def _check_group(group: Dict[str, Any]) -> None:
    """Rejects hyperparameters the kernel cannot take, naming the value and what is accepted."""
    if group.get("amsgrad", False):
        raise ValueError("TieredAdamW: amsgrad=True is not supported (accepted: False); "
                         "use torch.optim.AdamW(amsgrad=True) for AMSGrad")
    lr = group["lr"]
    lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"TieredAdamW: lr must be a finite number >= 0, got {group['lr']!r}")
    try:
        beta1, beta2 = (float(x) for x in group["betas"])
    except (TypeError, ValueError):
        raise ValueError(f"TieredAdamW: betas must be a pair of numbers in [0, 1), got {group['betas']!r}") from None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"TieredAdamW: betas must be a pair of numbers in [0, 1), got {group['betas']!r}")
    eps = float(group["eps"])
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"TieredAdamW: eps must be a finite number >= 0, got {group['eps']!r}")
    wd = float(group["weight_decay"])
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(f"TieredAdamW: weight_decay must be a finite number >= 0, got {group['weight_decay']!r}")
