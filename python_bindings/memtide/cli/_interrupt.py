"""Ctrl-C in every long command (docs/robustness.md, "Signals"): what finished, exit 130, within 2 s.

Python turns SIGINT into KeyboardInterrupt only between bytecodes of the main thread: a native
call that runs for minutes (one ``memtide._sim`` call simulates every iteration of a contender,
20 minutes at the largest accepted flags) would hold Ctrl-C until it returns. :func:`native`
runs such a call on a worker thread (the simulator releases the GIL) while the main thread waits
in slices, so Ctrl-C reaches the main thread at once and a heartbeat says the work goes on.
:func:`finished` records what a command completed; the command line's top level prints it when
Ctrl-C ends the command, then exits 130.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, List, Optional

#: Seconds between two "still running" lines of a long native call.
HEARTBEAT_S = 10.0

_finished: List[str] = []
_abandoned = False  # a native call still runs on its worker thread


def reset() -> None:
    global _abandoned
    _finished.clear()
    _abandoned = False


def finished(text: str) -> None:
    """Records a piece of work the command completed (said when Ctrl-C ends it)."""
    _finished.append(text)


def summary(command: str) -> str:
    done = "; ".join(_finished) if _finished else "nothing"
    return f"memtide {command}: interrupted (Ctrl-C); finished: {done}"


def abandoned() -> bool:
    """Whether Ctrl-C left a native call running on a worker thread."""
    return _abandoned


def native(call: Callable[..., Any], *args: Any, what: str = "", quiet: bool = False, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` on a worker thread, the main thread waiting for it in slices
    (Ctrl-C raises KeyboardInterrupt here at once; the call, which cannot be stopped, is left to
    the process's end). Every HEARTBEAT_S seconds a line on stderr says `what` still runs, unless
    `quiet`. Returns the call's value or raises its exception."""
    global _abandoned
    result: List[Any] = []
    failure: List[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            result.append(call(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as it is
            failure.append(e)
        finally:
            done.set()

    worker = threading.Thread(target=work, name=f"memtide {what or 'native call'}", daemon=True)
    started = time.monotonic()
    next_beat = started + HEARTBEAT_S
    worker.start()
    try:
        while not done.wait(0.1):
            if not quiet and time.monotonic() >= next_beat:
                print(f"  {what or 'working'}: {time.monotonic() - started:.0f} s so far", file=sys.stderr, flush=True)
                next_beat += HEARTBEAT_S
    except BaseException:
        _abandoned = not done.is_set()
        raise
    if failure:
        raise failure[0]
    return result[0]


def end_interrupted(code: int) -> Optional[int]:
    """After Ctrl-C: where a native call still runs on its worker thread, ends the process now
    (flushed, this process's spill folders removed) rather than let the interpreter's finalization
    run beside it; else returns `code` for a normal exit."""
    if not _abandoned:
        return code
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    from memtide import _memtide

    _memtide.remove_spill_dirs()
    os._exit(code)
