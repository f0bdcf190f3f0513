"""A careless or hostile user of the Python API, the CLI and the environment: every bad input
gets an exception (or an exit status) whose message names it, nothing crashes or prints a
traceback, and memtide's state is the same afterwards. The C ABI's walk is in
test_hostile_inputs.py; docs/robustness.md lists what is promised."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memtide_testing import clean_env, run_python

# Runs in a fresh process on the simulated device, so that the runtime's state is this walk's.
WALK = r"""
import json, os, sys, tempfile
import memtide, memtide.host as host

def state():
    return {"device": memtide.stats(), "host": {k: v for k, v in host.stats().items() if "seconds" not in k},
            "options": memtide.options()}

tmp = tempfile.mkdtemp()
keep = host.empty((1024,))            # state worth keeping: a live host buffer
p8, g4, m8, v8 = host.empty((8,)), host.empty((4,)), host.empty((8,)), host.empty((8,))
before = state()
results = []

def case(name, call, words):
    try:
        call()
        kind, message = None, ""
    except BaseException as e:  # what escapes to the user, whatever it is
        kind, message = type(e).__name__, str(e)
    results.append({"case": name, "kind": kind, "error": message, "words": words, "same": state() == before})

big = [1] * (memtide.MAX_SUBGROUPS + 1)
case("mark_phase of an unknown phase", lambda: memtide.mark_phase("sideways"), ["sideways"])
case("mark_phase of an empty name", lambda: memtide.mark_phase(""), ['""'])
case("mark_phase of a number", lambda: memtide.mark_phase(3), ["str"])
case("headroom of device 99", lambda: memtide.headroom(device=99), ["99"])
case("headroom until an unknown phase", lambda: memtide.headroom(until="later"), ["later"])
case("headroom with a negative margin", lambda: memtide.headroom(margin=-1), ["margin"])
case("stats of device -1", lambda: memtide.stats(-1), ["-1"])
case("reset_peak_stats of device 7", lambda: memtide.reset_peak_stats(7), ["7"])
case("phase_report of device 7", lambda: memtide.phase_report(7), ["7"])
case("dump_snapshot to an empty path", lambda: memtide.dump_snapshot(""), ["path"])
case("dump_snapshot into a missing folder", lambda: memtide.dump_snapshot(os.path.join(tmp, "no", "s.pickle")), ["no"])
case("dump_snapshot onto a folder", lambda: memtide.dump_snapshot(tmp), [os.path.basename(tmp)])
case("dump_snapshot onto a device node", lambda: memtide.dump_snapshot("/dev/null"), ["/dev/null"])
case("plan_update of no subgroups", lambda: memtide.plan_update([]), ["empty"])
case("plan_update of a zero subgroup", lambda: memtide.plan_update([10, 0]), ["[1]"])
case("plan_update of a negative subgroup", lambda: memtide.plan_update([-5]), ["-5"])
case("plan_update of too many subgroups", lambda: memtide.plan_update(big), [str(len(big))])
case("plan_update with an unknown policy", lambda: memtide.plan_update([10], policy="fast"), ["fast"])
case("plan_update with k below 1", lambda: memtide.plan_update([10], k=0.5), ["0.5"])
case("plan_update with a NaN k", lambda: memtide.plan_update([10], k=float("nan")), ["nan"])
case("plan_update with a static fraction of 2", lambda: memtide.plan_update([10], static_fraction=2.0), ["2"])
case("plan_update with a negative rate", lambda: memtide.plan_update([10], rates={"h2d_bytes_per_s": -1}), ["h2d_bytes_per_s"])
case("plan_update with an unknown rate", lambda: memtide.plan_update([10], rates={"warp_speed": 1}), ["warp_speed"])
case("plan_update with 0-byte params", lambda: memtide.plan_update([10], low_precision_bytes=0), ["low_precision_bytes"])
case("plan_update with -1 slots", lambda: memtide.plan_update([10], gpu_slot_limit=-1), ["-1"])
case("predict_update with an unknown letter", lambda: memtide.predict_update([10], "x"), ["x"])
case("predict_update with too few letters", lambda: memtide.predict_update([10, 10], "c"), ["1", "2"])
case("fit_gpu_budget with negative bytes", lambda: memtide.fit_gpu_budget([10], -1, 0), ["-1"])
case("topology from a missing file", lambda: memtide.topology(os.path.join(tmp, "none.xml")), ["none.xml"])
case("topology from a folder", lambda: memtide.topology(tmp), [os.path.basename(tmp)])
case("resolve_backend of junk", lambda: memtide.resolve_backend("warp"), ["warp"])
case("replay_transformer with 0 layers", lambda: memtide.replay_transformer(0, 64, 4, 16, 1, 100, 1), ["layers"])
case("replay_transformer with hidden not divisible by heads",
     lambda: memtide.replay_transformer(2, 65, 4, 16, 1, 100, 1), ["65"])
case("replay_transformer with an unknown backend",
     lambda: memtide.replay_transformer(2, 64, 4, 16, 1, 100, 1, backend="tpu"), ["tpu"])
case("host.empty with 129 dimensions", lambda: host.empty((1,) * 129), ["129"])
case("host.empty with a negative size", lambda: host.empty((-3,)), ["-3"])
case("host.empty of 2**62 elements", lambda: host.empty((2**62,)), ["bytes"])
case("host.empty of an unknown dtype", lambda: host.empty((4,), dtype="complex256"), ["complex256"])
case("host.empty on NUMA node 999", lambda: host.empty((4,), numa_node=999), ["999"])
case("host.placement of a foreign array", lambda: host.placement(bytearray(10)), ["host"])
case("adamw_step_cpu on arrays of different lengths",
     lambda: memtide.adamw_step_cpu(p8, g4, m8, v8, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1), ["grad"])
print(json.dumps(results))
"""


def test_the_python_api_refuses_every_bad_call_naming_it_and_changes_nothing():
    p = run_python(["-c", WALK], env=clean_env(MEMTIDE_DEVICE="sim", MEMTIDE_LOG_LEVEL="error"))
    assert p.returncode == 0, p.stderr[-3000:]  # no crash, no abort
    results = json.loads(p.stdout.strip().splitlines()[-1])
    clean = {"ValueError", "ConfigError", "TypeError", "OverflowError", "FileNotFoundError", "IsADirectoryError",
             "NotADirectoryError", "PermissionError", "OSError", "InvalidArgument", "OutOfMemory", "IndexError"}
    problems = []
    for r in results:
        if r["kind"] is None:
            problems.append(f"{r['case']}: accepted")
        elif r["kind"] not in clean:
            problems.append(f"{r['case']}: {r['kind']}: {r['error']}")
        missing = [w for w in r["words"] if w.lower() not in r["error"].lower()]
        if missing:
            problems.append(f"{r['case']}: error {r['error']!r} does not name {missing}")
        if not r["same"]:
            problems.append(f"{r['case']}: memtide's state changed")
    assert not problems, "\n".join(problems)


# ---- the CLI: an error that names the input, exit status 1 or 2, never a traceback ---------------

CLI_CASES = [
    (["plan", "--params", "abc"], ["abc"]),
    (["plan", "--params", "-5"], ["-5"]),
    (["plan", "--params", "1e30"], ["1e30"]),
    (["plan", "--params", "20B", "--subgroup-size", "0"], ["subgroup-size"]),
    (["plan", "--params", "20B", "--subgroup-size", "1000"], ["20000000 subgroups"]),
    (["plan", "--params", "1B", "--gpu-mem", "lots"], ["lots"]),
    (["plan", "--params", "1B", "--gpu-mem", "1e30"], ["1e30"]),
    (["plan", "--params", "1B", "--policy", "fastest"], ["fastest"]),
    (["plan", "--params", "1B", "--k", "0"], ["0"]),
    (["plan", "--params", "1B", "--h2d=-3GB/s"], ["-3"]),
    (["run", "--layers", "0"], ["layers"]),
    (["run", "--iterations", "-1"], ["-1"]),
    (["run", "--device", "tpu"], ["tpu"]),
    (["run", "--subgroup-size", "0"], ["subgroup"]),
    (["probe", "--topology", "/nonexistent/topo.xml"], ["/nonexistent/topo.xml"]),
    (["observe", "--log", "", "--", "true"], ["--log"]),
    (["observe", "--", "/etc/passwd"], ["/etc/passwd"]),
    (["observe", "--", "/no/such/program"], ["/no/such/program"]),
    (["observe"], ["program"]),
    (["frobnicate"], ["frobnicate"]),
]


@pytest.mark.parametrize("argv, words", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_the_cli_names_every_bad_argument_without_a_traceback(argv, words):
    p = subprocess.run([sys.executable, "-m", "memtide.cli", *argv], env=clean_env(MEMTIDE_DEVICE="sim"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (1, 2), (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    for word in words:
        assert word.lower() in p.stderr.lower(), (word, p.stderr)


# ---- every file the CLI reads: a FIFO is refused naming it, never waited on -----------------------

# {fifo}: a FIFO named like a trace; {pickle}: one named like a snapshot; {folder}: a folder whose
# only trace is a FIFO; {trace}: a real trace beside them. The FIFO named in the error is `named`.
FIFO_CASES = [
    (["timeline", "{fifo}"], "{fifo}"),
    (["timeline", "{pickle}"], "{pickle}"),
    (["timeline", "{folder}"], "{folder}/r.trace.jsonl"),
    (["timeline", "{folder}/*.trace.jsonl"], "{folder}/r.trace.jsonl"),
    (["timeline", "{trace}", "{fifo}"], "{fifo}"),  # the traces of a job's ranks
    (["probe", "--topology", "{fifo}"], "{fifo}"),
    (["simulate", "--topology", "{fifo}"], "{fifo}"),
    (["observe", "--log", "{fifo}", "--", "true"], "{fifo}"),
]


@pytest.mark.parametrize("argv, named", FIFO_CASES, ids=[" ".join(a) for a, _ in FIFO_CASES])
def test_a_fifo_given_as_any_file_the_cli_reads_is_refused_naming_it(tmp_path, argv, named):
    where = {"fifo": str(tmp_path / "t.trace.jsonl"), "pickle": str(tmp_path / "s.pickle"),
             "folder": str(tmp_path / "runs"), "trace": str(tmp_path / "a.trace.jsonl")}
    os.mkfifo(where["fifo"])
    os.mkfifo(where["pickle"])
    os.mkdir(where["folder"])
    os.mkfifo(os.path.join(where["folder"], "r.trace.jsonl"))
    with open(where["trace"], "w") as f:
        f.write(json.dumps({"memtide_trace": 1, "source": "test", "clock": "virtual", "rank": 0}) + "\n")
    # A reader that opened a FIFO would wait for a writer that never comes: the timeout fails it.
    p = subprocess.run([sys.executable, "-m", "memtide.cli", *[a.format(**where) for a in argv]],
                       env=clean_env(MEMTIDE_DEVICE="sim"), cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert named.format(**where) in p.stderr and "not a regular file" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_fifo_as_memtide_topology_is_refused_naming_it(tmp_path):
    fifo = str(tmp_path / "topo.xml")
    os.mkfifo(fifo)
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "probe"], env=clean_env(MEMTIDE_TOPOLOGY=fifo),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "MEMTIDE_TOPOLOGY" in p.stderr and fifo in p.stderr, p.stderr[-2000:]
    assert "not a regular file" in p.stderr and "Traceback" not in p.stderr


# ---- the environment: a bad MEMTIDE_* value stops the first use, naming it -------------------------

ENV_CASES = [
    ("MEMTIDE_DEVICE", "tpu"),
    ("MEMTIDE_MAX_BYTES", "lots"),
    ("MEMTIDE_MAX_BYTES", "-1GiB"),
    ("MEMTIDE_MEMORY_FRACTION", "1.5"),
    ("MEMTIDE_LOG_LEVEL", "loud"),
    ("MEMTIDE_HOST_NODE", "-7"),
    ("MEMTIDE_PINNED_HEAP_BACKEND", "tcmalloc"),
]


@pytest.mark.parametrize("name, value", ENV_CASES, ids=[f"{n}={v}" for n, v in ENV_CASES])
def test_a_bad_environment_variable_is_named_and_nothing_crashes(name, value):
    p = run_python(["-c", "import memtide; memtide.options(); memtide.stats()"],
                   env=clean_env(**{name: value}))
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])  # an exception, not a signal
    assert name in p.stderr and value in p.stderr, p.stderr[-2000:]
    assert "Fatal" not in p.stderr and "Aborted" not in p.stderr


@pytest.mark.parametrize("name, nearest", [("MEMTIDE_HOST_NUMA_NODE", "MEMTIDE_HOST_NODE"),
                                           ("MEMTIDE_MAX_BYTE", "MEMTIDE_MAX_BYTES"),
                                           ("MEMTIDE_NO_SUCH_THING", None)])
def test_a_variable_that_is_no_option_is_named_once_with_the_nearest_option(name, nearest):
    p = run_python(["-c", "import memtide; memtide.options(); memtide.options(); memtide.stats()"],
                   env=clean_env(**{name: "-7"}))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.count(f"{name} is not a memtide option") == 1, p.stderr[-2000:]
    if nearest:
        assert f"did you mean {nearest}?" in p.stderr, p.stderr[-2000:]


def test_a_topology_file_that_crashes_hwloc_is_an_error_without_a_crash_report():
    # The file is loaded in a forked child first; the child's death must not run the parent's
    # fatal-signal handlers (faulthandler here) nor print hwloc's complaints.
    corrupt = os.path.join(os.path.dirname(__file__), "..", "data", "topology", "corrupt_crashes_hwloc.xml")
    p = run_python(["-X", "faulthandler", "-c", f"import memtide; memtide.topology({corrupt!r})"],
                   env=clean_env(MEMTIDE_DEVICE="sim"))
    assert p.returncode == 1, p.stderr[-2000:]
    assert "corrupt_crashes_hwloc.xml" in p.stderr and "crash" in p.stderr
    assert "Fatal Python error" not in p.stderr and "Segmentation fault" not in p.stderr, p.stderr[-2000:]
