"""memtide's trace format and the memory timeline report (``memtide timeline``).

A trace is JSON Lines, written one event at a time (bounded memory however long the run):

    {"memtide_trace": 1, "source": "simulate", "clock": "virtual", "capacity_bytes": 85899345920, ...}
    {"type": "phase", "t": 0.0, "phase": "forward"}
    {"type": "memory", "t": 0.01, "allocated": 15795, "reserved": 20971520}
    {"type": "op", "engine": "d2h", "start": 1.2, "end": 1.21, "bytes": 16777216}

The first line is the header (`memtide_trace` is the format's version; readers refuse a newer
one). Times are seconds on the trace's clock. Event types:

- ``phase``: a training phase begins (forward, backward, update, other);
- ``memory``: device memory allocated and reserved at time t;
- ``op``: work on one engine from start to end: ``h2d``, ``d2h`` (PCIe), ``compute``, ``link``
  (collectives between GPUs), ``host`` (CPU work), ``nvme``; ``bytes`` moved;
- ``alloc`` / ``free``: one allocation (``bytes``, ``addr``, ``stream``), as the observer logs them;
- ``tiering``: one operation of the update phase for one optimizer subgroup (``what``: prefetch,
  gpu update, flush, cpu update, param upload, grad upload, grad to host; ``subgroup``; ``start``,
  ``end``, ``bytes``);
- ``host``: the host tier at time t: the HostArena's ``reserved`` and ``allocated`` bytes, the
  pinned ``staging`` the NVMe tier holds, the process's resident memory ``rss`` (each optional);
- ``nvme``: one NVMe transfer (``what``: read, write) or one wait of the update for a read
  (``what``: wait), of one ``subgroup``: ``queued`` when it was asked for, ``start`` to ``end``
  when the drive served it (the wait: from when the update asked until the data was there),
  ``bytes``. Reads queued and not yet taken are the read-ahead, writes queued and not yet done
  the write-back queue;
- ``spill``: the optimizer state on NVMe at time t (``bytes``: the spill file's).

Header fields readers use: ``capacity_bytes`` (device memory), ``host_capacity_bytes`` (the host
budget), ``nvme_capacity_bytes`` (the space reserved on the drive); for the ranks of a job,
``rank`` and ``world_size`` (RANK and WORLD_SIZE of the process that recorded it), ``host`` (the
machine's name) and ``epoch_offset_s`` (the wall clock minus the steady clock when recording
began); each optional. ``job``: the job the trace was recorded in, which every writer puts in the
header (``jobs.job_identity``), an object:

    "job": {"launcher": "torchrun", "run_id": "a7489...", "endpoint": "node0:29500", "restart": 0,
            "started": 1795817696.534}
    "job": {"launcher": "none", "process": "node0:4242", "started": 1795817696.534,
            "note": "not launched by torchrun (no TORCHELASTIC_RUN_ID): this process's own identity"}

under torchrun: its run id (TORCHELASTIC_RUN_ID; ``--standalone`` makes a fresh random one per
job), the rendezvous endpoint (MASTER_ADDR:MASTER_PORT), the restart count, and ``started``, the
wall clock (seconds since the epoch) when the job's first rank began recording, shared through the
job's process group (left out when the process group was not set up yet); without torchrun, the
process's own identity (``HOST:PID`` and when it began recording), as ``note`` says, and the
``endpoint`` where MASTER_ADDR and MASTER_PORT are set. The traces of different jobs are refused
as one job's ranks (naming the files and both identities); a trace without ``job`` (an older
memtide's) draws, with a note that its job was not checked.

Readers check every field they use and refuse the trace, naming the file, the line and the field,
when one is out of range: times are numbers of seconds from 0 to 1e12, byte counts 0 to 2**63-1
(whole numbers where they are allocations), subgroups whole numbers >= 0, addresses and streams
integers or their text ("0x7f00"), ``end`` not before ``start``. NaN and Infinity are not JSON and
are refused anywhere; writers never write them.

Unknown event types are skipped by readers, so a newer writer's extra events do not break an
older report. ``memtide timeline TRACE -o report.html`` renders a single HTML file that opens
offline (inline SVG, no script from anywhere), a Chrome trace (chrome://tracing, Perfetto) and,
when matplotlib is importable, a PNG (without it render() says so on stderr, with the install
command). ``memtide timeline RANK0.trace.jsonl RANK1.trace.jsonl ...`` (or a folder of traces, or a
quoted pattern) draws a job's ranks in one report, lanes per rank on one time axis, and a Chrome
trace with a process per rank (``ranks``: which traces draw together and how their clocks are
aligned).

The modules: ``trace`` (the format, writer and reader), ``record`` (traces from the allocator's
events and the observer's log), ``model`` (the Timeline a report draws), ``html_report`` (the
HTML), ``export`` (Chrome trace, memory_viz pickle, PNG, and render() for all of them), ``files``
(the report's files and the targets refused; every file is written by memtide._files.open_output,
atomically), ``snapshot`` (torch's memory snapshots, read without running code:
``memtide timeline snapshot.pickle``), ``ranks`` (the traces of a job's ranks in one
report), ``jobs`` (the job a trace was recorded in).
"""

from .export import render, write_chrome, write_chrome_processes, write_memory_viz, write_png
from .files import TraceError, check_outputs, check_report_target, companions, rank_report
from .html_report import write_html
from .jobs import job_identity
from .model import ENGINES, PHASES, Timeline
from .ranks import read_ranks, render_ranks, trace_inputs
from .record import trace_from_allocator, trace_from_observer
from .snapshot import SnapshotView, looks_like_pickle, read_snapshot
from .trace import VERSION, TraceWriter, read_trace

__all__ = ["ENGINES", "PHASES", "VERSION", "SnapshotView", "Timeline", "TraceError", "TraceWriter", "check_outputs",
           "job_identity", "looks_like_pickle", "read_snapshot",
           "check_report_target", "companions", "rank_report", "read_ranks", "read_trace", "render", "render_ranks",
           "trace_from_allocator", "trace_from_observer", "trace_inputs", "write_chrome", "write_chrome_processes",
           "write_html", "write_memory_viz", "write_png"]
