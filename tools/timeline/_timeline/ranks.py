"""The traces of a job's ranks in one report (``memtide timeline a.trace.jsonl b.trace.jsonl ...``
or a folder of them): lanes per rank on one time axis.

Which traces draw together: one job's, each naming its rank in its header (``rank``, and
``world_size`` where known; memtide.timeline.record writes both in a job's process), all on the
same clock from the same source, of one job (the header's ``job``: see the jobs module), no rank
twice. Anything else is refused naming the files: a torch memory snapshot among traces, traces of
different clocks or sources, a trace without a rank, traces of different jobs (naming both
identities: rank 0 of one torchrun job and rank 1 of another), two traces claiming one rank, or
ranks that disagree on the world size. Traces without a job identity (recorded by an older
memtide) are not guessed at: they draw, and the report and stderr say that their job was not
checked.

The common time axis:

- steady-clock traces of one machine (the same ``host`` in every header) keep their times: a
  machine's processes share its steady clock (CLOCK_MONOTONIC), so their events line up exactly;
- steady-clock traces of several machines are put on the wall clock: each time plus its trace's
  ``epoch_offset_s`` (the wall clock minus the steady clock when recording began). The machines'
  wall clocks are as close as their time synchronisation (NTP: typically a millisecond or better);
- traces of a virtual clock (a simulation's) all begin at their clock's zero.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memtide._files import check_input

from .export import write_chrome_processes
from .files import TraceError, _identity, check_outputs
from .html_report import write_ranks_html
from .jobs import job_text, same_job
from .model import Timeline
from .snapshot import looks_like_pickle
from .trace import read_trace

#: Characters that make a command-line argument a pattern (when no file has that name).
_PATTERN = "*?["


def trace_inputs(args: Sequence[str]) -> List[str]:
    """The trace files the command line names: a file as it is; a folder: its ``*.trace.jsonl``
    files; a pattern (``'run.rank*.trace.jsonl'``, quoted so the shell left it) that names no
    file: the files it matches. Sorted within each folder or pattern. A folder or pattern without
    a match is refused naming it, and so is any of the files that is not a regular file (a FIFO
    would make its reader wait forever), before anything is opened."""
    paths: List[str] = []
    for arg in args:
        if os.path.isdir(arg):
            found = sorted(glob.glob(os.path.join(glob.escape(arg), "*.trace.jsonl")))
            if not found:
                raise TraceError(f"folder {arg} holds no traces (*.trace.jsonl)")
            paths += found
        elif not os.path.exists(arg) and any(c in arg for c in _PATTERN):
            found = sorted(p for p in glob.glob(arg) if not os.path.isdir(p))
            if not found:
                raise TraceError(f"no trace matches {arg}")
            paths += found
        else:
            paths.append(arg)  # read_trace names it if it cannot be read
    for p in paths:
        check_input(p, "trace")
    return paths


def _listing(items: Sequence[Tuple[str, Any]]) -> str:
    return "; ".join(f"{path}: {value}" for path, value in items)


def _check(paths: Sequence[str], headers: Sequence[Dict[str, Any]]) -> Tuple[List[float], str]:
    """Refuses traces that are not one job's ranks (see the module's docstring); returns the shift
    that puts each trace's times on the common axis, and how the axis was aligned, in words."""
    for field, what in (("clock", "clock"), ("source", "source")):
        values = {str(h.get(field)) for h in headers}
        if len(values) > 1:
            raise TraceError(f"these traces are of different {what}s and do not share a time axis: "
                             + _listing([(p, h.get(field, "not said")) for p, h in zip(paths, headers)]))
    missing = [p for p, h in zip(paths, headers) if h.get("rank") is None]
    if missing:
        raise TraceError(f"{', '.join(missing)}: no rank in the trace's header (recorded outside a job: RANK "
                         "unset); only the traces of one job's ranks draw together, each naming its rank")
    named = [(p, h["job"]) for p, h in zip(paths, headers) if isinstance(h.get("job"), dict)]
    for p, job in named[1:]:
        if not same_job(named[0][1], job):
            raise TraceError(f"these traces are of different jobs and do not draw as one job: {named[0][0]}: "
                             f"{job_text(named[0][1])}; {p}: {job_text(job)}")
    owner: Dict[int, str] = {}
    for p, h in zip(paths, headers):
        rank = int(h["rank"])
        if rank in owner:
            raise TraceError(f"{owner[rank]} and {p} both claim rank {rank}: give one trace per rank (of one run)")
        owner[rank] = p
    worlds = {int(h["world_size"]) for h in headers if h.get("world_size") is not None}
    if len(worlds) > 1:
        raise TraceError("these traces disagree on the job's number of ranks: "
                         + _listing([(p, h.get("world_size", "not said")) for p, h in zip(paths, headers)]))
    clock = headers[0].get("clock")
    if clock != "steady":
        return [0.0] * len(paths), f"Time axis: each trace's {clock or 'own'} clock from its zero."
    hosts = {h.get("host") for h in headers}
    if len(hosts) == 1 and None not in hosts:
        return [0.0] * len(paths), f"Time axis: the steady clock of {hosts.pop()}, which all ranks share."
    unanchored = [p for p, h in zip(paths, headers) if h.get("epoch_offset_s") is None]
    if unanchored:
        raise TraceError(f"these traces' steady clocks cannot be aligned: they are not all from one machine (the "
                         f"'host' in their headers) and {', '.join(unanchored)} "
                         f"{'has' if len(unanchored) == 1 else 'have'} no 'epoch_offset_s' to put "
                         f"{'it' if len(unanchored) == 1 else 'them'} on the wall clock")
    return ([float(h["epoch_offset_s"]) for h in headers],
            f"Time axis: the wall clock ({len(hosts)} machines; each trace's steady clock plus its offset to the "
            "wall clock, as close as the machines' clocks are synchronised).")


def read_ranks(paths: Sequence[str], progress: bool = False) -> Tuple[List[Tuple[int, Timeline]], Dict[str, Any]]:
    """The Timelines of the ranks' traces (sorted by rank), each binned on the common window, and
    what was merged: ``{"ranks": [...], "world_size", "clock_note", "job_note"}`` (``job_note``:
    the traces whose job was not checked, in words, or None). Raises TraceError naming
    the files when the traces are not one job's (see the module's docstring)."""
    if len(paths) < 2:
        raise TraceError("a report of several ranks needs at least two traces")
    seen: Dict[Any, str] = {}
    for p in paths:
        if looks_like_pickle(p):
            raise TraceError(f"{p} is a torch memory snapshot: it draws on its own (memtide timeline {p}), not "
                             f"among the traces of a job's ranks ({', '.join(q for q in paths if q != p)})")
        ident = _identity(p)
        if ident in seen:
            raise TraceError(f"{seen[ident]} and {p} are the same file: give each rank's trace once")
        seen[ident] = p
    # Every header is checked before any trace is read whole.
    opened = [read_trace(p, progress=progress) for p in paths]
    shifts, note = _check(paths, [h for h, _ in opened])
    unnamed = [p for p, (h, _) in zip(paths, opened) if h.get("job") is None]
    job_note = None
    if unnamed:
        job_note = (f"{', '.join(unnamed)}: no job identity in the header (recorded by an older memtide): not "
                    "checked that these traces are one job's ranks.")
        print(f"timeline: note: {job_note}", file=sys.stderr, flush=True)
    ranks: List[Tuple[int, Timeline, float, str]] = []
    for p, (header, events), shift in zip(paths, opened, shifts):
        ranks.append((int(header["rank"]), Timeline(header, events), shift, p))
    ranks.sort(key=lambda r: r[0])
    # A rank's trace without a timed event (it stopped before recording anything) has no place on
    # the axis: its extent, 0 to 1 on its own clock, would stretch the others' window.
    timed = [(tl, shift) for _, tl, shift, _ in ranks if tl.timed] or [(tl, shift) for _, tl, shift, _ in ranks]
    t0 = min(tl.extent[0] + shift for tl, shift in timed)
    t1 = max(tl.extent[1] + shift for tl, shift in timed)
    for _, tl, shift, _ in ranks:
        tl.respan(t0 - shift, t1 - shift)
    world: Optional[int] = next((int(tl.header["world_size"]) for _, tl, _, _ in ranks
                                 if tl.header.get("world_size") is not None), None)
    info = {"ranks": [{"rank": rank, "trace": p, "events": sum(tl.counts.values()), "summary": tl.summary()}
                      for rank, tl, _, p in ranks], "world_size": world, "clock_note": note, "job_note": job_note,
            "shifts": {rank: shift for rank, _, shift, _ in ranks}}
    return [(rank, tl) for rank, tl, _, _ in ranks], info


def render_ranks(paths: Sequence[str], html_path: str, chrome: Optional[str] = None,
                 progress: bool = False) -> Dict[str, Any]:
    """The report of several ranks' traces (see read_ranks) written to `html_path`, and a Chrome
    trace with a process per rank when asked; returns what was written: ``{"html", "events",
    "ranks": [{"rank", "trace", "events", "summary"}, ...], "world_size", "clock_note"}``."""
    for p in paths:
        check_outputs(p, {"the report": html_path, "the Chrome trace": chrome})
    ranks, info = read_ranks(paths, progress=progress)
    write_ranks_html(ranks, html_path, f"memtide timeline: {len(ranks)} ranks",
                     info["clock_note"] + (" " + info["job_note"] if info["job_note"] else ""))
    out = {"html": html_path, "events": sum(r["events"] for r in info["ranks"]), **info}
    if chrome:
        # Read again, streamed: the Timelines keep their events binned, not as events.
        t0 = ranks[0][1].t0 + info["shifts"][ranks[0][0]]
        processes = []
        for r in info["ranks"]:
            header, events = read_trace(r["trace"])
            processes.append((r["rank"], f"rank {r['rank']}", events, info["shifts"][r["rank"]] - t0))
        out["chrome"] = chrome
        out["chrome_events"] = write_chrome_processes(chrome, ranks[0][1].header.get("source"), processes)
    return out
