"""memtide: a CUDA-aware caching allocator and memory-tiering runtime.

The native module wraps libmemtide.so, the same library torch loads through
CUDAPluggableAllocator, so stats, phases and snapshots seen here are those of the
allocator serving torch's tensors.

For users: this module's names (the allocator's stats, phases, options, memtide as torch's
allocator), :mod:`memtide.optim` (TieredAdamW), :mod:`memtide.window` (LayerWindow),
:mod:`memtide.timeline` (recording a run's timeline) and :mod:`memtide.host` (NUMA-bound pinned
host tensors). :mod:`memtide.cli` is the command line and what only it uses.
"""

from __future__ import annotations

from typing import Any

# First: what the process needs before torch or anything else of memtide runs (memtide._startup).
from . import _startup
from . import _memtide, _cleanup, host
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

from ._startup import apply_alloc_conf
from .libraries import preload_library_path, torch_allocator, torch_allocator_installed, use_with_torch
from .phases import PhaseHooks, install_phase_hooks, phase

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

_startup.apply_if_torch_skipped_it()
