"""The one place memtide's Python code creates the files it writes, and checks the files it reads
(core/include/memtide/core/files.hpp is the C++ side's).

Writing: ``with open_output(path, mode=PRIVATE) as f: f.write(...)``. The data goes to a new file
under an unpredictable name in the target's folder, created with O_CREAT|O_EXCL|O_NOFOLLOW (a
name someone planted, a symbolic link in particular, is never opened), then flushed, synced and
renamed over the target: a reader sees the old file or the whole new one, and a failure removes
the new file and leaves the old one as it was. A target that exists and is not a regular file (a
symbolic link, a FIFO, a device, a folder) is refused naming it, and so is a missing folder.

Reading: ``open_input(path, "trace")`` opens a file the user named only when it is a regular file.
A FIFO would block the reader forever and a device may never end, so anything else is refused
naming it, from os.stat() before it is opened; the check is repeated on the open descriptor (the
open itself does not wait on a FIFO), so a file swapped in between is refused too.

Every refusal is a FileRefused (a ValueError) whose message names the path; the command line turns
it into exit status 2. Failures of the operating system (a folder without write permission, a full
disk) stay OSErrors.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import sys
from typing import IO, Any, Optional, Union

__all__ = ["FileRefused", "NestedTooDeep", "Output", "PRIVATE", "SHARED", "check_input", "check_target",
           "json_value", "nested_too_deep", "open_input", "open_output"]

#: The mode of what a run recorded (reports, traces, Chrome traces, PNGs, pickles): its owner's only.
PRIVATE = 0o600
#: The mode of results meant to be shared and committed (``memtide simulate --update-sweep --csv``).
SHARED = 0o644

Path = Union[str, "os.PathLike[str]"]

# A new file: never an existing name, never through a link, not inherited by child processes.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_PREFIX = ".memtide-"


class FileRefused(ValueError):
    """A path memtide will not read or write as a file (a symbolic link, a FIFO, a device or a folder
    where a regular file must be, a folder that does not exist), or a file it cannot read as what it
    must be (memtide._timeline's TraceError is this class). The message names the path."""


class NestedTooDeep(ValueError):
    """JSON nested deeper than the decoder can follow (json_value)."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


# ---- writing --------------------------------------------------------------------------------------


def check_target(path: Path) -> str:
    """Refuses a path memtide is to write, before anything is written: its folder must exist, and
    the path, where it exists, must be a regular file (not a symbolic link, even to one). Returns
    the absolute path."""
    target = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise FileRefused(f"cannot write {os.fspath(path)}: folder {folder} does not exist")
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{os.fspath(path)} is {_kind(st.st_mode)}, not a regular file; memtide writes only regular "
                          "files (remove it or choose another path)")
    return target


class Output:
    """A file being written for `path` (see open_output): ``file`` takes the data; commit() puts it
    in place of `path`, discard() removes it. As a context manager: commits when the block ends
    without an exception, discards otherwise."""

    def __init__(self, path: Path, binary: bool = False, mode: int = PRIVATE):
        self.path = os.fspath(path)
        self._target = check_target(path)
        folder = os.path.dirname(self._target)
        for _ in range(100):
            tmp = os.path.join(folder, _TEMP_PREFIX + secrets.token_hex(8) + ".tmp")
            try:
                fd = os.open(tmp, _CREATE, mode)
                break
            except FileExistsError:
                continue  # the name is taken (planted, or a rare collision): another one
            except OSError as e:  # named by the target, not by the temporary name
                raise type(e)(e.errno, e.strerror, self.path) from None
        else:
            raise FileExistsError(f"cannot write {self.path}: no new file name in {folder} after 100 tries")
        self._tmp: Optional[str] = tmp
        try:
            self.file: IO[Any] = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        except BaseException:
            os.close(fd)
            self._remove()
            raise

    def _remove(self) -> None:
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None

    def commit(self) -> None:
        """Flushes, syncs and renames the new file over the target (checked again: a link planted
        there meanwhile is refused, not replaced). Any failure removes the new file."""
        if self._tmp is None:
            raise ValueError(f"{self.path}: already committed or discarded")
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            check_target(self._target)
            os.replace(self._tmp, self._target)
            self._tmp = None
        except BaseException:
            self.discard()
            raise
        try:  # the rename itself survives a crash once the folder is synced
            fd = os.open(os.path.dirname(self._target), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # a folder that cannot be synced (some file systems): the data itself is

    def discard(self) -> None:
        """Removes the new file; the target stays as it was."""
        try:
            self.file.close()
        except OSError:
            pass
        self._remove()

    def __enter__(self) -> IO[Any]:
        return self.file

    def __exit__(self, kind, value, tb) -> bool:
        if kind is None:
            self.commit()
        else:
            self.discard()
        return False


def open_output(path: Path, *, binary: bool = False, mode: int = PRIVATE) -> Output:
    """memtide's one way to write a file: ``with open_output(path) as f: f.write(...)``. Text is
    UTF-8; `mode` is the new file's (less the umask): PRIVATE or SHARED. Refuses a target that is
    not a regular file, or a missing folder (FileRefused, naming it), before anything is written."""
    return Output(path, binary=binary, mode=mode)


# ---- reading --------------------------------------------------------------------------------------


def _refuse_special(path: Path, what: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise FileRefused(f"{what} {os.fspath(path)} is {_kind(mode)}, not a regular file; memtide reads only regular "
                          "files")


def check_input(path: Path, what: str = "file") -> None:
    """Refuses, without opening it, a path the user gave memtide to read that exists and is not a
    regular file (a FIFO, a device, a socket, a folder; a symbolic link is followed), naming it as
    `what` (``"trace"``, ``"--topology"``). A path that cannot be looked at (missing, no
    permission) is left to the open that follows, which names it."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    _refuse_special(path, what, st.st_mode)


def open_input(path: Path, what: str = "file", *, binary: bool = True, errors: str = "strict") -> IO[Any]:
    """Opens a file the user named, for reading, only when it is a regular file (check_input, and
    again on the open descriptor). Text is UTF-8, with `errors` as open() takes it. A path that
    cannot be opened raises the OSError of the open."""
    check_input(path, what)
    # O_NONBLOCK: a FIFO swapped in after the check does not block the open; the fstat refuses it.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _refuse_special(path, what, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb") if binary else os.fdopen(fd, "r", encoding="utf-8", errors=errors)
    except BaseException:
        os.close(fd)
        raise


def json_value(text: Union[str, bytes], decoder: Optional[json.JSONDecoder] = None) -> Any:
    """One JSON value from text a user's file holds (a line of a trace or a log), by `decoder`
    (json's default one without). json recurses once per level of nesting: a value nested deeper
    than the interpreter's recursion limit is a NestedTooDeep (a ValueError), never a RecursionError."""
    try:
        if decoder is None:
            return json.loads(text)
        return decoder.decode(text if isinstance(text, str) else text.decode("utf-8"))
    except RecursionError:
        raise nested_too_deep(text) from None


def nested_too_deep(text: Union[str, bytes]) -> NestedTooDeep:
    """The error for JSON `text` on which json's decoder raised RecursionError: how deep it nests
    and the column of its deepest point. (json_value raises it; a reader that calls a decoder
    itself, once per line of a long file, catches RecursionError and raises this.)"""
    depth, column = _deepest(text if isinstance(text, str) else text.decode("utf-8", "replace"))
    return NestedTooDeep(f"nested {depth:,} levels deep (its deepest point at column {column}); memtide reads JSON "
                         f"nested up to about {sys.getrecursionlimit():,} levels")


def _deepest(text: str):
    """How deep JSON `text` nests its arrays and objects, and the column (from 1) where that depth
    is first reached. Brackets inside strings do not count."""
    depth = deepest = 0
    column = 1
    in_string = escaped = False
    for i, c in enumerate(text, 1):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > deepest:
                deepest, column = depth, i
        elif c in "]}":
            depth -= 1
    return deepest, column
