"""``memtide observe``: run any CUDA program with the LD_PRELOAD observer and summarize its GPU memory
timeline."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any, Dict, List, Tuple

import memtide
from memtide._files import FileRefused, check_target, json_value, open_input
from memtide._memtide import format_bytes

from ._common import EXIT_INTERRUPTED, UsageError

def _read_timeline(path: str) -> Dict[str, Any]:
    """Summarizes an observer log: every process's header, events and summary line.

    A process that died before its exit (abort, _exit, a signal) leaves no summary line, and a
    write cut short leaves half a line: both make the log incomplete, which the summary says
    (`complete`, `problems`) instead of failing.
    """
    pids, events, summaries, problems = [], 0, [], []
    last_current: Dict[Any, int] = {}  # per process, what its last event left allocated
    peak, peak_t = 0, None
    t0 = None
    with open_input(path, "--log", binary=False, errors="replace") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file ends with a newline, as every whole line does
    for n, line in enumerate(lines, 1):
        try:
            rec = json_value(line)  # nested too deeply is a ValueError too
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            problems.append(f"line {n} is not a whole JSON record" + (" (the last one: cut short)" if n == len(lines)
                                                                      else ""))
            continue
        kind = rec.get("type")
        if kind == "header":
            pids.append(rec.get("pid"))
        elif kind == "event":
            events += 1
            t0 = rec.get("t_ns", 0) if t0 is None else t0
            if rec.get("peak", 0) > peak:
                peak, peak_t = rec["peak"], rec.get("t_ns", 0)
            last_current[rec.get("pid")] = rec.get("current", 0)
        elif kind == "summary":
            summaries.append(rec)
    if len(summaries) < len(pids):
        problems.append(f"{len(pids) - len(summaries)} of {len(pids)} process(es) wrote no summary: they ended "
                        "without running exit handlers (abort, _exit, a signal); their events up to then are here")
    return {
        "log": path, "processes": pids, "events": events, "peak_bytes": peak,
        "peak_at_s": None if peak_t is None else (peak_t - t0) / 1e9,
        # The log's final state: a process's summary line, or, for one that died without it, its
        # last event (what it still held then).
        "current_bytes": sum({**last_current, **{s.get("pid"): s.get("current_bytes", 0)
                                                 for s in summaries}}.values()),
        "unknown_frees": sum(s.get("unknown_frees", 0) for s in summaries),
        "complete": not problems,
        "problems": problems,
    }


def _is_observer_log(path: str) -> bool:
    """Whether `path` starts as the observer's logs do: a header line with the process id."""
    try:
        with open_input(path, "--log") as f:
            first = json_value(f.readline(4096))
    except (OSError, ValueError):  # FileRefused and json_value's NestedTooDeep among them
        return False
    return isinstance(first, dict) and first.get("type") == "header" and "pid" in first


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _run(command: List[str], env: Dict[str, str]) -> Tuple[int, bool]:
    """Runs the program to its end: (its return code, whether memtide was interrupted by SIGINT).

    Ctrl-C in a terminal reaches the whole foreground process group, the program included, so it
    is not sent again (a second SIGINT would cut short the program's own clean-up). A SIGINT sent
    to memtide alone (`kill -INT`, or no terminal) is passed on. Either way memtide waits for the
    program to end, then reports what was observed."""
    proc = subprocess.Popen(command, env=env)
    interrupted = False
    while True:
        try:
            return proc.wait(), interrupted
        except KeyboardInterrupt:
            interrupted = True
            if not _in_terminal_foreground():
                try:
                    proc.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    pass  # it has just ended: the next wait() collects it


def _in_terminal_foreground() -> bool:
    """Whether memtide's process group is its terminal's foreground group (and so got Ctrl-C)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _cmd_observe(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("memtide observe: name the program to run, e.g. memtide observe -- python train.py")
    lib = memtide.preload_library_path()
    if not args.log:
        raise UsageError("memtide observe: --log needs a file name")
    log = os.path.abspath(args.log)
    try:  # the observer (C++) writes the log; a link, FIFO, device or folder there is refused first
        check_target(args.log)
    except FileRefused as e:
        raise UsageError(f"memtide observe: --log: {e}") from None
    replace = os.path.isfile(log) and os.path.getsize(log) > 0
    if replace and not _is_observer_log(log):
        raise UsageError(f"memtide observe: --log {args.log} exists and is not a memtide observe log; memtide "
                         "replaces only its own logs: choose another path, or remove the file yourself")
    folder = os.path.dirname(log)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"memtide observe: cannot write the timeline {log}: its folder "
                         f"{'does not exist' if not os.path.isdir(folder) else 'is not writable'}")
    if args.timeline:
        from memtide import _timeline as timeline

        files = timeline.companions(args.timeline)
        try:  # before the program runs, not after
            timeline.check_outputs(log, {"--timeline": args.timeline, "--timeline's trace": files["trace"],
                                         "--timeline's Chrome trace": files["chrome"],
                                         "--timeline's memory_viz pickle": files["pickle"]}, source_name="--log")
            timeline.check_report_target(args.timeline)
        except timeline.TraceError as e:
            raise UsageError(f"memtide observe: {e}") from None
    if replace:
        os.remove(log)  # the observer appends; one run, one timeline
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["MEMTIDE_PRELOAD_LOG"] = log
    print(f"memtide observe: running {' '.join(command)} with {os.path.basename(lib)}; timeline -> {log}",
          file=sys.stderr, flush=True)
    try:
        rc, interrupted = _run(command, env)
    except FileNotFoundError:
        raise UsageError(f"memtide observe: program {command[0]!r} not found") from None
    except OSError as e:  # not executable, a directory, a bad interpreter line
        raise UsageError(f"memtide observe: cannot run {command[0]!r}: {e.strerror or e}") from None
    if rc < 0:
        # Killed by a signal: exit as a shell reports it, 128 + the signal (139 for SIGSEGV).
        print(f"memtide observe: the program was killed by {_signal_name(-rc)}", file=sys.stderr)
        rc = 128 - rc
    if interrupted:
        print("memtide observe: interrupted (Ctrl-C); what was observed until the program ended follows",
              file=sys.stderr)
    if not os.path.exists(log):
        summary = {"log": log, "processes": [], "events": 0, "peak_bytes": 0, "peak_at_s": None,
                   "current_bytes": 0, "unknown_frees": 0, "complete": True, "problems": []}
    else:
        summary = _read_timeline(log)
    summary["exit_code"] = rc
    summary["interrupted"] = interrupted
    if args.timeline and os.path.exists(log):
        trace = files["trace"]
        timeline.trace_from_observer(log, trace, source="memtide observe", program=" ".join(command))
        report = timeline.render(trace, args.timeline, chrome=files["chrome"], memory_viz=files["pickle"])
        summary["timeline"] = {"html": args.timeline, "trace": trace, "events": report["events"]}
        print(f"memtide observe: timeline report {args.timeline} ({report['events']:,} events)", file=sys.stderr)
    if args.json:
        json.dump(summary, sys.stdout, indent=2, allow_nan=False)
        print()
    elif summary["events"] == 0:
        print("memtide observe: no cudaMalloc/cudaFree(Async) call was seen. The program allocated no GPU "
              "memory, or it reached the CUDA runtime without the dynamic symbol table (cudart_static, "
              "nvcc's default; link with -cudart shared).")
    else:
        at = f" at {summary['peak_at_s']:.3f} s" if summary["peak_at_s"] is not None else ""
        print(f"observed  {summary['events']} segment events in {len(summary['processes'])} process(es)")
        print(f"peak      {format_bytes(summary['peak_bytes'])}{at} (per process)")
        print(f"at exit   {format_bytes(summary['current_bytes'])} still allocated"
              + (f", {summary['unknown_frees']} frees of unseen pointers" if summary["unknown_frees"] else ""))
        print(f"timeline  {log}")
    if summary["problems"]:
        # On stderr in both modes: the figures above cover only what reached the log.
        for problem in summary["problems"]:
            print(f"memtide observe: incomplete timeline: {problem}", file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else rc


def add_parser(sub) -> None:
    observe = sub.add_parser(
        "observe",
        help="run any CUDA program with the LD_PRELOAD observer and summarize its GPU memory timeline",
        description="Runs PROGRAM with libmemtide_preload.so preloaded: every cudaMalloc/cudaFree(Async) it "
        "makes through the shared CUDA runtime is forwarded unchanged and written, with current and peak "
        "bytes, as JSON Lines to --log; then prints the peak and what was left allocated. Exits with "
        "PROGRAM's exit code (128 + the signal when a signal killed it; 130 when memtide was interrupted "
        "with Ctrl-C, after passing it on and reporting what was observed).",
    )
    observe.add_argument("--log", default="memtide_observe.jsonl", metavar="FILE",
                         help="timeline file (default: memtide_observe.jsonl); an older memtide observe log there is replaced, "
                         "any other file is refused")
    observe.add_argument("--timeline", metavar="REPORT.html",
                         help="also write the timeline report (REPORT.html), its trace, a Chrome trace and a "
                         "memory_viz pickle of the program's cudaMalloc/cudaFree calls")
    observe.add_argument("--json", action="store_true", help="print the summary as JSON")
    observe.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS]")
    observe.set_defaults(func=_cmd_observe)
