"""How the torchrun test workers (distributed_*worker.py, run as scripts beside this file) end."""

from __future__ import annotations

import os
import sys
from typing import Callable


def run_and_exit(main: Callable[[], None]) -> None:
    """Runs `main`, then leaves without the interpreter's shutdown: gloo's threads free the last
    collectives' Python tensors on their own and at times take the GIL while the interpreter
    shuts down, which aborts the process ("terminate called without an active exception") after
    the work is done. An exception still ends the process with a traceback and status 1."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_on_rank_zero(out: object, path: str) -> None:
    """Rank 0 saves `out` (torch.save) to `path`; every rank waits for it, then leaves the group."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(out, path)
    dist.barrier()
    dist.destroy_process_group()
