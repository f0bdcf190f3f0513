"""The trace format (see the package's docstring): its version, the fields each event type must
have, a writer and a reader."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

from .files import AtomicFile, TraceError

VERSION = 1

# The fields each event type must have, and their types; other fields are free.
_NUMBER = (int, float)
_FIELDS = {
    "phase": (("t", _NUMBER), ("phase", str)),
    "memory": (("t", _NUMBER), ("allocated", _NUMBER), ("reserved", _NUMBER)),
    "op": (("engine", str), ("start", _NUMBER), ("end", _NUMBER)),
    "tiering": (("what", str), ("start", _NUMBER), ("end", _NUMBER)),
    "alloc": (("t", _NUMBER),),
    "free": (("t", _NUMBER),),
}


class TraceWriter:
    """Writes a trace event by event. ``with TraceWriter(path, source="run") as w: w.op(...)``."""

    def __init__(self, path: str, **header: Any):
        self._file = AtomicFile(path)
        self._f = self._file.__enter__()
        self._f.write(json.dumps({"memtide_trace": VERSION, **header}) + "\n")
        self.events = 0

    def event(self, **fields: Any) -> None:
        self._f.write(json.dumps(fields, separators=(",", ":")) + "\n")
        self.events += 1

    def phase(self, t: float, phase: str) -> None:
        self.event(type="phase", t=t, phase=phase)

    def memory(self, t: float, allocated: int, reserved: int) -> None:
        self.event(type="memory", t=t, allocated=int(allocated), reserved=int(reserved))

    def op(self, engine: str, start: float, end: float, nbytes: float) -> None:
        self.event(type="op", engine=engine, start=start, end=end, bytes=nbytes)

    def close(self, error: Optional[BaseException] = None) -> None:
        if error is None:
            self._file.__exit__(None, None, None)
        else:
            self._file.__exit__(type(error), error, None)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self.close(value)
        return False


def read_trace(path: str, progress: bool = False) -> Tuple[Dict[str, Any], Iterator[Dict[str, Any]]]:
    """The header and an iterator over the events. Raises TraceError naming the file and the line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        header = json.loads(f.readline())
    except ValueError:  # not JSON, or not text at all (UnicodeDecodeError is a ValueError)
        f.close()
        raise TraceError(f"{path} is not a memtide trace: line 1 is not JSON") from None
    if not isinstance(header, dict) or "memtide_trace" not in header:
        f.close()
        raise TraceError(f"{path} is not a memtide trace: line 1 has no \"memtide_trace\" version")
    if not isinstance(header["memtide_trace"], int) or header["memtide_trace"] > VERSION:
        f.close()
        raise TraceError(f"{path} is trace format {header['memtide_trace']!r}; this memtide reads up to {VERSION}")
    size = os.fstat(f.fileno()).st_size

    def events() -> Iterator[Dict[str, Any]]:
        with f:
            shown = 0
            n = 1
            try:
                for n, line in enumerate(f, 2):
                    if not line.strip():
                        continue
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        raise TraceError(f"{path}: line {n} is not JSON (a trace cut short?)") from None
                    if not isinstance(ev, dict):
                        continue
                    for field, kind in _FIELDS.get(ev.get("type"), ()):
                        if not isinstance(ev.get(field), kind) or isinstance(ev.get(field), bool):
                            raise TraceError(f"{path}: line {n}: a {ev.get('type')} event needs {field!r} as "
                                             f"{'a number' if kind != str else 'text'}, got {ev.get(field)!r}")
                    yield ev
                    if progress and n % 200_000 == 0:
                        done = f.tell() * 100 // max(size, 1)
                        if done >= shown + 10:
                            shown = done
                            print(f"timeline: read {n:,} events ({done}%)", file=sys.stderr, flush=True)
            except UnicodeDecodeError:
                raise TraceError(f"{path}: line {n + 1} is not text") from None

    return header, events()
