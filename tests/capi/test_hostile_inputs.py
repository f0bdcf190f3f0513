"""A careless or hostile caller of the C ABI (as torch and C programs call it), in a fresh process:
every bad call returns an error (or null) with a message that names the bad input, nothing
crashes, and the allocator's state is the same afterwards. docs/robustness.md lists the rest."""

from __future__ import annotations

import json
import subprocess
import sys

import memtide
from memtide_testing import clean_env

WALK = r"""
import ctypes, json, sys

lib = ctypes.CDLL(sys.argv[1])
c_void_p, c_size_t, c_int, c_char_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
lib.memtide_malloc.restype = c_void_p
lib.memtide_malloc.argtypes = [c_size_t, c_int, c_void_p]
lib.memtide_free.argtypes = [c_void_p, c_size_t, c_int, c_void_p]
lib.memtide_free.restype = None
lib.memtide_record_stream.argtypes = [c_void_p, c_void_p]
lib.memtide_record_stream.restype = None
lib.memtide_set_memory_fraction.argtypes = [ctypes.c_double, c_int]
lib.memtide_set_memory_fraction.restype = None
lib.memtide_phase_mark.argtypes = [c_int]
lib.memtide_phase_mark_name.argtypes = [c_char_p]
lib.memtide_headroom.argtypes = [c_int, c_int, ctypes.POINTER(ctypes.c_uint64)]
lib.memtide_stat.argtypes = [c_int, c_char_p, ctypes.POINTER(ctypes.c_int64)]
lib.memtide_reset_peak_stats.argtypes = [c_int]
lib.memtide_dump_snapshot.argtypes = [c_char_p]
lib.memtide_grads_finite_cpu.argtypes = [c_void_p, c_int, c_size_t, ctypes.c_double, ctypes.c_double,
                                         ctypes.POINTER(c_int)]
lib.memtide_adamw_step_cpu.argtypes = [c_void_p, ctypes.POINTER(c_int)]
lib.memtide_host_alloc.restype = c_void_p
lib.memtide_host_alloc.argtypes = [c_size_t, c_int]
lib.memtide_host_free.argtypes = [c_void_p]
lib.memtide_last_error.restype = c_char_p

def err():
    return lib.memtide_last_error().decode(errors="replace")

def stat(name):
    v = ctypes.c_int64(-1)
    assert lib.memtide_stat(0, name.encode(), ctypes.byref(v)) == 0, err()
    return v.value

def state():
    return [stat(n) for n in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                              "allocation.all.current")]

results = []
live = lib.memtide_malloc(4096, 0, None)
before = state()

def case(name, call, words):
    out = call()
    results.append({"case": name, "rc": out, "error": err(), "words": words, "same": state() == before})

u64, i64, i32 = ctypes.c_uint64(), ctypes.c_int64(), c_int()
case("malloc on device 99", lambda: lib.memtide_malloc(4096, 99, None), ["99"])
case("malloc on device -1", lambda: lib.memtide_malloc(4096, -1, None), ["-1"])
case("malloc of 2^63 bytes", lambda: lib.memtide_malloc(1 << 63, 0, None), ["9223372036854775808"])
case("free of a stack address", lambda: lib.memtide_free(ctypes.addressof(i32), 4, 0, None), ["not allocated"])
case("free with the wrong size", lambda: lib.memtide_free(live, 1, 0, None), ["1 bytes"])
case("free on device 7", lambda: lib.memtide_free(live, 4096, 7, None), ["7"])
case("record_stream of an unknown pointer", lambda: lib.memtide_record_stream(16, None), ["not allocated"])
case("record_stream on an unknown stream", lambda: lib.memtide_record_stream(live, 0xbad), ["stream"])
case("memory fraction 0", lambda: lib.memtide_set_memory_fraction(0.0, 0), ["0"])
case("memory fraction NaN", lambda: lib.memtide_set_memory_fraction(float("nan"), 0), ["nan"])
case("memory fraction on device 5", lambda: lib.memtide_set_memory_fraction(0.5, 5), ["5"])
case("phase 42", lambda: lib.memtide_phase_mark(42), ["42"])
case("phase name null", lambda: lib.memtide_phase_mark_name(None), ["null"])
case("phase name junk", lambda: lib.memtide_phase_mark_name(b"\xff\xfe"), ["phase"])
case("headroom with a null out", lambda: lib.memtide_headroom(0, 0, None), ["null"])
case("headroom until phase 9", lambda: lib.memtide_headroom(0, 9, ctypes.byref(u64)), ["9"])
case("stat null name", lambda: lib.memtide_stat(0, None, ctypes.byref(i64)), ["null"])
case("stat on device 3", lambda: lib.memtide_stat(3, b"num_ooms", ctypes.byref(i64)), ["3"])
case("reset peaks on device -2", lambda: lib.memtide_reset_peak_stats(-2), ["-2"])
case("snapshot to null", lambda: lib.memtide_dump_snapshot(None), ["path"])
case("snapshot to an empty path", lambda: lib.memtide_dump_snapshot(b""), ["empty"])
case("snapshot to a directory", lambda: lib.memtide_dump_snapshot(b"/"), ["director"])
case("grads_finite of null", lambda: lib.memtide_grads_finite_cpu(None, 1, 8, 1.0, 1.0, ctypes.byref(i32)), ["null"])
case("grads_finite dtype 9", lambda: lib.memtide_grads_finite_cpu(ctypes.addressof(u64), 9, 1, 1.0, 1.0,
                                                                   ctypes.byref(i32)), ["9"])
case("adamw with null args", lambda: lib.memtide_adamw_step_cpu(None, None), ["null"])
case("host alloc of 0 bytes", lambda: lib.memtide_host_alloc(0, 0), ["zero"])
case("host alloc on device 12", lambda: lib.memtide_host_alloc(64, 12), ["12"])
case("host free of a foreign pointer", lambda: lib.memtide_host_free(ctypes.addressof(u64)), ["not"])
lib.memtide_free(live, 4096, 0, None)
results.append({"case": "the live block still frees", "rc": 0, "error": err() if stat("allocated_bytes.all.current") else "",
                "words": [], "same": True})
print(json.dumps(results))
"""


def test_the_c_abi_refuses_every_bad_call_naming_it_and_changes_nothing():
    # errors="replace": the log echoes the junk bytes a case passes, as it should.
    p = subprocess.run([sys.executable, "-c", WALK, memtide.library_path()],
                       env=clean_env(MEMTIDE_DEVICE="sim", MEMTIDE_LOG_LEVEL="error"), capture_output=True,
                       text=True, errors="replace", timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]  # no crash, no abort
    results = json.loads(p.stdout.strip().splitlines()[-1])
    problems = []
    for r in results:
        if r["rc"] not in (None, 0) and r["rc"] > 0 and r["case"] != "the live block still frees":
            problems.append(f"{r['case']}: returned {r['rc']}")  # pointers: null expected
        missing = [w for w in r["words"] if w.lower() not in r["error"].lower()]
        if r["words"] and missing:
            problems.append(f"{r['case']}: error {r['error']!r} does not name {missing}")
        if not r["same"]:
            problems.append(f"{r['case']}: the allocator's state changed")
    assert not problems, "\n".join(problems)
