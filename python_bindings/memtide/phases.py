"""Training phases (forward, backward, update) marked for the allocator's per-phase watermarks:
by hand (:func:`phase`) or by hooks on the model and optimizer (:func:`install_phase_hooks`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

from ._memtide import mark_phase


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks training phase `name` for the body of a ``with`` block.

    Nothing is marked on exit: the next phase's mark ends this one, and marking
    "other" between phases would split them in the watermark history.
    """
    mark_phase(name)
    yield


class PhaseHooks:
    """Handles of the hooks install_phase_hooks() put on a model (and optimizer)."""

    def __init__(self, handles: List[Any], optimizer: Any = None) -> None:
        self._handles = handles
        self._optimizer = optimizer

    def remove(self) -> None:
        """Takes every hook off again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._optimizer is not None:
            self._optimizer.mark_update = False
            self._optimizer = None


def _tensors(value: Any) -> Iterator[Any]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def install_phase_hooks(model: Any, optimizer: Optional[Any] = None) -> PhaseHooks:
    """Marks forward, backward and update phases without changes to the training loop.

    forward: a forward pre-hook on `model`. backward: a hook on the gradient of the model's
    output, i.e. when backpropagation reaches the model. update: when `optimizer` steps (a
    memtide.optim.TieredAdamW marks it after its closure, any other optimizer through a step
    pre-hook). Note that the phase tracker closes an iteration at each forward that follows a
    backward, so with gradient accumulation every micro-batch counts as an iteration.
    Returns a handle whose remove() takes the hooks off.
    """

    def on_forward(module: Any, args: Any) -> None:
        mark_phase("forward")

    def after_forward(module: Any, args: Any, output: Any) -> None:
        fired = [False]

        def on_output_grad(grad: Any) -> None:
            # Several outputs may need gradients: the first one to get it starts backward.
            if not fired[0]:
                fired[0] = True
                mark_phase("backward")

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_output_grad)

    handles = [model.register_forward_pre_hook(on_forward), model.register_forward_hook(after_forward)]
    marked_optimizer = None
    if optimizer is not None:
        if hasattr(optimizer, "mark_update"):
            optimizer.mark_update = True
            marked_optimizer = optimizer
        else:
            handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: mark_phase("update")))
    return PhaseHooks(handles, marked_optimizer)
