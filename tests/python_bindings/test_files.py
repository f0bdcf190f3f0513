"""memtide._files: the one writer of every file the Python package writes (a fresh unpredictable
name, O_EXCL|O_NOFOLLOW, synced, renamed over a target that must be a regular file) and the one
check of every file it reads (a regular file, refused otherwise before it is opened); and a scan
of the package's sources that finds any other way of writing a file."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys

import pytest

from memtide import _files
from memtide_testing import clean_env

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PACKAGES = [os.path.join(ROOT, "python_bindings", "memtide"),
            os.path.join(ROOT, "tools", "timeline", "_timeline")]
WRITER = os.path.normpath(os.path.join(ROOT, "python_bindings", "memtide", "_files.py"))


# ---- the scan: nothing but memtide._files opens a file for writing -------------------------------

_WRITE_MODE = set("wax+")
# Calls that create, replace or link a file whatever their arguments.
_MAKES_FILES = {"os.rename", "os.renames", "os.replace", "os.link", "os.symlink", "os.mkfifo", "os.mknod",
                "os.truncate", "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.move",
                "mkstemp", "mkdtemp",
                "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile", "TemporaryDirectory"}
# Calls that write to a destination argument (position, keyword): a path writes a file on its own.
_DESTINATION = {"savefig": (0, "fname"), "torch.save": (1, "f"), "np.save": (0, "file"), "numpy.save": (0, "file"),
                "np.savez": (0, "file"), "np.savez_compressed": (0, "file"), "np.savetxt": (0, "fname"),
                "tofile": (0, "fid"), "to_csv": (0, "path_or_buf"), "pickle.dump": (1, "file"), "json.dump": (1, "fp"),
                "marshal.dump": (1, "file")}
_STD_STREAMS = {"sys.stdout", "sys.stderr"}
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else f".{node.attr}"
    return ""


def _arg(call: ast.Call, position: int, keyword: str):
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _writes_by_mode(mode) -> bool:
    """A mode argument that writes, or that the scan cannot read (so it may)."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return bool(_WRITE_MODE & set(mode.value))
    return True


def _one_writer_files(tree: ast.AST):
    """Names bound by ``with open_output(...) as NAME`` (or ``Output(...)``): the writer's files;
    and names bound by ``NAME = io.BytesIO()``: memory, not a file (a checkpoint's meta bytes are
    serialized there and written by the engine's own writer)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                _dotted(node.value.func) in ("io.BytesIO", "BytesIO", "io.StringIO", "StringIO"):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if isinstance(item.context_expr, ast.Call) and _dotted(item.context_expr.func).split(".")[-1] in (
                        "open_output", "Output") and isinstance(item.optional_vars, ast.Name):
                    names.add(item.optional_vars.id)
    return names


def file_writes(source: str, filename: str = "<source>"):
    """(line, what) for each way `source` opens, creates or replaces a file other than through
    memtide._files."""
    tree = ast.parse(source, filename)
    ours = _one_writer_files(tree)
    found = []
    for node in ast.walk(tree):
        imported = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        if any(a.split(".")[0] == "tempfile" for a in imported) or isinstance(node, ast.ImportFrom) and \
                node.module == "tempfile":
            found.append((node.lineno, "imports tempfile"))
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.split(".")[-1]
        text = ast.unparse(node)[:100]
        if name in ("open", "io.open", "codecs.open", "builtins.open", "os.fdopen") or (
                last == "open" and isinstance(node.func, ast.Attribute) and name != "os.open"):
            # open(path, mode) and os.fdopen(fd, mode); a path object's path.open(mode)
            method = name not in ("open", "io.open", "codecs.open", "builtins.open", "os.fdopen")
            if _writes_by_mode(_arg(node, 0 if method else 1, "mode")):
                found.append((node.lineno, text))
        elif name == "os.open":
            if not (node.args and _dotted(node.args[0]) == "os.devnull") and any(
                    f in ast.unparse(_arg(node, 1, "flags") or ast.Constant(0)) for f in _WRITE_FLAGS):
                found.append((node.lineno, text))
        elif last in ("write_text", "write_bytes", "touch") and isinstance(node.func, ast.Attribute):
            found.append((node.lineno, text))
        elif name in _MAKES_FILES or last in _MAKES_FILES or name.startswith("tempfile."):
            found.append((node.lineno, text))
        else:
            key = name if name in _DESTINATION else last if last in ("savefig", "tofile", "to_csv") else None
            if key is not None:
                dest = _arg(node, *_DESTINATION[key])
                if not (isinstance(dest, ast.Name) and dest.id in ours) and _dotted(dest) not in _STD_STREAMS:
                    found.append((node.lineno, text))
    return found


def test_the_scan_finds_every_kind_of_write_it_looks_for():
    bad = """
import os, shutil, tempfile, pickle, json, torch, numpy as np
from tempfile import mkstemp
open(p, "w"); open(p, "ab"); open(p, mode="x"); open(p, m); os.fdopen(fd, "w")
pathlib.Path(p).open("w"); p.write_text("x"); p.write_bytes(b"x")
os.open(p, os.O_WRONLY | os.O_CREAT); os.replace(a, b); shutil.copy(a, b); tempfile.mkstemp()
fig.savefig(path); torch.save(obj, path); np.save(path, a); pickle.dump(obj, f); json.dump(obj, f)
"""
    assert len(file_writes(bad)) == 19, file_writes(bad)
    good = """
import os, sys, json, pickle
open(p); open(p, "rb"); open(p, encoding="utf-8"); os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
os.open(os.devnull, os.O_WRONLY); json.dump(x, sys.stdout); f.write("x")
with open_output(path, binary=True) as f:
    pickle.dump(obj, f)
    fig.savefig(f, format="png")
buf = io.BytesIO()
torch.save(obj, buf)
"""
    assert file_writes(good) == []


def test_nothing_in_the_package_writes_a_file_but_the_one_writer():
    """Every file the package writes goes through memtide._files.open_output; any other open for
    writing, temporary file, copy, rename or path handed to a saver is listed as file:line."""
    found = []
    for package in PACKAGES:
        for folder, _dirs, names in os.walk(package):
            for name in sorted(names):
                path = os.path.normpath(os.path.join(folder, name))
                if not name.endswith(".py") or path == WRITER:
                    continue
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                rel = os.path.relpath(path, ROOT)
                found += [f"{rel}:{line}: {what}" for line, what in file_writes(source, path)]
    assert not found, "files written without memtide._files.open_output:\n" + "\n".join(found)


# ---- the writer ----------------------------------------------------------------------------------


def _no_temp_left(folder) -> bool:
    return not [p for p in os.listdir(folder) if p.startswith(".memtide-")]


def test_the_writer_puts_the_whole_file_in_place_with_its_mode(tmp_path):
    target = tmp_path / "out.csv"
    target.write_text("old")
    with _files.open_output(target, mode=_files.SHARED) as f:
        f.write("a,b\n")
        assert target.read_text() == "old"  # nothing in place until it is complete
    assert target.read_text() == "a,b\n"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644 & ~_umask()
    with _files.open_output(tmp_path / "r.pickle", binary=True) as f:
        f.write(b"\x80\x04.")
    assert stat.S_IMODE(os.stat(tmp_path / "r.pickle").st_mode) == 0o600
    assert _no_temp_left(tmp_path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_leaves_the_target_as_it_was_and_no_temporary_file(tmp_path):
    target = tmp_path / "out.html"
    target.write_text("earlier report")
    with pytest.raises(RuntimeError):
        with _files.open_output(target) as f:
            f.write("half a report")
            raise RuntimeError("the renderer failed")
    assert target.read_text() == "earlier report" and _no_temp_left(tmp_path)
    out = _files.open_output(target)
    out.file.write("x")
    out.discard()
    assert target.read_text() == "earlier report" and _no_temp_left(tmp_path)


@pytest.mark.parametrize("kind", ["link", "dangling link", "folder", "fifo"])
def test_a_target_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, kind):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "out.json"
    {"link": lambda: target.symlink_to(victim), "dangling link": lambda: target.symlink_to(tmp_path / "nowhere"),
     "folder": lambda: target.mkdir(), "fifo": lambda: os.mkfifo(target)}[kind]()
    words = {"link": "a symbolic link", "dangling link": "a symbolic link", "folder": "a folder",
             "fifo": "a FIFO"}[kind]
    with pytest.raises(_files.FileRefused, match=f"{target}.*{words}, not a regular file"):
        _files.open_output(target)
    assert victim.read_text() == "precious" and os.path.lexists(target) and _no_temp_left(tmp_path)
    assert not (tmp_path / "nowhere").exists()


def test_a_missing_folder_is_refused_naming_it(tmp_path):
    with pytest.raises(_files.FileRefused, match="folder .*no.* does not exist"):
        _files.open_output(tmp_path / "no" / "out.json")


def test_planted_links_at_the_temporary_names_are_never_followed(tmp_path, monkeypatch):
    """The temporary file is created with O_CREAT|O_EXCL|O_NOFOLLOW: a link planted at the name it
    picks (here: made to pick the planted names first) is skipped, its target untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    names = iter(["planted1", "planted2", "fresh"])
    monkeypatch.setattr(_files.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".memtide-planted1.tmp").symlink_to(victim)
    (tmp_path / ".memtide-planted2.tmp").symlink_to(tmp_path / "would-be-created")
    with _files.open_output(tmp_path / "out.txt") as f:
        f.write("mine")
    assert victim.read_text() == "precious" and not (tmp_path / "would-be-created").exists()
    assert (tmp_path / "out.txt").read_text() == "mine" and not (tmp_path / "out.txt").is_symlink()
    assert os.readlink(tmp_path / ".memtide-planted1.tmp") == str(victim)  # left as it was


def test_a_link_planted_at_the_target_while_writing_is_refused_not_replaced(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "out.txt"
    with pytest.raises(_files.FileRefused, match="symbolic link"):
        with _files.open_output(target) as f:
            f.write("mine")
            target.symlink_to(victim)
    assert victim.read_text() == "precious" and target.is_symlink() and _no_temp_left(tmp_path)


def test_an_unwritable_folder_is_an_os_error_naming_the_target(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes any folder")
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="out.txt"):
        _files.open_output(folder / "out.txt")


# ---- the reader's check --------------------------------------------------------------------------

READ_FIFO = r"""
import os, sys
from memtide import _files
fifo = sys.argv[1]
for call in (lambda: _files.open_input(fifo, "trace"), lambda: _files.check_input(fifo, "trace")):
    try:
        call()
    except _files.FileRefused as e:
        print(e)
    else:
        print("not refused")
"""


def test_a_fifo_is_refused_as_an_input_without_opening_it(tmp_path):
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    p = subprocess.run([sys.executable, "-c", READ_FIFO, str(fifo)], env=clean_env(), capture_output=True, text=True,
                       timeout=60)  # a reader that opened it would wait here for a writer
    assert p.returncode == 0, p.stderr
    refused = f"trace {fifo} is a FIFO, not a regular file; memtide reads only regular files"
    assert p.stdout.splitlines() == [refused] * 2


def test_the_input_check_refuses_folders_and_devices_and_follows_links(tmp_path):
    with pytest.raises(_files.FileRefused, match="a folder, not a regular file"):
        _files.open_input(tmp_path, "trace")
    with pytest.raises(_files.FileRefused, match="--topology /dev/null is a device"):
        _files.open_input("/dev/null", "--topology")
    (tmp_path / "real").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with _files.open_input(tmp_path / "link") as f:
        assert f.read() == b"data"
    with pytest.raises(FileNotFoundError):
        _files.open_input(tmp_path / "missing")


def test_json_nested_too_deeply_is_a_value_error_naming_the_depth_and_the_column():
    text = '{"a": "[[[", "b": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(_files.NestedTooDeep,
                       match=r"nested 100,001 levels deep \(its deepest point at column 100018\)"):
        _files.json_value(text)
    assert _files.json_value('{"a": [[1]]}') == {"a": [[1]]}
