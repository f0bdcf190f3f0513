"""The job a trace was recorded in: the header's ``job``, with which ``memtide timeline`` refuses to
draw the ranks of different jobs as one job.

A job's identity is what every rank of one job shares and two jobs do not:

- under torchrun (TORCHELASTIC_RUN_ID set): ``{"launcher": "torchrun", "run_id", "endpoint",
  "restart", "started"}``. ``run_id`` is torchrun's run id (``--rdzv-id``; with ``--standalone``
  a fresh random one per job), ``endpoint`` the rendezvous endpoint of the process group
  (MASTER_ADDR:MASTER_PORT), ``restart`` TORCHELASTIC_RESTART_COUNT (recorded, not compared: the
  agents of several nodes count restarts each their own way), ``started`` the wall clock (seconds
  since the epoch) when the job's first rank began recording, shared through the job's store
  (torch.distributed's default process group), left out when the process group was not set up
  yet (no shared value to take);
- without torchrun: ``{"launcher": "none", "process": "HOST:PID", "started", "note"}``: the
  process's own identity (``started``: when it began recording), which ``note`` says in words;
  ``endpoint`` too where MASTER_ADDR and MASTER_PORT are set.

Ranks of one job: the same launcher; under torchrun the same ``run_id`` and ``endpoint``, and the
same ``started`` where both traces have it; without torchrun the same ``endpoint`` where both have
it (the processes of a job launched another way are each their own, so nothing else is compared).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Dict, Mapping, Optional

#: The key of the job's start in its store (torch.distributed's default process group).
_STARTED_KEY = "memtide/timeline/job_started"


def _job_started() -> Optional[float]:
    """The wall clock when the job's first rank asked, the same for every rank: the first to ask
    sets it in the job's store, the others read it. None without an initialized process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        value = store.compare_set(_STARTED_KEY, "", repr(time.time()))
        return float(value.decode() if isinstance(value, bytes) else value)
    except Exception:  # a store that cannot be reached: the job is named by the rest
        return None


def job_identity(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """This process's job (see the module's docstring), for a trace's header."""
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    endpoint = f"{addr}:{port}" if addr and port else None
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id:
        job: Dict[str, Any] = {"launcher": "torchrun", "run_id": run_id}
        if endpoint:
            job["endpoint"] = endpoint
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "")
        if restart.isdigit():
            job["restart"] = int(restart)
        started = _job_started()
        if started is not None:
            job["started"] = started
        return job
    job = {"launcher": "none", "process": f"{socket.gethostname()}:{os.getpid()}", "started": time.time(),
           "note": "not launched by torchrun (no TORCHELASTIC_RUN_ID): this process's own identity"}
    if endpoint:
        job["endpoint"] = endpoint
    return job


def job_text(job: Any) -> str:
    """A job's identity in words, for messages."""
    if not isinstance(job, dict):
        return "no job identity (recorded by an older memtide)"
    if job.get("launcher") == "torchrun":
        words = f"torchrun run {job.get('run_id')}"
    else:
        words = f"process {job.get('process')} (not torchrun)"
    if job.get("endpoint") is not None:
        words += f" at {job['endpoint']}"
    if isinstance(job.get("started"), (int, float)) and not isinstance(job.get("started"), bool):
        words += " started " + time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["started"])) + \
            f".{int(job['started'] % 1 * 1000):03d} UTC"
    return words


def same_job(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two traces' job identities are one job's (see the module's docstring)."""
    if a.get("launcher") != b.get("launcher"):
        return False
    fields = ("run_id", "endpoint", "started") if a.get("launcher") == "torchrun" else ("endpoint",)
    for field in fields:
        if field == "run_id" or (a.get(field) is not None and b.get(field) is not None):
            if a.get(field) != b.get(field):
                return False
    return True
