"""CPU updates during backward (STRONGHOLD 3-E) for TieredAdamW: a subgroup whose gradients are
all in host memory is updated on a worker thread while backward goes on, instead of waiting for
step(). The work, the choice, the check and the rollback are memtide's engine's
(tiering::BackwardUpdates, bound as memtide._memtide.BackwardUpdates); this module only tells it
what autograd alone knows: when a gradient is final, when a backward starts and ends, and the
step's inputs of that moment.

The update is speculative. It runs with what is known during backward: the hyperparameters, the
step count and the loss scale of that moment, and no clipping. step() then checks each one against
what the sequential step would use: the same segments (learning rate, betas, eps, weight decay,
step count), the same gradient scale, a clip factor of exactly 1.0 (the global norm is within
max_grad_norm), finite gradients when a loss scaler decides, gradients unchanged since (no second
backward, no in-place edit). A subgroup that passes is done: the kernel ran on the same inputs with
the same arguments, so its result is bit for bit the sequential one. One that fails is put back
from the copy of its params, moments and low-precision params taken before the update, and
step() updates it as usual. A skipped step (overflow under loss scaling, a non-finite norm) puts
back every one. Nothing is approximated; the price is the copy (14 bytes per param, held until
step()), a 2-byte (fp16/bf16 model) or 4-byte (fp32 model) copy per param at step(), and, on a
redo, the update done twice.

The model's params do not change before step(): their new values (low-precision, or fp32 for
params that are views of the masters) wait aside and are copied in when the step stands, so a
forward between backward and step (a micro-batch nobody marked, an evaluation) reads the old ones.
The masters and moments are updated in place with a copy to put back; state_dict(),
load_state_dict(), sync_state() and add_param_group() roll every speculation back first.

With CPU params the hook copies each gradient into the flat buffer at once. CUDA gradients travel
the engine's gradient path (upcast on the GPU, copied on its own streams); the worker waits until
everything pushed so far has landed (UpdateEngine::wait_grads_pushed) before it reads them. The
subgroups that take part are chosen after each step (choose()): those whose newest state is in
host memory (the plan's CPU and streamed ones, not its GPU residents) that backward completes
first; the gradient path sends theirs to the host (UpdateEngine::set_host_gradients).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Set, Union

import torch

from .. import _memtide


def fit_before_end(ready_ns: Dict[int, float], cost_ns: Dict[int, float], end_ns: float, cap: int) -> List[int]:
    """The subgroups one worker can update before backward ends, at most `cap`, in the order
    taken: tiering::fit_before_end, the rule the engine and the simulator follow."""
    return _memtide.fit_before_end([(sg, ready_ns[sg], cost_ns[sg]) for sg in ready_ns], end_ns, cap)


class BackwardUpdates:
    """The speculative updates of one TieredAdamW (see the module's docstring).

    Args:
        optimizer: the TieredAdamW.
        max_subgroups: at most this many subgroups are updated during one backward (each holds its
            copy until step()): the host memory the copies take is bounded by that.
    """

    def __init__(self, optimizer: Any, max_subgroups: Union[bool, int]) -> None:
        self._opt = weakref.ref(optimizer)  # the optimizer holds this: no cycle to keep its pinned memory
        #: True: the engine's default over the layout's subgroups (BackwardUpdates.default_max_subgroups).
        self._asked = max_subgroups
        self._max = 1
        self._native = None
        self._watching = False

    @property
    def max_subgroups(self) -> int:
        return self._max

    @max_subgroups.setter
    def max_subgroups(self, n: int) -> None:
        self._native.max_subgroups = n
        self._asked = self._max = n

    def choose(self, ns_per_param: Optional[float] = None) -> None:
        """Chooses the subgroups the next backward updates (the engine's rule)."""
        self._native.choose(ns_per_param)

    def rebuild(self) -> None:
        """The optimizer's layout changed (construction, add_param_group): a new engine."""
        opt = self._opt()
        if self._native is not None:
            self._native.rollback()
        self._native = None
        if opt.engine is None:
            return  # nothing to update
        self._max = (_memtide.BackwardUpdates.default_max_subgroups(len(opt.layout.subgroups)) if self._asked is True
                     else int(self._asked))
        self._native = _memtide.BackwardUpdates(opt.engine, self._max)
        lowp = opt.buffers.lowp
        if lowp is not None and not opt.model_attached:
            self._native.set_model_copy(lowp.data_ptr(), str(lowp.dtype).replace("torch.", ""))
        self._native.rebuild([p.requires_grad and p.is_leaf for p in opt.layout.params])
        self._watching = False

    @property
    def native(self) -> Any:
        """The engine's BackwardUpdates (the step protocol takes, redoes or puts back its work)."""
        return self._native

    # ---- during backward --------------------------------------------------------------------------

    def start(self, subgroups: List[int]) -> None:
        """Starts the updates of `subgroups` (the protocol said their gradients are complete) with
        the step's inputs as they stand now (the engine reads those subgroups' params only)."""
        opt = self._opt()
        flags = bytes(p.grad is not None for p in opt.layout.params)
        groups, scale = opt.step_groups(), opt.grad_scale()
        for sg in subgroups:
            self._native.submit(sg, groups, flags, scale)

    def watch(self) -> None:
        """Times this backward to its end (for the next choice) from its first gradient; called on
        backward's own thread (DDP's bucket hook calls it there, its gradients arrive elsewhere)."""
        if not self._watching and torch._C._current_graph_task_id() != -1:
            self._watching = True
            self._native.backward_started()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._watching = False
        self._native.backward_ended()

    def step_ended(self) -> None:
        """The protocol's step settled, took or put back every update: the next backward is timed afresh."""
        self._watching = False  # a backward that failed never reached its end

    def rollback(self) -> None:
        self._watching = False
        if self._native is not None:
            self._native.rollback()

    @property
    def stats(self) -> Dict[str, int]:
        s = self._native.stats
        return {"speculated": s.speculated, "kept": s.kept, "redone": s.redone, "rolled_back": s.rolled_back}

    @property
    def last_choice(self) -> Dict[str, object]:
        """How the subgroups for the next backward were chosen: ``rule`` ("count" until a backward
        and an update have been timed, then "time"), ``subgroups``, and for "time" the margin."""
        c = self._native.last_choice
        choice: Dict[str, object] = dict(rule=c.rule, subgroups=list(c.subgroups), candidates=c.candidates)
        if c.rule == "time":
            choice.update(ns_per_param=c.ns_per_param, backward_tail_s=c.backward_tail_s)
        return choice

    @property
    def _chosen(self) -> Set[int]:
        return set(self._native.chosen)

    # What the last backward showed, as the engine keeps it (tests look at and try the rule).
    @property
    def _ready_ns(self) -> Dict[int, float]:
        return dict(self._native.ready_ns)

    @property
    def _ns_per_param(self) -> float:
        return self._native.last_choice.ns_per_param

    @_ns_per_param.setter
    def _ns_per_param(self, ns: float) -> None:
        self._native.choose(ns)
