"""memtide: a CUDA-aware caching allocator and memory-tiering runtime.

The native module wraps libmemtide.so, the same library torch loads through
CUDAPluggableAllocator, so stats, phases and snapshots seen here are those of the
allocator serving torch's tensors.
"""

from __future__ import annotations

import atexit as _atexit
import contextlib
import os as _os
import sys as _sys
from typing import Any, Iterator, List, Optional

# memtide's CPU optimizer step runs on its own thread pool, on the cores torch's OpenMP threads
# use. libgomp's default wait policy spins after every parallel region, so a torch CPU op just
# before the step (a clip, a copy) leaves spinning threads that took half of the step's cores on
# a 2-core machine (bench/results: in-cache step 1.1 ms -> 0.7 ms with passive waiting). The
# policy is read once, when torch loads libgomp: it can only be set if torch is not loaded yet,
# and a value the user chose is kept.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:  # a top-level module next to the package: site.py's .pth hook must load it without memtide
    import _memtide_alloc_conf as _alloc_conf
except ImportError:  # memtide imported from a source tree, not installed
    _alloc_conf = None

# memtide's items of PYTORCH_CUDA_ALLOC_CONF set inside this process (os.environ[...] = ...):
# torch has not parsed the variable yet, so take them out now (the .pth hook did it at start-up
# for variables set before Python started).
if _alloc_conf is not None and "torch" not in _sys.modules:
    _alloc_conf.strip_environ()

from . import _memtide, host

# The NVMe tier's spill folders go at exit even when the optimizer that owns one is still
# referenced (the interpreter does not destroy such objects) or Ctrl-C ended the program (the
# process then re-raises SIGINT, which runs no C++ exit handler). Its open file stays usable by
# anything still running until the process ends.
_atexit.register(_memtide.remove_spill_dirs)

# SIGTERM and SIGHUP (a scheduler ending the job) run no exit handler by default: memtide's
# handler removes the spill folders and exits 128 + the signal from the main thread's normal
# context, chaining to a handler the program already has (memtide._cleanup).
from . import _cleanup

_cleanup.install()

from ._memtide import (
    ConfigError,
    MAX_SUBGROUPS,
    USEFUL_SLOTS,
    adamw_step_cpu,
    allocator_events,
    backend,
    cpu_isa,
    cpu_threads,
    cuda_status,
    default_rates,
    device_count,
    dump_snapshot,
    empty_cache,
    fit_gpu_budget,
    fit_host_budget,
    headroom,
    library_path,
    mark_phase,
    option_table,
    options,
    phase_report,
    plan_update,
    predict_update,
    record_history,
    replay_transformer,
    reset_peak_stats,
    resolve_backend,
    stats,
    topology,
    version,
)

__version__ = version()

# The iteration simulator is an extension of its own (memtide._sim, over libmemtide_sim.so), so
# that importing memtide does not load it: it is imported the first time one of these is asked for.
_SIMULATOR = ("simulate_iteration", "simulate_node", "simulate_update_sweep", "simulation_defaults")


def __getattr__(name: str) -> Any:
    if name in _SIMULATOR:
        from . import _sim

        value = getattr(_sim, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "MAX_SUBGROUPS",
    "USEFUL_SLOTS",
    "__version__",
    "adamw_step_cpu",
    "allocator_events",
    "apply_alloc_conf",
    "backend",
    "cpu_isa",
    "cpu_threads",
    "cuda_status",
    "default_rates",
    "device_count",
    "dump_snapshot",
    "empty_cache",
    "fit_gpu_budget",
    "fit_host_budget",
    "headroom",
    "install_phase_hooks",
    "host",
    "library_path",
    "mark_phase",
    "option_table",
    "options",
    "phase",
    "phase_report",
    "plan_update",
    "preload_library_path",
    "predict_update",
    "record_history",
    "replay_transformer",
    "reset_peak_stats",
    "resolve_backend",
    "simulate_iteration",
    "simulate_node",
    "simulate_update_sweep",
    "simulation_defaults",
    "stats",
    "topology",
    "torch_allocator",
    "torch_allocator_installed",
    "use_with_torch",
    "version",
]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks training phase `name` for the body of a ``with`` block.

    Nothing is marked on exit: the next phase's mark ends this one, and marking
    "other" between phases would split them in the watermark history.
    """
    mark_phase(name)
    yield


def preload_library_path() -> str:
    """The LD_PRELOAD observer shipped with the package (``memtide observe`` uses it).

    ``LD_PRELOAD=<this> MEMTIDE_PRELOAD_LOG=t.jsonl ./app`` records every cudaMalloc/cudaFree
    (and their Async forms) of an unmodified CUDA program that uses the shared CUDA runtime.
    """
    path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "libmemtide_preload.so")
    if not _os.path.isfile(path):
        raise RuntimeError(f"memtide: the LD_PRELOAD observer is missing ({path}); reinstall memtide "
                           "(pip install .) or build it with CMake (build/<preset>/allocator/preload)")
    return path


def torch_allocator():
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` backed by memtide's C ABI (malloc and free
    only; :func:`use_with_torch` prefers the bridge, which gives torch everything)."""
    import torch.cuda.memory  # lazily: torch is optional and slow to import

    return torch.cuda.memory.CUDAPluggableAllocator(library_path(), "memtide_malloc", "memtide_free")


def use_with_torch() -> dict:
    """Makes memtide torch's CUDA allocator; returns which path did it and why.

    The bridge (memtide as torch's own C++ allocator, built against torch at install time) when
    it can, else torch's pluggable allocator: ``{"path": "bridge" | "pluggable", "why": ...,
    "built": ...}``; see :mod:`memtide.torch_bridge`. Must run before the first CUDA allocation
    of the process: torch refuses to swap an allocator that has already handed out memory.
    """
    from . import torch_bridge

    return torch_bridge.install()


def torch_allocator_installed() -> bool:
    """Whether use_with_torch() (or ``backend:memtide`` in PYTORCH_CUDA_ALLOC_CONF) made memtide
    torch's CUDA allocator in this process."""
    from . import torch_bridge

    return torch_bridge.installed()


def apply_alloc_conf() -> None:
    """Acts on memtide's items of PYTORCH_CUDA_ALLOC_CONF; torch calls this at the end of
    ``import torch`` (the ``torch.backends`` entry point), so users need not.

    ``memtide_<option>:<value>`` items are memtide options (the names ``memtide info`` lists,
    e.g. ``memtide_max_bytes:60GiB``); ``backend:memtide`` makes memtide torch's allocator.
    Raises ConfigError naming the item for an unknown option or a bad value.
    """
    if _alloc_conf is None:
        return
    _alloc_conf.applied = True  # acted on, whatever the outcome (see _alloc_conf._unapplied_warning)
    try:
        _alloc_conf.check()
    except _alloc_conf.AllocConfError as e:
        raise ConfigError(str(e)) from None
    where = _alloc_conf.origins()
    known = [row["key"] for row in option_table()]
    for option, item in where.items():
        if option not in known:
            raise ConfigError(f"{item}: memtide has no option {option!r}; known options: {', '.join(known)}")
    try:
        options()  # parses every MEMTIDE_* value
    except ConfigError as e:
        for option, item in where.items():
            if f"{_alloc_conf.env_name(option)}=" in str(e):
                raise ConfigError(f"{item}: {e}") from None
        raise
    if _os.environ.get(_alloc_conf.SELECTED) == "1" and not torch_allocator_installed():
        import torch.cuda

        if torch.cuda.is_initialized():
            import warnings

            warnings.warn("PYTORCH_CUDA_ALLOC_CONF asks for backend:memtide, but CUDA started before memtide "
                          "could take over; torch keeps its own allocator. import memtide (or torch, with "
                          "TORCH_DEVICE_BACKEND_AUTOLOAD on) before the first CUDA call.", RuntimeWarning, stacklevel=2)
            return
        use_with_torch()


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
            self._optimizer._mark_update = False
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
        if hasattr(optimizer, "_mark_update"):
            optimizer._mark_update = True
            marked_optimizer = optimizer
        else:
            handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: mark_phase("update")))
    return PhaseHooks(handles, marked_optimizer)


# torch is loaded but its entry point has not acted on memtide's items (TORCH_DEVICE_BACKEND_AUTOLOAD=0,
# torch imported from a source tree, or python -S, which skips the .pth hook too): this import is
# the next chance.
if _alloc_conf is not None and "torch" in _sys.modules and not _alloc_conf.applied:
    if _alloc_conf.pending():
        _alloc_conf.strip_environ()
    if any(_os.environ.get(v) for v in (_alloc_conf.SELECTED, _alloc_conf.ORIGIN, _alloc_conf.ERROR)):
        apply_alloc_conf()
