"""`memtide observe`: the LD_PRELOAD observer shipped in the package, around an unmodified program.

No GPU here, so the "CUDA runtime" is a stand-in compiled by the test (a libcudart.so.0 backed by
malloc) and the program is Python calling it through ctypes, as any dynamically linked CUDA program
calls the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import memtide
from memtide_testing import clean_env, default_signals

FAKE_CUDART = r"""
#include <stdlib.h>
int cudaMalloc(void** p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaMallocAsync(void** p, size_t n, void* s) { (void)s; *p = malloc(n); return *p ? 0 : 2; }
int cudaFree(void* p) { free(p); return 0; }
int cudaFreeAsync(void* p, void* s) { (void)s; free(p); return 0; }
"""

# Peak 96 MiB (64 + 32), then the 32 MiB one is left allocated at exit.
PROGRAM = r"""
import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
rt = ctypes.CDLL(None)  # the global scope: the observer's cudaMalloc comes first
a, b = ctypes.c_void_p(), ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(a), ctypes.c_size_t(64 << 20)) == 0
assert rt.cudaMallocAsync(ctypes.byref(b), ctypes.c_size_t(32 << 20), None) == 0
assert rt.cudaFree(a) == 0
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA runtime")
    d = tmp_path_factory.mktemp("cudart")
    (d / "fake.c").write_text(FAKE_CUDART)
    lib = d / "libcudart.so.0"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(d / "fake.c")], check=True)
    return str(lib)


def observe(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "memtide.cli", "observe", *args], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=120)


def test_the_observer_ships_with_the_package():
    path = memtide.preload_library_path()
    assert os.path.isfile(path) and os.path.dirname(path) == os.path.dirname(memtide.__file__)


def test_observe_records_the_programs_segments(tmp_path, fake_cudart):
    p = observe(tmp_path, "--json", "--log", "t.jsonl", "--", sys.executable, "-c", PROGRAM, fake_cudart, "0")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["events"] == 3
    assert s["peak_bytes"] == 96 << 20
    assert s["current_bytes"] == 32 << 20
    assert s["complete"] and len(s["processes"]) == 1
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [e["op"] for e in lines if e["type"] == "event"] == ["malloc", "malloc_async", "free"]


def test_observe_passes_the_exit_code_through_and_prints_text(tmp_path, fake_cudart):
    p = observe(tmp_path, "--", sys.executable, "-c", PROGRAM, fake_cudart, "3")
    assert p.returncode == 3
    assert "96.00 MiB" in p.stdout and "32.00 MiB still allocated" in p.stdout


def test_observe_without_gpu_calls_says_why_nothing_was_seen(tmp_path):
    p = observe(tmp_path, "--", sys.executable, "-c", "pass")
    assert p.returncode == 0
    assert "no cudaMalloc/cudaFree(Async) call was seen" in p.stdout


@pytest.mark.parametrize("args, words", [([], "name the program"), (["--", "no-such-program-xyz"], "not found"),
                                         (["--", "/etc/passwd"], "cannot run"), (["--", "/"], "cannot run")])
def test_observe_usage_errors(tmp_path, args, words):
    p = observe(tmp_path, *args)
    assert p.returncode == 2
    assert words in p.stderr


def test_the_observer_never_writes_its_log_through_a_link(tmp_path, fake_cudart):
    """The preload library itself: a log path that is a link is refused, the program still runs."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "t.jsonl").symlink_to(victim)
    env = clean_env(LD_PRELOAD=memtide.preload_library_path(), MEMTIDE_PRELOAD_LOG=str(tmp_path / "t.jsonl"))
    p = subprocess.run([sys.executable, "-c", PROGRAM, fake_cudart, "0"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "symbolic link" in p.stderr
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("kind", ["link", "fifo", "dir"])
def test_observe_refuses_a_log_path_that_is_not_a_regular_file(tmp_path, kind):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    log = tmp_path / "t.jsonl"
    {"link": lambda: log.symlink_to(victim), "fifo": lambda: os.mkfifo(log), "dir": lambda: log.mkdir()}[kind]()
    p = observe(tmp_path, "--log", str(log), "--", sys.executable, "-c", "pass")
    assert p.returncode == 2 and "not a regular file" in p.stderr and "Traceback" not in p.stderr
    assert os.path.lexists(log) and victim.read_text() == "precious"


def test_observe_with_an_empty_log_name_is_a_usage_error(tmp_path):
    p = observe(tmp_path, "--log", "", "--", sys.executable, "-c", "pass")
    assert p.returncode == 2 and "--log" in p.stderr and "Traceback" not in p.stderr


DIES = PROGRAM.replace("sys.exit(int(sys.argv[2]))", "import os\nos.abort() if sys.argv[2] == 'abort' else os._exit(5)")


@pytest.mark.parametrize("how", ["abort", "_exit"])
def test_events_survive_a_program_that_dies_and_the_log_says_it_is_incomplete(tmp_path, fake_cudart, how):
    p = observe(tmp_path, "--json", "--log", "t.jsonl", "--", sys.executable, "-c", DIES, fake_cudart, how)
    assert p.returncode != 0  # the program's own exit status
    s = json.loads(p.stdout)
    assert s["events"] == 3  # nothing was buffered away
    assert s["peak_bytes"] == 96 << 20
    assert not s["complete"] and "wrote no summary" in s["problems"][0]
    assert "incomplete timeline" in p.stderr


def test_a_cut_last_line_is_reported_not_fatal(tmp_path, fake_cudart):
    from memtide.cli.observe import _read_timeline

    p = observe(tmp_path, "--log", "t.jsonl", "--", sys.executable, "-c", PROGRAM, fake_cudart, "0")
    assert p.returncode == 0
    log = tmp_path / "t.jsonl"
    whole = log.read_text()
    log.write_text(whole[: whole.rindex("{") + 20])  # the summary line cut short
    s = _read_timeline(str(log))
    assert s["events"] == 3 and not s["complete"]
    assert any("cut short" in problem for problem in s["problems"])


def test_observe_names_a_log_folder_it_cannot_write(tmp_path):
    p = observe(tmp_path, "--log", str(tmp_path / "no-such-dir" / "t.jsonl"), "--", sys.executable, "-c", "pass")
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr


def test_observe_timeline_draws_the_programs_memory(tmp_path, fake_cudart):
    from memtide import _timeline as timeline

    p = observe(tmp_path, "--log", "t.jsonl", "--timeline", "obs.html", "--", sys.executable, "-c", PROGRAM,
                fake_cudart, "0")
    assert p.returncode == 0, p.stderr
    header, events = timeline.read_trace(str(tmp_path / "obs.trace.jsonl"))
    events = list(events)
    assert header["source"] == "memtide observe"
    assert [e["type"] for e in events if e["type"] in ("alloc", "free")] == ["alloc", "alloc", "free"]
    assert [e["allocated"] for e in events if e["type"] == "memory"] == [64 << 20, 96 << 20, 32 << 20]
    doc = (tmp_path / "obs.html").read_text()
    assert doc.count("<polyline") == 2 and "96.0 MiB" in doc


def test_observe_never_deletes_a_file_at_log_that_is_not_its_own(tmp_path):
    """`--log prog.py -- python prog.py` used to delete prog.py before running it."""
    prog = tmp_path / "prog.py"
    prog.write_text("print('hello')\n")
    p = observe(tmp_path, "--log", "prog.py", "--", sys.executable, "prog.py")
    assert p.returncode == 2 and "--log" in p.stderr and "not a memtide observe log" in p.stderr, p.stderr
    assert prog.read_text() == "print('hello')\n" and "Traceback" not in p.stderr


def test_observe_replaces_its_own_log_and_appends_to_an_empty_file(tmp_path, fake_cudart):
    for _ in range(2):
        p = observe(tmp_path, "--json", "--log", "t.jsonl", "--", sys.executable, "-c", PROGRAM, fake_cudart, "0")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["events"] == 3  # one run, one timeline
    (tmp_path / "empty.jsonl").write_text("")
    p = observe(tmp_path, "--json", "--log", "empty.jsonl", "--", sys.executable, "-c", PROGRAM, fake_cudart, "0")
    assert p.returncode == 0 and json.loads(p.stdout)["events"] == 3, p.stderr


def test_observe_refuses_a_log_that_its_timeline_would_write_over(tmp_path):
    p = observe(tmp_path, "--log", "r.trace.jsonl", "--timeline", "r.html", "--", sys.executable, "-c", "pass")
    assert p.returncode == 2 and "--log" in p.stderr and "--timeline" in p.stderr, p.stderr


@pytest.mark.parametrize("sig, code", [("SIGSEGV", 139), ("SIGABRT", 134), ("SIGKILL", 137)])
def test_a_program_killed_by_a_signal_exits_128_plus_the_signal(tmp_path, sig, code):
    p = observe(tmp_path, "--", sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), signal.{sig})")
    assert p.returncode == code, p.stderr
    assert sig in p.stderr  # said in words too


def test_what_is_still_allocated_is_read_from_the_logs_final_state(tmp_path, fake_cudart):
    """A process that aborts writes no summary line; its last event still says what it held."""
    p = observe(tmp_path, "--json", "--log", "t.jsonl", "--", sys.executable, "-c", DIES, fake_cudart, "abort")
    s = json.loads(p.stdout)
    assert s["current_bytes"] == 32 << 20
    q = observe(tmp_path, "--log", "t.jsonl", "--", sys.executable, "-c", DIES, fake_cudart, "abort")
    assert "32.00 MiB still allocated" in q.stdout


WAITS = PROGRAM.replace("sys.exit(int(sys.argv[2]))", """import time
print("ready", flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("child: interrupted", flush=True)
    sys.exit(3)
""")


def test_ctrl_c_is_passed_on_and_what_was_observed_is_kept(tmp_path, fake_cudart):
    import signal

    p = subprocess.Popen([sys.executable, "-m", "memtide.cli", "observe", "--log", "t.jsonl", "--timeline", "obs.html",
                          "--", sys.executable, "-c", WAITS, fake_cudart, "0"], cwd=tmp_path, env=clean_env(),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=default_signals)
    try:
        assert p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGINT)  # to memtide alone, as `kill -INT` would: it passes it on
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "child: interrupted" in out and "Traceback" not in err
    assert "interrupted" in err
    assert "96.00 MiB" in out  # the summary of what was observed
    assert (tmp_path / "obs.html").stat().st_size > 1000 and (tmp_path / "obs.trace.jsonl").exists()


def test_a_log_whose_first_line_nests_deeply_is_not_taken_for_an_observe_log(tmp_path):
    log = tmp_path / "t.jsonl"
    log.write_text("[" * 3000 + "]" * 3000 + "\n")
    p = observe(tmp_path, "--log", str(log), "--", sys.executable, "-c", "pass")
    assert p.returncode == 2 and "is not a memtide observe log" in p.stderr, p.stderr
    assert "recursion" not in p.stderr and "Traceback" not in p.stderr
    assert log.read_text().startswith("[[[")
