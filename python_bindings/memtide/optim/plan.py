"""The update plan as TieredAdamW shows it: the engine's typed Plan (memtide._memtide.Plan) beside
what the policy asked for, and the words that say both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .. import _memtide

#: The update policies, as the engine parses them.
POLICIES = _memtide.POLICIES


def requested(policy: str, subgroups: Tuple[Tuple[int, int], ...], k: Optional[float],
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
    """Where each subgroup is updated: the engine's plan (``engine_plan``, a memtide._memtide.Plan)
    and what the policy asked for (``requested``; None: left to the engine's performance model).
    ``reason`` says why they differ."""

    policy: str
    k: Optional[float]
    gpu_static_fraction: float
    subgroups: Tuple[Tuple[int, int], ...]  # [start, end) in the flat buffers
    requested: Optional[Tuple[str, ...]]
    engine_plan: "_memtide.Plan"

    @property
    def placement(self) -> Tuple[str, ...]:
        """"cpu" or "gpu" per subgroup."""
        return tuple("cpu" if p == _memtide.Placement.cpu else "gpu" for p in self.engine_plan.placement)

    @property
    def reason(self) -> str:
        return self.engine_plan.reason

    def counts(self) -> Dict[str, int]:
        placement = self.placement
        return {"cpu": placement.count("cpu"), "gpu": placement.count("gpu")}

    def as_dict(self) -> Dict[str, object]:
        """The engine's plan for JSON output, with the memory it was sized from."""
        ep = self.engine_plan
        b = ep.budget
        d = ep.as_dict()
        d["budget"] = {"update_bytes": b.update_bytes, "resident_bytes": b.resident_bytes, "source": b.source,
                       "slot_bytes": b.slot_bytes, "slots_taken": b.slots_taken, "residents_taken": b.residents_taken,
                       "phase_min_free": dict(b.phase_min_free)}
        d["headroom_bytes"], d["headroom_from"] = b.update_bytes, b.source
        return d

    def summary(self) -> str:
        placement = self.placement
        n = len(placement)
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
        if self.requested is not None and self.requested != placement:
            text += f"; the policy asked for {self.requested.count('gpu')} on GPU"
        ep = self.engine_plan
        statics = ep.placement.count(_memtide.Placement.gpu_static)
        if statics:
            text += f" ({statics} GPU-static)"
        if len(ep.placement) <= 64:
            text += f" [{ep.marks}]"
        if self.reason:
            text += f" ({self.reason})"
        text += "; " + budget_words(ep.budget)
        return text


def budget_words(budget: "_memtide.PlanBudget") -> str:
    """How much device memory each phase left and what the plan took from it."""
    fmt = _memtide.format_bytes
    left = ", ".join(f"{phase} {fmt(free)}" for phase, free in budget.phase_min_free
                     if free is not None and phase != "other")
    text = (f"device memory: update phase {fmt(budget.update_bytes)} for slots (took {fmt(budget.slots_taken)}), "
            f"whole iteration {fmt(budget.resident_bytes)} for residents (took {fmt(budget.residents_taken)}), "
            f"from {budget.source}")
    if left:
        text += f"; lowest free per phase: {left}"
    return text
