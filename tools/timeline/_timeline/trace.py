"""The trace format (see the package's docstring): its version, the fields each event type must
have, a writer and a reader."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

from memtide._files import nested_too_deep, open_input, open_output

from .files import TraceError

VERSION = 1
# A header line longer than this is not a trace's (and is not read whole into memory).
_MAX_HEADER = 1 << 20

# What a trace may hold, checked on reading so that nothing downstream (the report's arithmetic,
# the Chrome trace, --json) ever sees a NaN, an infinity, a negative size or a size no integer
# type memtide uses can hold.
#: Times are seconds on the trace's clock: 0 to 1e12 (31,700 years; any steady, virtual or epoch
#: clock fits, and spans of such times stay exact enough to draw).
MAX_TIME_S = 1e12
#: Byte counts fit a signed 64-bit integer, the C++ side's size type.
MAX_BYTES = 2**63 - 1
_MAX_ADDRESS = 2**64 - 1
#: A job's ranks, as core/job reads RANK and WORLD_SIZE: 1 to 2**20.
MAX_RANKS = 1 << 20


def _address_ok(v: Any) -> bool:
    if type(v) is str:  # the observer writes pointers as text: "0x7f..."
        try:
            v = int(v, 0)
        except ValueError:
            return False
    return type(v) is int and 0 <= v <= _MAX_ADDRESS


# What a field may be, in words, and its test. `type(v) is` rather than isinstance: JSON gives
# exactly int, float or str, and it keeps bool (an int subclass) out; the range comparisons are
# False for NaN and the infinities too. A number of bytes moved may have a fraction (a model's
# average); bytes allocated and indices may not. Checked for each of millions of events: kept to
# a comparison or two.
_KINDS = {
    "time": (f"a number of seconds from 0 to {MAX_TIME_S:g}",
             lambda v: (type(v) is float or type(v) is int) and 0 <= v <= MAX_TIME_S),
    "amount": (f"a number of bytes from 0 to {MAX_BYTES}",
               lambda v: (type(v) is float or type(v) is int) and 0 <= v <= MAX_BYTES),
    "size": (f"a whole number of bytes from 0 to {MAX_BYTES}",
             lambda v: (type(v) is int and 0 <= v <= MAX_BYTES)
             or (type(v) is float and 0 <= v <= MAX_BYTES and v.is_integer())),
    "index": (f"a whole number from 0 to {MAX_BYTES}",
              lambda v: (type(v) is int and 0 <= v <= MAX_BYTES)
              or (type(v) is float and 0 <= v <= MAX_BYTES and v.is_integer())),
    "address": ('an address (an integer from 0 to 2**64-1, or its text such as "0x7f00")', _address_ok),
    "text": ("text", lambda v: type(v) is str),
}

# Per event type: the fields readers use, what each must be, and whether it may be left out.
_SPEC = {
    "phase": (("t", "time", True), ("phase", "text", True)),
    "memory": (("t", "time", True), ("allocated", "size", True), ("reserved", "size", True)),
    "op": (("engine", "text", True), ("start", "time", True), ("end", "time", True), ("bytes", "amount", False)),
    "tiering": (("what", "text", True), ("subgroup", "index", False), ("start", "time", True), ("end", "time", True),
                ("bytes", "amount", False)),
    "alloc": (("t", "time", True), ("bytes", "size", False), ("addr", "address", False),
              ("stream", "address", False)),
    "free": (("t", "time", True), ("bytes", "size", False), ("addr", "address", False),
             ("stream", "address", False)),
    "oom": (("t", "time", True), ("bytes", "size", False), ("stream", "address", False)),
    "host": (("t", "time", True), ("reserved", "size", False), ("allocated", "size", False), ("staging", "size", False),
             ("rss", "size", False)),
    "nvme": (("what", "text", True), ("subgroup", "index", False), ("queued", "time", False), ("start", "time", True),
             ("end", "time", True), ("bytes", "amount", False)),
    "spill": (("t", "time", True), ("bytes", "size", True)),
    "checkpoint": (("t", "time", True), ("written", "size", True), ("total", "size", True),
                   ("waited", "amount", False), ("target", "text", False)),
}
# type -> ((field, test, required), ...), and how many fields an event has when it has no others.
_FIELDS = {kind: tuple((field, _KINDS[k][1], required) for field, k, required in spec) for kind, spec in _SPEC.items()}
_KNOWN = {kind: 1 + len(spec) for kind, spec in _SPEC.items()}
_MISSING = object()
# Header fields readers use (null: not known).
_HEADER_FIELDS = (("capacity_bytes", "size"), ("host_capacity_bytes", "size"), ("nvme_capacity_bytes", "size"),
                  ("rank", "index"), ("world_size", "index"), ("epoch_offset_s", "time"), ("host", "text"))


class _NotJsonNumber(ValueError):
    """NaN, Infinity or -Infinity: Python's json accepts them, JSON does not."""


def _refuse_constant(token: str) -> Any:
    raise _NotJsonNumber(token)


_decoder = json.JSONDecoder(parse_constant=_refuse_constant)


def _field_of_constant(line: str, token: str) -> str:
    """The field a NaN or Infinity stands in, for the error message."""
    m = re.search(r'"((?:[^"\\]|\\.)*)"\s*:\s*' + re.escape(token), line)
    return repr(m.group(1)) if m else "a field"


def _problem(ev: Dict[str, Any]) -> Optional[str]:
    """What is wrong with `ev`, in words, or None. Events of unknown types are carried as they are."""
    kind = ev.get("type")
    fields = _FIELDS.get(kind) if type(kind) is str else None
    if fields is None:
        return None
    for field, ok, required in fields:
        v = ev.get(field, _MISSING)
        if v is _MISSING:
            if not required:
                continue
        elif ok(v):
            continue
        expected = _KINDS[next(k for f, k, _ in _SPEC[kind] if f == field)][0]
        got = "nothing" if v is _MISSING else repr(v)
        return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} event needs {field!r} as {expected}, got {got}"
    if "end" in ev and ev["end"] < ev["start"]:
        return f"'end' ({ev['end']!r}) is before 'start' ({ev['start']!r})"
    if len(ev) > _KNOWN[kind]:
        # Fields no reader uses are carried as they are, but a number among them is still finite.
        for field, v in ev.items():
            if type(v) is float and not math.isfinite(v):
                return f"{field!r} must be a finite number, got {v!r}"
    return None


class TraceWriter:
    """Writes a trace event by event. ``with TraceWriter(path, source="run") as w: w.op(...)``."""

    def __init__(self, path: str, **header: Any):
        if "job" not in header:  # every trace names its job (jobs.job_identity); job=None leaves it out
            from .jobs import job_identity

            header["job"] = job_identity()
        elif header["job"] is None:
            del header["job"]
        self._file = open_output(path)
        self._f = self._file.file
        # allow_nan=False: a writer never writes what the reader refuses (nor what is not JSON).
        try:
            self._f.write(json.dumps({"memtide_trace": VERSION, **header}, allow_nan=False) + "\n")
        except BaseException:
            self._file.discard()  # no `with` has begun to do it
            raise
        self.events = 0

    def event(self, **fields: Any) -> None:
        self._f.write(json.dumps(fields, separators=(",", ":"), allow_nan=False) + "\n")
        self.events += 1

    def phase(self, t: float, phase: str) -> None:
        self.event(type="phase", t=t, phase=phase)

    def memory(self, t: float, allocated: int, reserved: int) -> None:
        self.event(type="memory", t=t, allocated=int(allocated), reserved=int(reserved))

    def op(self, engine: str, start: float, end: float, nbytes: float) -> None:
        self.event(type="op", engine=engine, start=start, end=end, bytes=nbytes)

    def close(self, error: Optional[BaseException] = None) -> None:
        if error is None:
            self._file.commit()
        else:
            self._file.discard()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self.close(value)
        return False


def read_trace(path: str, progress: bool = False) -> Tuple[Dict[str, Any], Iterator[Dict[str, Any]]]:
    """The header and an iterator over the events. Raises TraceError naming the file, the line and
    the field: every number a reader uses is range-checked (see _FIELDS), and NaN or Infinity is
    refused anywhere."""
    try:
        f = open_input(path, "trace")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        first = f.readline(_MAX_HEADER)
        header = _decoder.decode(first.decode("utf-8"))
    except RecursionError:  # json recurses once per level of nesting
        f.close()
        raise TraceError(f"{path}: line 1 is {nested_too_deep(first)}") from None
    except _NotJsonNumber as e:
        f.close()
        raise TraceError(f"{path}: line 1: {_field_of_constant(first.decode('utf-8'), str(e))} must be a finite "
                         f"number, got {e}") from None
    except ValueError:  # not JSON, or not text at all (UnicodeDecodeError is a ValueError)
        f.close()
        raise TraceError(f"{path} is not a memtide trace: line 1 is not JSON") from None
    except OSError as e:
        f.close()
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    if not isinstance(header, dict) or "memtide_trace" not in header:
        f.close()
        raise TraceError(f"{path} is not a memtide trace: line 1 has no \"memtide_trace\" version")
    version = header["memtide_trace"]
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= VERSION:
        f.close()
        raise TraceError(f"{path} is trace format {version!r}; this memtide reads formats 0 to {VERSION}")
    for field, kind in _HEADER_FIELDS:
        expected, ok = _KINDS[kind]
        if header.get(field) is not None and not ok(header[field]):
            f.close()
            raise TraceError(f"{path}: line 1: {field!r} must be {expected}, got {header[field]!r}")
    job = header.get("job")
    if job is not None and not (isinstance(job, dict) and type(job.get("launcher")) is str):
        f.close()
        raise TraceError(f"{path}: line 1: 'job' must be a job's identity (an object with its \"launcher\"), "
                         f"got {job!r:.200}")
    rank, world = header.get("rank"), header.get("world_size")
    if world is not None and not 1 <= world <= MAX_RANKS:
        f.close()
        raise TraceError(f"{path}: line 1: 'world_size' must be a number of ranks from 1 to {MAX_RANKS}, got {world!r}")
    if rank is not None and not rank < (MAX_RANKS if world is None else world):
        f.close()
        raise TraceError(f"{path}: line 1: 'rank' {rank!r} is not a rank of "
                         + (f"a job of {world} ranks ('world_size')" if world is not None else f"any job (0 to {MAX_RANKS - 1})"))
    for field, v in header.items():
        if type(v) is float and not math.isfinite(v):
            f.close()
            raise TraceError(f"{path}: line 1: {field!r} must be a finite number, got {v!r}")
    size = os.fstat(f.fileno()).st_size
    done_bytes = len(first)

    def events() -> Iterator[Dict[str, Any]]:
        # Bytes are counted as lines are read, for the progress line: tell() is not allowed on a
        # file being iterated.
        nonlocal done_bytes
        with f:
            shown = 0
            for n, raw in enumerate(f, 2):
                done_bytes += len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TraceError(f"{path}: line {n} is not text") from None
                if not line.strip():
                    continue
                try:
                    ev = _decoder.decode(line)
                except RecursionError:  # json recurses once per level of nesting
                    raise TraceError(f"{path}: line {n} is {nested_too_deep(line)}") from None
                except _NotJsonNumber as e:
                    raise TraceError(f"{path}: line {n}: {_field_of_constant(line, str(e))} must be a finite "
                                     f"number, got {e}") from None
                except ValueError:
                    raise TraceError(f"{path}: line {n} is not JSON (a trace cut short?)") from None
                if not isinstance(ev, dict):
                    continue
                problem = _problem(ev)
                if problem:
                    raise TraceError(f"{path}: line {n}: {problem}")
                yield ev
                if progress and n % 200_000 == 0:
                    done = done_bytes * 100 // max(size, 1)
                    if done >= shown + 10:
                        shown = done
                        print(f"timeline: read {n:,} events ({done}%)", file=sys.stderr, flush=True)

    return header, events()
