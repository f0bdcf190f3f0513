"""What memtide leaves behind when a process ends, however it ends (docs/robustness.md, "Signals").

One home for every ending:

* a clean exit and Ctrl-C: the interpreter's exit runs :func:`memtide._memtide.remove_spill_dirs`
  (registered with atexit by ``memtide/__init__``);
* SIGTERM and SIGHUP (what Slurm, Kubernetes and torchrun's teardown send before SIGKILL): the
  default action kills the process with no exit handler run, so :func:`install` puts a Python
  handler on them. Python runs it in the main thread between two bytecodes, never in the
  signal's asynchronous context (the C-level handler only sets a flag). It removes this process's
  spill folders, then chains to the handler that was there before (the user's, a framework's) and
  lets it decide; where there was none, it raises :class:`Terminated`, a SystemExit of
  128 + the signal, so ``finally`` blocks and ``with`` blocks run (a trace being written is closed
  and parses; a half-written output is discarded) and the process exits 143 (SIGTERM) or 129
  (SIGHUP), as a shell reports a process the signal ended. A native call that holds the main
  thread (an optimizer step) delays this until it returns;
* SIGKILL (and a machine that went down): nothing can run. :func:`remove_stale_spills` finds the
  folder at the next start in the same spill directory and removes it, naming it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import stat
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from . import _memtide

#: The signals a scheduler sends to end a job, handled here (SIGINT is Python's KeyboardInterrupt).
SIGNALS = (signal.SIGTERM, signal.SIGHUP)

# memtide-spill-PID[-rankR]-XXXXXX, as tiering::SpillDir names them (mkdtemp's six characters).
_SPILL_NAME = re.compile(r"^memtide-spill-(?P<pid>[1-9][0-9]{0,9})(?:-rank[0-9]+)?-[A-Za-z0-9]{6}$")

# A process that started this long after a folder's last change cannot be the one that made it
# (the start time is known to a clock tick, the boot time to a second).
_START_SLACK_S = 2.0


class Terminated(SystemExit):
    """SIGTERM or SIGHUP ended the program: a SystemExit whose code is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.signal_name = _name(signum)


_previous: Dict[int, Any] = {}
_installed: Dict[int, Callable[[int, Any], None]] = {}
_ending = False


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _on_signal(signum: int, frame: Any) -> None:
    """SIGTERM / SIGHUP, run by Python in the main thread's normal context."""
    global _ending
    if _ending:
        return  # the first one is already ending the program: let its clean-up finish
    # First, whatever the handler below does (os._exit included): take the spill folders' names
    # away. Their open files stay usable, so a handler that saves a checkpoint still can.
    removed = _memtide.remove_spill_dirs()
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)  # the user's (or a framework's) handler decides what happens next
        return
    _ending = True
    try:
        print(f"memtide: {_name(signum)}: exiting with {128 + signum}"
              + (f" ({removed} spill folder(s) removed)" if removed else ""), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # no stderr (closed, a broken pipe): exit all the same
        pass
    raise Terminated(signum)


def install() -> List[str]:
    """Puts memtide's handler on SIGTERM and SIGHUP; returns the names of those it handles.

    A signal the program ignores (SIG_IGN, e.g. under nohup) or that C code handles (which
    Python cannot call) is left as it is; a Python handler already there is chained to. Called
    again (a handler was put there since), it chains to that one. Only the main thread can set
    handlers: from any other, nothing is done.
    """
    if threading.current_thread() is not threading.main_thread():
        return []
    handled = []
    for signum in SIGNALS:
        try:
            current = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if current is _on_signal:
            handled.append(_name(signum))
            continue
        if current is signal.SIG_IGN or current is None:
            continue
        _previous[signum] = current if callable(current) else None
        try:
            signal.signal(signum, _on_signal)
        except (ValueError, OSError):
            continue
        _installed[signum] = _on_signal
        handled.append(_name(signum))
    return handled


def uninstall() -> None:
    """Puts back the handlers install() found (for tests and embedders)."""
    global _ending
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in list(_installed):
        if signal.getsignal(signum) is _on_signal:
            previous = _previous.get(signum)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        _installed.pop(signum, None)
        _previous.pop(signum, None)
    _ending = False


# ---- spill folders of processes that are gone ---------------------------------------------------


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _start_time(pid: int) -> Optional[float]:
    """When process `pid` started (seconds since the epoch), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    boot = _boot_time()
    try:
        fields = text[text.rindex(b")") + 2:].split()  # after "pid (comm) ", comm may hold spaces
        ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
    except (ValueError, IndexError):
        return None
    if boot is None:
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _owner_gone(pid: int, changed: float) -> bool:
    """Whether process `pid`, which made a folder last changed at `changed`, has ended: no such
    process, or one that started after the folder changed (the pid was reused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process: it may be the owner (after setuid); keep the folder
    except OSError:
        return False
    started = _start_time(pid)
    return started is not None and started > changed + _START_SLACK_S


def _files_in_use(folder: str) -> Optional[bool]:
    """Whether a process has a file of `folder` open, seen through the kernel (any pid namespace:
    a write lease is granted only on a file nobody else has open); None where leases cannot
    tell (a file system without them, leases turned off)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # a link or a folder someone put there: not a file a process spills to
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EBUSY):
                    return True
                return None
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        finally:
            os.close(fd)
    return False


def _tree_bytes(folder: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def stale_spills(parent: Union[str, os.PathLike]) -> List[Tuple[str, int, int]]:
    """The spill folders in `parent` that memtide made for a process that has ended:
    (path, pid, bytes on disk) each. A folder counts only when all of these hold: its name is
    memtide-spill-PID[-rankR]-XXXXXX; it is a folder, not a link; this user owns it; process PID
    is gone (or the pid now belongs to a process that started after the folder last changed);
    and no process has a file in it open (the kernel's word, which covers processes of other
    pid namespaces: containers that share the directory)."""
    parent = os.fspath(parent)
    out = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return out
    uid = os.getuid()
    for entry in entries:
        m = _SPILL_NAME.match(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or not _owner_gone(pid, max(st.st_mtime, st.st_ctime)):
            continue
        if _files_in_use(entry.path):
            continue
        out.append((entry.path, pid, _tree_bytes(entry.path)))
    return out


def _remove_tree(path: str) -> None:
    """Removes a spill folder without following a link in it (os.walk from the bottom, lstat'd)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            if os.path.islink(full):
                os.unlink(full)
            else:
                os.rmdir(full)
    os.rmdir(path)


def remove_stale_spills(parent: Union[str, os.PathLike], log: Optional[Callable[[str], None]] = None) -> List[str]:
    """Removes the spill folders of ended processes in `parent` (see :func:`stale_spills`),
    naming each on stderr (or through `log`); returns their paths. A folder that cannot be
    removed is named with the reason and left."""
    if log is None:
        def log(text: str) -> None:
            print(text, file=sys.stderr, flush=True)
    removed = []
    for path, pid, nbytes in stale_spills(parent):
        size = _memtide.format_bytes(nbytes)
        try:
            _remove_tree(path)
        except FileNotFoundError:
            continue  # another process (a rank beside this one) removed it first
        except OSError as e:
            log(f"memtide: could not remove {path} ({size}), left by process {pid} that did not exit cleanly: "
                f"{e.strerror or e}")
            continue
        removed.append(path)
        log(f"memtide: removed {path} ({size}): the spill folder of process {pid}, which did not exit cleanly "
            "(killed, or its machine went down)")
    return removed
