"""Snapshots written through the C ABI are valid memory_viz pickles.

The scenario runs in a subprocess: the runtime is a process singleton that reads its options once,
and these tests need MEMTIDE_DEVICE=sim (and a small trace ring for the wrapped case).
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List

import pytest

import memtide

from memtide_testing import clean_env, run_python

STATES = {"active_allocated", "active_pending_free", "inactive"}
# segment_map / segment_unmap: an expandable segment grew or shrank (its size, not its existence).
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap",
           "oom", "snapshot"}

# Allocates through memtide_malloc, frees some, empties the cache, allocates again and dumps a
# snapshot. Prints the pointers still live, so the test can match them against the snapshot.
SCENARIO = r"""
import ctypes, json, sys

lib = ctypes.CDLL(sys.argv[1])
lib.memtide_malloc.restype = ctypes.c_void_p
lib.memtide_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.memtide_free.restype = None
lib.memtide_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.memtide_record_history.argtypes = [ctypes.c_int]
lib.memtide_dump_snapshot.argtypes = [ctypes.c_char_p]
lib.memtide_last_error.restype = ctypes.c_char_p
lib.memtide_backend.restype = ctypes.c_char_p
lib.memtide_empty_cache.restype = None

def check(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed ({rc}): {lib.memtide_last_error().decode()}")

check(lib.memtide_record_history(1), "memtide_record_history")
live = {}

def alloc(n):
    p = lib.memtide_malloc(n, 0, None)
    if not p:
        sys.exit(f"memtide_malloc({n}) failed: {lib.memtide_last_error().decode()}")
    live[p] = n

def free(p):
    lib.memtide_free(p, live.pop(p), 0, None)

# Small-pool and large-pool requests, and one bigger than a large segment.
for n in [512, 4096, 100, 700_000, 1 << 20, 3 << 20, 9 << 20, 25 << 20, 64, 1 << 16]:
    alloc(n)
for p, n in list(live.items()):
    if n in (512, 100, 1 << 20, 9 << 20, 25 << 20):
        free(p)
lib.memtide_empty_cache()  # the 25 MiB segment is now free and goes back: a segment_free entry
for n in [2048, 5 << 20, 300]:
    alloc(n)
free(next(iter(live)))
check(lib.memtide_dump_snapshot(sys.argv[2].encode()), "memtide_dump_snapshot")
print(json.dumps({"backend": lib.memtide_backend().decode(), "live": {str(p): n for p, n in live.items()}}))
"""


def run_scenario(tmp_path: Path, **env: str) -> Dict[str, Any]:
    path = tmp_path / "snapshot.pickle"
    p = run_python(["-c", SCENARIO, memtide.library_path(), str(path)],
                   env=clean_env(MEMTIDE_DEVICE="sim", **env))
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["backend"] == "sim"
    with path.open("rb") as f:
        result["snapshot"] = pickle.load(f)
    assert not Path(str(path) + ".tmp").exists()
    return result


def check_snapshot(snap: Dict[str, Any]) -> None:
    """The invariants a viewer relies on (a Python twin of memtide::validate_snapshot)."""
    assert {"segments", "device_traces"} <= set(snap)
    live_blocks: Dict[int, set] = defaultdict(set)
    live_segments: Dict[int, set] = defaultdict(set)
    for seg in snap["segments"]:
        dev, start, total = seg["device"], seg["address"], seg["total_size"]
        assert seg["segment_type"] in ("small", "large")
        assert total > 0 and seg["blocks"], seg
        cursor = start
        for b in seg["blocks"]:
            assert b["address"] == cursor, f"segment {start:#x}: block at {b['address']:#x}, expected {cursor:#x}"
            assert b["size"] > 0
            assert b["state"] in STATES, b["state"]
            assert 0 <= b["requested_size"] <= b["size"]
            cursor += b["size"]
            if b["state"] != "inactive":
                live_blocks[dev].add(b["address"])
        assert cursor == start + total, f"segment {start:#x}: blocks cover {cursor - start} of {total} bytes"
        allocated = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        active = sum(b["size"] for b in seg["blocks"] if b["state"] != "inactive")
        assert seg["allocated_size"] == allocated
        assert seg["active_size"] == active
        assert start not in live_segments[dev], "two segments at one address"
        live_segments[dev].add(start)

    # Walk each device's trace backwards from the final state: every event must be possible given
    # the state just after it. A wrapped (ring-buffer) trace starts mid-run and still passes.
    for dev, trace in enumerate(snap["device_traces"]):
        blocks, segments = set(live_blocks[dev]), set(live_segments[dev])
        times = [e["time_us"] for e in trace]
        assert times == sorted(times), "trace timestamps go backwards"
        for e in reversed(trace):
            action, addr = e["action"], e["addr"]
            assert action in ACTIONS, action
            where = f"device {dev}: {action} at {addr:#x}"
            if action == "alloc":
                assert addr in blocks, f"{where} of a block that is not live after it"
                blocks.discard(addr)
            elif action == "free_requested":
                assert addr in blocks, f"{where} of a block that is not active after it"
            elif action == "free_completed":
                assert addr not in blocks, f"{where} of a block that is live after it"
                blocks.add(addr)
            elif action == "segment_alloc":
                assert addr in segments, f"{where} of a segment that does not exist after it"
                segments.discard(addr)
            elif action == "segment_free":
                assert addr not in segments, f"{where} of a segment that exists after it"
                segments.add(addr)


def allocated_blocks(snap: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    return {b["address"]: b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}


def test_snapshot_is_consistent(tmp_path):
    result = run_scenario(tmp_path)
    snap = result["snapshot"]
    check_snapshot(snap)
    # What the scenario still holds is exactly what the snapshot shows allocated.
    blocks = allocated_blocks(snap)
    assert {int(p) for p in result["live"]} == set(blocks)
    for p, n in result["live"].items():
        assert blocks[int(p)]["requested_size"] == n
    trace: List[Dict[str, Any]] = snap["device_traces"][0]
    actions = {e["action"] for e in trace}
    assert {"segment_alloc", "alloc", "free_requested", "free_completed"} <= actions
    assert actions & {"segment_free", "segment_unmap"}  # memory went back (an expandable segment unmaps)
    assert {seg["segment_type"] for seg in snap["segments"]} == {"small", "large"}


def test_wrapped_trace_is_consistent(tmp_path):
    snap = run_scenario(tmp_path, MEMTIDE_HISTORY_ENTRIES="7")["snapshot"]
    assert len(snap["device_traces"][0]) == 7
    check_snapshot(snap)


def test_checker_catches_corruption(tmp_path):
    snap = run_scenario(tmp_path)["snapshot"]
    check_snapshot(snap)
    free_block = next(b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "inactive")

    # An alloc as the last event of a block that is free at the end cannot be.
    bad_trace = pickle.loads(pickle.dumps(snap))
    bad_trace["device_traces"][0].append(dict(bad_trace["device_traces"][0][-1], action="alloc",
                                              addr=free_block["address"]))
    with pytest.raises(AssertionError, match="not live after it"):
        check_snapshot(bad_trace)

    # Overlapping blocks do not tile their segment.
    bad_tiling = pickle.loads(pickle.dumps(snap))
    seg = next(s for s in bad_tiling["segments"] if len(s["blocks"]) > 1)
    seg["blocks"][0]["size"] += 512
    with pytest.raises(AssertionError, match="expected"):
        check_snapshot(bad_tiling)


def test_torch_memory_viz_reads_memtide_snapshots(tmp_path):
    viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = run_scenario(tmp_path)["snapshot"]
    outputs = {}
    # segsum checks its own byte accounting; trace replays the events in text form; the plots
    # embed the snapshot for the HTML viewer. Not every torch version has all of them.
    for name in ("segsum", "trace", "trace_plot", "segment_plot"):
        fn = getattr(viz, name, None)
        if fn is not None:
            outputs[name] = fn(snap)
    assert outputs, "torch.cuda._memory_viz has none of segsum, trace, trace_plot, segment_plot"
    for name, out in outputs.items():
        assert isinstance(out, str) and out.strip(), name
    if "trace" in outputs:
        assert "cudaMalloc" in outputs["trace"]
    if "segsum" in outputs:
        assert f"segments: {len(snap['segments'])}" in outputs["segsum"]


def test_dump_snapshot_writes_only_its_own_regular_file(tmp_path):
    """A snapshot is written under a fresh name beside the target and renamed over it: a link
    planted where the old fixed temp name was is not followed, a target that is a link or not a
    regular file is refused, the file is 0600, and nothing is left behind."""
    import os
    import stat

    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "snap.pickle"
    (tmp_path / "snap.pickle.tmp").symlink_to(victim)
    memtide.dump_snapshot(str(target))
    assert victim.read_text() == "precious"
    assert target.is_file() and not target.is_symlink()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    pickle.loads(target.read_bytes())  # a whole snapshot

    link = tmp_path / "link.pickle"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link"):
        memtide.dump_snapshot(str(link))
    assert link.is_symlink() and victim.read_text() == "precious"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        memtide.dump_snapshot(str(fifo))
    with pytest.raises(OSError, match="directory"):
        memtide.dump_snapshot(str(tmp_path))
    with pytest.raises(OSError, match="cannot create"):
        memtide.dump_snapshot(str(tmp_path / "missing" / "snap.pickle"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.pickle", "snap.pickle", "snap.pickle.tmp",
                                                          "victim"]
