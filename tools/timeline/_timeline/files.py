"""The files of a report (REPORT.html and its companions): where they go, and which targets are
refused. They are written by memtide._files.open_output, memtide's one writer: atomically, never
through a link, never over anything but a regular file."""

from __future__ import annotations

import os
from typing import Dict, Optional

from memtide._files import FileRefused, check_target

#: A trace file memtide cannot read, or a target it will not write: memtide's one error for a file
#: it refuses (memtide._files.FileRefused), which the command line reports with exit status 2.
TraceError = FileRefused


def companions(report: str) -> Dict[str, str]:
    """The files that go with a report: REPORT.html -> REPORT.trace.jsonl, .chrome.json, .png,
    .pickle (a memory_viz snapshot)."""
    base = report[:-5] if report.endswith(".html") else report
    return {"trace": base + ".trace.jsonl", "chrome": base + ".chrome.json", "png": base + ".png",
            "pickle": base + ".pickle"}


def rank_report(report: str, rank: int) -> str:
    """The report of one rank of a job: REPORT.html -> REPORT.rank<R>.html (and so its companions:
    REPORT.rank<R>.trace.jsonl, ...), so that the ranks of one job, given the same path, never
    write over each other and ``memtide timeline REPORT.rank*.trace.jsonl`` finds them all."""
    if report.endswith(".html"):
        return f"{report[:-5]}.rank{rank}.html"
    return f"{report}.rank{rank}"


def check_report_target(report: str) -> None:
    """Refuses a report path (and its companions) that cannot be written, before any work is
    done for it: a missing folder, or a link, device or folder where a file would go."""
    for path in [report, *companions(report).values()]:
        check_target(path)


def _identity(path: str):
    """What makes two paths one file: the inode when it exists (links and hard links included),
    else the path with every link resolved."""
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return os.path.realpath(path)


def check_outputs(source: str, outputs: Dict[str, Optional[str]], source_name: str = "the trace") -> None:
    """Refuses, before anything is read or written, an output that is `source` itself under any
    name (the same path, a symbolic link to it, a hard link) or the same file as another output:
    writing it would destroy what is being read, or one output would replace another. `outputs`
    maps how to name each output to the user (its flag) to its path; None is skipped."""
    source_id = _identity(source)
    seen: Dict[object, str] = {}
    for name, path in outputs.items():
        if not path:
            continue
        ident = _identity(path)
        if ident == source_id:
            raise TraceError(f"{name} {path} is the same file as {source_name} {source}: writing it would destroy "
                             "what is being read; choose another path")
        if ident in seen:
            raise TraceError(f"{name} and {seen[ident]} are the same file ({path}); give each its own path")
        seen[ident] = name
