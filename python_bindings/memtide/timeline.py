"""Record memtide's timeline in your own training loop: device memory, the host tier and the NVMe
tier in one report.

    import memtide.timeline

    opt = TieredAdamW(model.parameters(), host_budget="8GiB", nvme_dir="/mnt/nvme")
    with memtide.timeline.record("report.html", opt):
        for x, y in data:
            loss = model(x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()

On leaving the ``with`` block (also when it raises) memtide writes REPORT.trace.jsonl (the trace,
see the memtide._timeline package) and the report REPORT.html that opens offline, with:

- device memory (memtide's allocator, with the phases ``TieredAdamW.attach`` marks);
- the host tier: the HostArena's reserved and allocated bytes, the NVMe tier's pinned staging and
  the process's resident memory, sampled every ``interval`` seconds and after every step, against
  the optimizer's host budget;
- the NVMe tier: every read and write-back of a spilled subgroup with its bytes, the update's
  waits for a read, the read-ahead and the write-back queue, and the spill file against the
  space it reserved (with ``host_budget``/``nvme_dir``).

Everything is on the steady clock (``time.monotonic()``, the clock of memtide's allocator events);
the trace's header also holds the machine's name (``host``) and ``epoch_offset_s`` (the wall clock
minus the steady clock when recording began), with which ``memtide timeline`` puts the traces of
ranks on other machines on one time axis.

In a job's process (torchrun sets RANK) every rank writes its own files, named by its rank:
``record("report.html")`` on rank 1 writes REPORT.rank1.html, REPORT.rank1.trace.jsonl, ..., and
the trace's header holds ``rank`` and ``world_size``. ``memtide timeline report.rank*.trace.jsonl
-o report.html`` then draws all ranks in one report, with lanes per rank.
``memtide run --timeline`` records through the same recorder. Without a GPU the device chart holds
what memtide's allocator served (a SimDevice's); the engines' chart has the host lane, each
optimizer step as it ran on the wall clock (the SimDevice's copies and GPU updates are on its
virtual clock and are not drawn; the header's ``host_lane`` says so); the host and NVMe tiers are
recorded as on a GPU. Every lane of such a trace is on the steady (wall) clock.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional

from . import _memtide

__all__ = ["Recorder", "record"]


def _rss_bytes() -> int:
    """The process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


#: The trace header's ``host_lane`` on a CPU run: which lanes are on which clock.
HOST_LANE = ("wall clock: the host lane is each optimizer step as it ran (CPU updates, gradients gathered, the "
             "model's copy written), like device memory and the host and NVMe tiers; the engine's simulated "
             "device (its copies and GPU updates, on a virtual clock) is not drawn")


def _simulated(opt: Any) -> bool:
    """Whether `opt`'s engine runs on a SimDevice, whose times are on a virtual clock."""
    return bool(getattr(getattr(opt, "engine", None), "simulated", False))


class Recorder:
    """Records the three tiers from start() (or entering ``with``) until stop(), which writes the
    trace and the report. ``watch(optimizer)`` adds a TieredAdamW (one given to the constructor is
    watched from the start): its steps' NVMe transfers and its host arena are recorded."""

    def __init__(self, report: str, optimizer: Any = None, *, interval: float = 0.005, source: str = "memtide",
                 **header: Any):
        from . import _timeline

        if not isinstance(report, (str, os.PathLike)):
            raise TypeError(f"memtide.timeline.record: report must be a path (REPORT.html), got {report!r}")
        if not (isinstance(interval, (int, float)) and not isinstance(interval, bool) and 1e-4 <= interval <= 60):
            raise ValueError(f"memtide.timeline.record: interval must be seconds from 0.0001 to 60, got {interval!r}")
        self.report = os.fspath(report)
        # In a job, one set of files per rank (core/job reads RANK and WORLD_SIZE for the whole of
        # memtide: the rank a log line and a spill folder name is the rank here).
        rank, world = _memtide.job_rank(), _memtide.job_world_size()
        if rank is not None:
            self.report = _timeline.rank_report(self.report, rank)
            header = {"rank": rank, **({"world_size": world} if world is not None else {}), **header}
        _timeline.check_report_target(self.report)  # refused before the run, not after
        self.files = _timeline.companions(self.report)
        self.interval = float(interval)
        # The machine and its wall clock against the steady one: how the traces of ranks on several
        # machines share a time axis (one machine's ranks share its steady clock).
        self.header: Dict[str, Any] = dict(source=source, host=socket.gethostname(),
                                           epoch_offset_s=time.time() - time.monotonic(), **header)
        # The job (torchrun's run id, rendezvous endpoint and start; without torchrun this
        # process's own identity): `memtide timeline` refuses to draw ranks of different jobs as one.
        self.header.setdefault("job", _timeline.job_identity())
        self.result: Optional[Dict[str, Any]] = None
        self._optimizers: List[Any] = []
        self._hooks: List[Any] = []
        self._seen: Dict[int, Any] = {}
        self._staging: Dict[int, int] = {}  # per optimizer: its NVMe tier's pinned staging (bytes)
        self._step_began: Dict[int, float] = {}  # per optimizer: when its step began (steady clock)
        self._saves: Dict[int, Any] = {}  # per optimizer: its running checkpoint save, as the main thread last saw it
        self._events: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._base: Optional[Dict[str, Any]] = None  # memtide.stats() at start()
        self._stopped = False
        self._cupti: Optional[Dict[str, Any]] = None
        if optimizer is not None:
            self.watch(optimizer)

    # -- what is recorded -------------------------------------------------------------------------

    def watch(self, optimizer: Any) -> None:
        """Records `optimizer` (a memtide.optim.TieredAdamW): after each of its steps, the NVMe
        tier's transfers and a host sample."""
        if not callable(getattr(optimizer, "register_step_post_hook", None)) or not hasattr(optimizer, "last_report"):
            raise TypeError("memtide.timeline.record: optimizer must be a memtide.optim.TieredAdamW, got "
                            f"{type(optimizer).__name__}")
        if optimizer in self._optimizers:
            return
        self._optimizers.append(optimizer)
        self._seen[id(optimizer)] = optimizer.last_report  # steps before recording are not recorded
        self._staging[id(optimizer)] = self._staging_of(optimizer)
        if self._base is not None and self._thread is None:
            self._start_sampling()
        self._hooks.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before_step(opt)))
        self._hooks.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_step(opt)))

    def _device(self) -> int:
        engine = getattr(self._optimizers[0], "engine", None) if self._optimizers else None
        return int(engine.device) if engine is not None else 0

    @staticmethod
    def _staging_of(opt: Any) -> int:
        info = opt.nvme_info() if opt.engine is not None else None
        return int(info["staging_bytes"]) if info else 0

    def _sample(self) -> None:
        # From the sampling thread too: only the arena's own (locked) statistics and what the
        # main thread cached, never the engine while it steps.
        stats = _memtide.host_stats(self._device(), None)
        ev = dict(type="host", t=time.monotonic(), reserved=int(stats["reserved_bytes"]),
                  allocated=int(stats["allocated_bytes"]), staging=sum(self._staging.values()), rss=_rss_bytes())
        saves = []
        for key, save in list(self._saves.items()):
            p = save.progress()  # the save's own lock, never the engine's
            saves.append(dict(type="checkpoint", t=time.monotonic(), written=int(p["bytes_written"]),
                              total=int(p["bytes_total"]), waited=float(p["waited_s"]), target=save.target))
            if p["done"]:
                self._saves.pop(key, None)
        with self._lock:
            self._events.append(ev)
            self._events += saves

    def _follow_save(self, opt: Any) -> None:
        """From the main thread, between steps: a checkpoint save the optimizer runs is sampled
        with the host tier until it is over (saves are asked for between steps)."""
        running = opt.engine.running_save() if opt.engine is not None else None
        if running is not None:
            self._saves[id(opt)] = running

    def _before_step(self, opt: Any) -> None:
        self._follow_save(opt)
        self._step_began[id(opt)] = time.monotonic()

    def _after_step(self, opt: Any) -> None:
        ended = time.monotonic()
        report = opt.last_report
        if report is None or report is self._seen.get(id(opt)):
            return  # skipped: the engine did not run
        self._seen[id(opt)] = report
        events = [dict(type="nvme", what=what, subgroup=int(sg), queued=q, start=a, end=b, bytes=nbytes)
                  for what, sg, q, a, b, nbytes in report.nvme_transfers]
        began = self._step_began.pop(id(opt), None)
        if began is not None and report.cpu.ops and _simulated(opt):
            # On a SimDevice (a CPU run) the engine's own times are on its virtual clock: the CPU
            # work that really ran is the optimizer's step, from its pre-hook to its post-hook on
            # the steady clock (on a CPU run the whole step is host work: gathering the gradients,
            # the CPU updates, writing the model's copy back).
            events.append(dict(type="op", engine="host", start=began, end=max(ended, began),
                               bytes=float(report.cpu.bytes)))
        info = opt.nvme_info()
        if info:
            events.append(dict(type="spill", t=time.monotonic(), bytes=int(info["file_bytes"])))
            self._staging[id(opt)] = int(info["staging_bytes"])
        with self._lock:
            self._events += events
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    # -- start and stop ---------------------------------------------------------------------------

    def start(self) -> "Recorder":
        import memtide

        if self._base is not None:
            raise RuntimeError("memtide.timeline.record: this recorder has already started")
        memtide.record_history(True)
        self._base = memtide.stats()
        self._cupti = _memtide.device_trace_start()
        if self._optimizers:
            self._start_sampling()
        # else from the first watch(): the host tier's samples begin with the optimizer, not with
        # the imports and the model's set-up before it (a run's report would be mostly those).
        return self

    def _start_sampling(self) -> None:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="memtide-timeline", daemon=True)
        self._thread.start()

    def stop(self, write: bool = True) -> Optional[Dict[str, Any]]:
        """Stops recording; writes the trace and the report (unless `write` is False) and returns
        what memtide._timeline.render() returned."""
        import memtide
        from . import _timeline

        if self._base is None:
            raise RuntimeError("memtide.timeline.record: stop() before start()")
        if self._stopped:
            raise RuntimeError("memtide.timeline.record: this recorder has already stopped")
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for opt in self._optimizers:
            self._follow_save(opt)  # one asked for after the last step
        self._sample()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # CUPTI's last records are flushed once the device is idle
        activities = _memtide.device_trace_stop()
        if not write:
            return None
        header = dict(self.header, cupti=self._cupti["status"])
        if any(_simulated(opt) for opt in self._optimizers):
            header["host_lane"] = HOST_LANE
        budgets = [opt.nvme.host_budget for opt in self._optimizers if getattr(opt, "nvme", None) is not None]
        if budgets:
            header["host_capacity_bytes"] = int(sum(budgets))
        infos = [opt.nvme_info() for opt in self._optimizers if opt.engine is not None]
        files = [int(i["file_bytes"]) for i in infos if i]
        if files:
            header["nvme_capacity_bytes"] = sum(files)
        with self._lock:
            events = sorted(self._events, key=lambda e: e.get("t", e.get("start", 0.0)))
        _timeline.trace_from_allocator(memtide.allocator_events(), self.files["trace"],
                                              base_allocated=self._base.get("allocated_bytes.all.current", 0),
                                              base_reserved=self._base.get("reserved_bytes.all.current", 0),
                                              activities=activities, extra=events, **header)
        memtide.dump_snapshot(self.files["pickle"])  # for torch's memory_viz
        self.result = _timeline.render(self.files["trace"], self.report, chrome=self.files["chrome"],
                                              png=self.files["png"])
        self.result.update(trace=self.files["trace"], memory_viz=self.files["pickle"])
        return self.result

    def __enter__(self) -> "Recorder":
        return self.start()

    def __exit__(self, kind, value, tb) -> bool:
        # What ran until an error (or Ctrl-C) is written: the report of a failing run is the one
        # most wanted.
        self.stop()
        return False


def record(report: str, optimizer: Any = None, *, interval: float = 0.005, **header: Any) -> Recorder:
    """A context manager that records device memory, the host tier and the NVMe tier of the
    training inside it and writes REPORT.html (and REPORT.trace.jsonl, REPORT.chrome.json,
    REPORT.pickle) when it ends; in a job's process (RANK set), REPORT.rank<R>.html and so on. `optimizer`: a TieredAdamW to record (more with watch()).
    `interval`: seconds between host samples. Extra keywords go into the trace's header."""
    return Recorder(report, optimizer, interval=interval, **header)
