"""What ``import memtide`` sets up in the process, before anything of the package is used.

- the OpenMP wait policy, while torch has not loaded libgomp yet, where memtide's CPU step cannot
  run on torch's threads;
- memtide's items of ``PYTORCH_CUDA_ALLOC_CONF``: taken out before torch parses the variable, and
  acted on (:func:`apply_alloc_conf`) when torch calls its ``torch.backends`` entry point, or at
  the end of ``import memtide`` when torch was loaded without calling it;
- the NVMe tier's cleanup at exit and on SIGTERM/SIGHUP.
"""

from __future__ import annotations

import atexit
import os
import sys

# memtide's CPU optimizer step runs on torch's own OpenMP threads when the torch bridge was built
# (memtide.torch_bridge.use_torch_threads): nothing then competes with them. Without the bridge it
# runs on memtide's own pool, on the cores torch's OpenMP threads use, and libgomp's default wait
# policy spins after every parallel region: a torch CPU op just before the step left spinning
# threads that took half of the step's cores on a 2-core machine (in-cache step 1.1 ms -> 0.7 ms
# with passive waiting). Only then is passive waiting asked for; it slows torch's own CPU ops
# (its fused AdamW step 36.6 -> 43.6 ms on 50.4M params, bench/results/adamw/
# 2026-11-28-intel-xeon-2core-torch-threads.md), so not when the bridge makes it needless. The
# policy is read once, when torch loads libgomp: it can only be set if torch is not loaded yet,
# and a value the user chose is kept.
if "torch" not in sys.modules and not os.path.exists(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmemtide_torch.so")):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:  # a top-level module next to the package: site.py's .pth hook must load it without memtide
    import _memtide_alloc_conf as _alloc_conf
except ImportError:  # memtide imported from a source tree, not installed
    _alloc_conf = None

# memtide's items of PYTORCH_CUDA_ALLOC_CONF set inside this process (os.environ[...] = ...):
# torch has not parsed the variable yet, so take them out now (the .pth hook did it at start-up
# for variables set before Python started).
if _alloc_conf is not None and "torch" not in sys.modules:
    _alloc_conf.strip_environ()

from . import _cleanup, _memtide
from ._memtide import ConfigError, option_table, options

# The NVMe tier's spill folders go at exit even when the optimizer that owns one is still
# referenced (the interpreter does not destroy such objects) or Ctrl-C ended the program (the
# process then re-raises SIGINT, which runs no C++ exit handler). Its open file stays usable by
# anything still running until the process ends.
atexit.register(_memtide.remove_spill_dirs)

# SIGTERM and SIGHUP (a scheduler ending the job) run no exit handler by default: memtide's
# handler removes the spill folders and exits 128 + the signal from the main thread's normal
# context, chaining to a handler the program already has (memtide._cleanup).
_cleanup.install()


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
    from . import libraries

    if os.environ.get(_alloc_conf.SELECTED) == "1" and not libraries.torch_allocator_installed():
        import torch.cuda

        if torch.cuda.is_initialized():
            import warnings

            warnings.warn("PYTORCH_CUDA_ALLOC_CONF asks for backend:memtide, but CUDA started before memtide "
                          "could take over; torch keeps its own allocator. import memtide (or torch, with "
                          "TORCH_DEVICE_BACKEND_AUTOLOAD on) before the first CUDA call.", RuntimeWarning, stacklevel=2)
            return
        libraries.use_with_torch()


def apply_if_torch_skipped_it() -> None:
    """torch is loaded but its entry point has not acted on memtide's items
    (TORCH_DEVICE_BACKEND_AUTOLOAD=0, torch imported from a source tree, or python -S, which skips
    the .pth hook too): the end of ``import memtide`` is the next chance."""
    if _alloc_conf is not None and "torch" in sys.modules and not _alloc_conf.applied:
        if _alloc_conf.pending():
            _alloc_conf.strip_environ()
        if any(os.environ.get(v) for v in (_alloc_conf.SELECTED, _alloc_conf.ORIGIN, _alloc_conf.ERROR)):
            apply_alloc_conf()
