"""A simulated iteration of memtide as a timeline trace: one home for `memtide simulate --timeline`
(one rank, sim/iteration.py) and a node's traces, one per rank (sim/node.py)."""

from __future__ import annotations

import argparse
from typing import Any, Dict


def write_simulation_trace(args: argparse.Namespace, r: Dict[str, Any], trace: str, **header: Any) -> None:
    """Writes one simulated iteration of memtide (simulate_iteration with record_ops) as a trace;
    `header` adds to its header (a node's rank: rank, world_size, job; sim/node.py)."""
    from memtide import _timeline as timeline

    tiers = {}
    if r["nvme_subgroups"]:
        tiers = dict(host_capacity_bytes=int(args.host_mem), nvme_capacity_bytes=int(r["nvme_file_bytes"]))
    elif args.host_mem is not None:
        tiers = dict(host_capacity_bytes=int(args.host_mem))
    with timeline.TraceWriter(trace, source="memtide simulate", clock="virtual", model=r["model"],
                              contender="memtide", capacity_bytes=r["capacity_bytes"], **tiers, **header) as w:
        for phase, start, _end in r["phase_spans"]:  # with micro-batches: each one's forward and backward
            w.phase(start, phase)
        w.phase(r["end_s"], "other")
        if args.host_mem is not None:
            # The host tier as the host budget counts it (the simulator has no process to
            # measure): the state kept in host memory and the read-ahead's staging, at every phase.
            for t in (*(start for _, start, _ in r["phase_spans"]), r["end_s"]):
                w.event(type="host", t=t, allocated=int(r["host_state_bytes"]), staging=int(r["nvme_staging_bytes"]))
        if r["nvme_subgroups"]:
            w.event(type="spill", t=r["phase_start_s"][0], bytes=int(r["nvme_file_bytes"]))
        for what, subgroup, queued, start, end, nbytes in r["nvme_transfers"]:
            w.event(type="nvme", what=what, subgroup=subgroup, queued=queued, start=start, end=end, bytes=nbytes)
        for t, allocated, reserved in r["memory"]:
            w.memory(t, allocated, reserved)
        for engine, start, end, nbytes in r["ops"]:
            w.op(engine, start, end, nbytes)
        for what, subgroup, start, end, nbytes in r["tiering"]:
            w.event(type="tiering", what=what, subgroup=subgroup, start=start, end=end, bytes=nbytes)
