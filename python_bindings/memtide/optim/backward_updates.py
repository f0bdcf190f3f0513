"""CPU updates during backward (STRONGHOLD 3-E) for TieredAdamW: a subgroup whose gradients are
all in host memory is updated on a worker thread while backward goes on, instead of waiting for
step().

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

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import torch

from .. import _memtide



@dataclass
class _Piece:
    """One segment's speculative update: what to put back, or what to publish."""

    start: int
    end: int
    exp_avg: torch.Tensor      # the moments before the update (they are updated in place)
    exp_avg_sq: torch.Tensor
    params: Optional[torch.Tensor] = None      # fp32 masters before (updated in place: no model views them)
    new_params: Optional[torch.Tensor] = None  # fp32 params the model views: the new values, kept aside
    new_lowp: Optional[torch.Tensor] = None    # the model's fp16/bf16 params: the new values, kept aside


@dataclass
class _Speculation:
    subgroup: int
    segments: List[Any]
    grad_scale: float
    pieces: List[_Piece] = field(default_factory=list)
    future: Optional[Future] = None
    nonfinite: bool = False


def fit_before_end(ready_ns: Dict[int, float], cost_ns: Dict[int, float], end_ns: float, cap: int) -> List[int]:
    """The subgroups one worker can update before backward ends, at most `cap`, in the order
    taken: tiering::fit_before_end, the rule the simulator follows too, on measured times."""
    return _memtide.fit_before_end([(sg, ready_ns[sg], cost_ns[sg]) for sg in ready_ns], end_ns, cap)


class BackwardUpdates:
    """The speculative updates of one TieredAdamW (see the module's docstring).

    Args:
        optimizer: the TieredAdamW.
        max_subgroups: at most this many subgroups are updated during one backward (each holds its
            copy until step()): the host memory the copies take is bounded by that.
    """

    def __init__(self, optimizer: Any, max_subgroups: int) -> None:
        self._opt = weakref.ref(optimizer)
        self.max_subgroups = max_subgroups
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtide-backward-update")
        self._left: List[int] = []
        self._subgroups_of: List[List[int]] = []
        self._needed: List[int] = []
        self._seen: Set[int] = set()
        self._spec: Dict[int, _Speculation] = {}
        self._invalid: Set[int] = set()
        self._chosen: Set[int] = set()
        # What the last backward showed: when each subgroup's gradients were complete and when
        # backward ended (perf_counter ns), and the worker's time per param (a running mean).
        self._ready_ns: Dict[int, float] = {}
        self._backward_end_ns: Optional[float] = None
        self._watching = False
        self._ns_per_param: Optional[float] = None
        #: How the subgroups for the next backward were chosen: ``rule`` ("count" until a backward
        #: and an update have been timed, then "time"), ``subgroups``, and for "time" the margin.
        self.last_choice: Dict[str, object] = {}
        self.stats = {"speculated": 0, "kept": 0, "redone": 0, "rolled_back": 0}

    def rebuild(self) -> None:
        """The optimizer's layout changed (construction, add_param_group)."""
        self.rollback()
        opt = self._opt()
        layout = opt._layout
        self._subgroups_of = [[] for _ in layout.params]
        needed: List[Set[int]] = [set() for _ in layout.pieces]
        for sg, pieces in enumerate(layout.pieces):
            for i, _, _ in pieces:
                p = layout.params[i]
                if p.requires_grad and p.is_leaf:
                    needed[sg].add(i)
                    if sg not in self._subgroups_of[i]:
                        self._subgroups_of[i].append(sg)
        self._needed = [len(n) for n in needed]
        self._ready_ns, self._backward_end_ns = {}, None  # timed under the old subgroups' numbers
        self._reset_counts()
        self.choose()

    def choose(self) -> None:
        """Which subgroups the next backward may update, of those whose newest state is in host
        memory between steps (every one the plan does not keep resident on the GPU, none on NVMe).
        Once a backward and an update have been timed: those the worker can finish before backward
        ends, as the last backward's timing says (fit_before_end), at most `max_subgroups`. Before
        that: the `max_subgroups` that backward completes first (the last ones: backward runs the
        layers in reverse). Their gradients go to the host whatever the plan said."""
        opt = self._opt()
        marks = opt.plan.engine_plan.marks
        candidates = [sg for sg, c in enumerate(marks) if c in "cgd"]
        if opt.spilled_subgroups:
            candidates = []
        ready = {sg: self._ready_ns[sg] for sg in candidates if sg in self._ready_ns}
        if ready and self._ns_per_param is not None and self._backward_end_ns is not None:
            subgroups = opt._layout.subgroups
            cost = {sg: (subgroups[sg][1] - subgroups[sg][0]) * self._ns_per_param for sg in ready}
            chosen = fit_before_end(ready, cost, self._backward_end_ns, self.max_subgroups)
            self.last_choice = dict(rule="time", subgroups=sorted(chosen), candidates=len(candidates),
                                    ns_per_param=self._ns_per_param,
                                    backward_tail_s=(self._backward_end_ns - min(ready.values())) / 1e9)
        else:
            chosen = candidates[-self.max_subgroups:]
            self.last_choice = dict(rule="count", subgroups=sorted(chosen), candidates=len(candidates))
        self._chosen = set(chosen)
        opt.engine.set_host_gradients([sg in self._chosen for sg in range(len(marks))])

    def _reset_counts(self) -> None:
        self._left = list(self._needed)
        self._seen = set()

    # ---- during backward --------------------------------------------------------------------------

    def grad_ready(self, i: int) -> None:
        """Param i's gradient is in the host buffer (the optimizer's hook, CPU path)."""
        opt = self._opt()
        if opt is None or not opt.last_micro_batch:
            return
        first = i not in self._seen
        self._seen.add(i)
        if not self._watching and torch._C._current_graph_task_id() != -1:
            # The first gradient of this backward: time it to its end (for the next choice).
            self._watching = True
            self._ready_ns = {}
            self._backward_end_ns = None
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        for sg in self._subgroups_of[i]:
            if sg in self._spec:
                # A gradient of an updated subgroup arrived again (a second backward before the
                # step): the update read the earlier one.
                self._invalid.add(sg)
                continue
            if not first:
                continue
            self._left[sg] -= 1
            if self._left[sg] == 0:
                self._ready_ns[sg] = time.perf_counter_ns()
                if sg in self._chosen:  # at most max_subgroups of them
                    self._submit(opt, sg)

    def _backward_ended(self) -> None:
        self._watching = False
        self._backward_end_ns = time.perf_counter_ns()

    def _submit(self, opt: Any, sg: int) -> None:
        segments = opt._subgroup_segments(sg)
        if not segments:
            return
        spec = _Speculation(sg, segments, opt._grad_scale())
        self._spec[sg] = spec
        self.stats["speculated"] += 1
        native = opt.engine if opt._grads.device_path else None
        spec.future = self._pool.submit(self._run, opt.buffers, spec, native)

    def _run(self, b, spec: _Speculation, native) -> bool:
        if native is not None:
            # CUDA gradients reach the host array through the engine's gradient path, on its own
            # streams: wait until what was pushed (this subgroup's included) has landed.
            native.wait_grads_pushed()
        t0 = time.perf_counter_ns()
        # The model's params (views of the low-precision buffer, or of the fp32 masters) must not
        # change before step(): a forward in between (a micro-batch nobody said was one, an
        # evaluation) would read them. Their new values wait aside; the rest is updated in place
        # with a copy to put back.
        nonfinite = False
        for s in spec.segments:
            lo, hi = s.start, s.end
            piece = _Piece(lo, hi, b.exp_avg[lo:hi].clone(), b.exp_avg_sq[lo:hi].clone())
            if s.low_precision:
                piece.params = b.params[lo:hi].clone()
                # On the host even when the model's copy is the engine's device buffer (CUDA params):
                # the CPU kernel writes it here, publish() copies it over.
                piece.new_lowp = torch.empty(hi - lo, dtype=b.lowp.dtype, pin_memory=b.lowp.is_cuda)
                params, out = b.params[lo:hi], piece.new_lowp
            else:
                piece.new_params = b.params[lo:hi].clone()
                params, out = piece.new_params, None
            spec.pieces.append(piece)
            nonfinite |= _memtide.adamw_step_cpu(
                params, b.grads[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi], lr=s.lr, beta1=s.beta1,
                beta2=s.beta2, eps=s.eps, weight_decay=s.weight_decay, step=s.step, grad_scale=spec.grad_scale,
                clip=1.0, l2=False, out=out)
        spec.nonfinite = nonfinite
        n = sum(seg.end - seg.start for seg in spec.segments)
        if n > 0:
            rate = (time.perf_counter_ns() - t0) / n
            self._ns_per_param = rate if self._ns_per_param is None else 0.5 * (self._ns_per_param + rate)
        return nonfinite

    # ---- at the step ------------------------------------------------------------------------------

    def settle(self) -> Dict[int, _Speculation]:
        """Waits for every update begun; returns them by subgroup."""
        failed = None
        for spec in self._spec.values():
            try:
                spec.future.result()
            except Exception as e:  # noqa: BLE001 - put everything back, then surface it
                failed = failed or e
        if failed is not None:
            for spec in self._spec.values():
                self._restore(spec)
            self.finish()
            raise RuntimeError(f"TieredAdamW: an update during backward failed (every one was put back): "
                               f"{failed}") from failed
        return self._spec

    def accept(self, segments: List[Any], grad_scale: float, clip: float, stale: Set[int],
               scaler: bool) -> Set[int]:
        """Which settled subgroups the step takes as done; the others are put back now."""
        pieces = self._opt()._layout.pieces
        by_subgroup: Dict[int, List[Any]] = {}
        for s in segments:
            by_subgroup.setdefault(s.subgroup, []).append(s)
        done: Set[int] = set()
        for sg, spec in self._spec.items():
            stale_here = any(i in stale for i, _, _ in pieces[sg])
            if (sg not in self._invalid and not stale_here and clip == 1.0 and spec.grad_scale == grad_scale
                    and by_subgroup.get(sg, []) == spec.segments and not (scaler and spec.nonfinite)):
                done.add(sg)
        for sg in list(self._spec):
            if sg not in done:
                self._restore(self._spec.pop(sg))
                self.stats["redone"] += 1
        self.stats["kept"] += len(done)
        return done

    def publish(self) -> None:
        """The step stands: the kept updates' new model params take their place."""
        b = self._opt().buffers
        for spec in self._spec.values():
            for piece in spec.pieces:
                if piece.new_lowp is not None:
                    b.lowp[piece.start:piece.end].copy_(piece.new_lowp)
                if piece.new_params is not None:
                    b.params[piece.start:piece.end].copy_(piece.new_params)

    def nonfinite(self) -> bool:
        return any(spec.nonfinite for spec in self._spec.values())

    def finish(self) -> None:
        """The step is over (kept updates stay); the next backward starts afresh."""
        self._spec = {}
        self._invalid = set()
        self._watching = False  # a backward that failed never reached its end
        self._reset_counts()
        self.choose()  # the step may have made a new plan

    def rollback(self) -> None:
        """Puts back every update begun since the last step (state as before that backward)."""
        if self._spec:
            self.settle()
            for spec in self._spec.values():
                self._restore(spec)
                self.stats["rolled_back"] += 1
        self.finish()

    def _restore(self, spec: _Speculation) -> None:
        b = self._opt().buffers
        for piece in spec.pieces:
            lo, hi = piece.start, piece.end
            b.exp_avg[lo:hi].copy_(piece.exp_avg)
            b.exp_avg_sq[lo:hi].copy_(piece.exp_avg_sq)
            if piece.params is not None:
                b.params[lo:hi].copy_(piece.params)
