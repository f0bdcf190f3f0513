"""`memtide timeline snapshot.pickle`: torch's memory snapshots read offline, without running any
code a pickle carries; segments, allocations over time and the largest blocks at the peak drawn
and counted as the snapshot says."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys

import pytest

from memtide import _timeline as timeline
from memtide_testing import clean_env

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "snapshots")
COMMITTED = os.path.join(DATA, "torch_2_1_snapshot.pickle")


def _expected():
    spec = importlib.util.spec_from_file_location("make_torch_snapshot", os.path.join(DATA, "make_torch_snapshot.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli(*args):
    return subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", *args], env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def test_the_committed_snapshot_is_what_its_script_writes(tmp_path):
    mod = _expected()
    with open(COMMITTED, "rb") as f:
        assert pickle.load(f) == mod.build()


def test_an_older_torchs_snapshot_is_drawn_with_its_segments_and_peak(tmp_path):
    want = _expected().EXPECTED
    p = cli(COMMITTED, "-o", str(tmp_path / "s.html"), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    snap = out["snapshot"]
    assert snap["segments"] == want["segments"] and snap["reserved_bytes"] == want["reserved_bytes"]
    assert snap["allocated_bytes"] == want["allocated_bytes"] and snap["peak_allocated"] == want["peak_allocated"]
    assert snap["trace_entries"] == want["trace_entries"]
    assert out["memory_viz"] is None  # the input is one already
    doc = (tmp_path / "s.html").read_text()
    assert "<script" not in doc and "src=" not in doc and "href=" not in doc
    segments = doc.split('<svg id="segments"')[1].split("</svg>")[0]
    assert segments.count('class="segment"') == want["segments"]
    assert segments.count('class="block"') == 3  # the allocated blocks at the snapshot
    peak = doc.split("<table id='peak-blocks'>")[1].split("</table>")[0]
    assert peak.count("<tr>") == 1 + 4  # the four blocks live at the peak
    first = peak.split("<tr>")[2]
    assert "12.0 MiB" in first and "matmul_backward (train.py:10)" in first  # largest first, with its frames
    memory = doc.split('<svg id="memory"')[1].split("</svg>")[0]
    assert memory.count("<polyline") == 2
    # torch's own reader of the same pickle agrees on the segments and the totals.
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    with open(COMMITTED, "rb") as f:
        text = _memory_viz.segsum(pickle.load(f))
    assert f"segments: {want['segments']}" in text and "total_reserved: 42.0MiB" in text
    assert "total_allocated: 12.0MiB" in text


# memtide's allocator writes torch's snapshot format (memtide.dump_snapshot); its counters are
# torch's memory_stats names. In a process of its own, recording from the first allocation.
MEMTIDE_SNAPSHOT = r"""
import json, sys
import torch
import memtide
memtide.record_history(True)
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss
from memtide.optim import TieredAdamW
torch.manual_seed(0)
model = TinyGPT(128, 64, 4, 2, 32)
opt = TieredAdamW(model.parameters(), subgroup_size=10_000, policy="interleaved", k=2)
for i in range(2):
    x, y = arithmetic_batch(torch.Generator().manual_seed(i), 4, 32, 128)
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    opt.step()
memtide.dump_snapshot(sys.argv[1])
print(json.dumps(memtide.stats()))
"""


def test_a_snapshot_written_now_matches_the_allocators_own_stats(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "now.pickle"
    p = subprocess.run([sys.executable, "-c", MEMTIDE_SNAPSHOT, str(path)], env=clean_env(MEMTIDE_DEVICE="sim"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    stats = json.loads(p.stdout.splitlines()[-1])
    assert stats["allocated_bytes.all.peak"] > 0
    q = cli(str(path), "-o", str(tmp_path / "now.html"), "--json")
    assert q.returncode == 0, q.stderr
    snap = json.loads(q.stdout)["snapshot"]
    assert snap["segments"] == stats["segment.all.current"]
    assert snap["reserved_bytes"] == stats["reserved_bytes.all.current"]
    assert snap["allocated_bytes"] == stats["allocated_bytes.all.current"]
    assert snap["peak_allocated"] == stats["allocated_bytes.all.peak"]


def test_a_snapshot_torch_writes_on_this_gpu_matches_its_memory_stats(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.memory._snapshot needs a GPU (the committed snapshot covers the format)")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    torch.cuda.reset_peak_memory_stats()
    keep = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 3, 7)]
    gone = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    del gone
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._dump_snapshot(str(tmp_path / "gpu.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    q = cli(str(tmp_path / "gpu.pickle"), "-o", str(tmp_path / "gpu.html"), "--json")
    assert q.returncode == 0, q.stderr
    snap = json.loads(q.stdout)["snapshot"]
    assert snap["segments"] == stats["segment.all.current"]
    assert snap["reserved_bytes"] == stats["reserved_bytes.all.current"]
    assert snap["peak_allocated"] == stats["allocated_bytes.all.peak"]
    del keep


class _Shell:
    """Pickles as a call to os.system: loading it with pickle.load would run the command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Shell(marker)]]}, protocol=4))
    p = cli(str(path), "-o", str(tmp_path / "e.html"))
    assert p.returncode in (1, 2) and "evil.pickle" in p.stderr and "posix.system" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not marker.exists() and not (tmp_path / "e.html").exists()
    # The same file through pickle itself would have run it: the test's pickle is a real threat.
    pickle.loads(path.read_bytes())
    assert marker.exists()


@pytest.mark.parametrize("content, words", [
    (b"\x80\x04\x95", "is not a readable pickle"),  # cut short
    (pickle.dumps([1, 2, 3]), "expected a dict with 'segments'"),
    (pickle.dumps({1: 2, "a": 3}), "a dict without 'segments' (keys 'a', 1)"),  # keys that do not sort together
    (pickle.dumps({"segments": {"a": 1}}), "'segments' must be a list, got dict"),
    (pickle.dumps({"segments": [{"total_size": "big", "blocks": []}]}), "segments[0].total_size must be a whole number"),
    (pickle.dumps({"segments": [{"total_size": 4096, "blocks": [{"size": -1}]}]}), "segments[0].blocks[0].size"),
    (pickle.dumps({"segments": [], "device_traces": [[{"action": 3}]]}), "device_traces[0][0].action must be text"),
    (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": 8, "frames": [{"line": "x"}]}]]}),
     "device_traces[0][0].frames[0]"),
    (json.dumps({"memtide_trace": 1}).encode() + b"\n", "is a memtide trace (JSON Lines), not a pickle"),
])
def test_bad_snapshots_are_named(tmp_path, content, words):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(timeline.TraceError, match=str(path).replace("\\", "\\\\").replace(".", r"\.")):
        timeline.read_snapshot(str(path))
    try:
        timeline.read_snapshot(str(path))
    except timeline.TraceError as e:
        assert words in str(e), str(e)
    p = cli(str(path), "-o", str(tmp_path / "b.html"))
    assert p.returncode in (1, 2) and str(path) in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_memory_viz_output_is_refused_for_a_snapshot(tmp_path):
    p = cli(COMMITTED, "-o", str(tmp_path / "s.html"), "--memory-viz", str(tmp_path / "x.pickle"))
    assert p.returncode in (1, 2) and "--memory-viz" in p.stderr and "Traceback" not in p.stderr


_MARKER = "DEEP_VALUE_HERE"


def _with_deep_value(obj, depth: int = 100_000) -> bytes:
    """`obj` pickled with a list nested `depth` deep in place of the text _MARKER: built from
    opcodes (EMPTY_LIST `depth` times, then APPEND), as no pickler nests that deep."""
    import io

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.fast = True  # no memo: the marker's bytes stand alone
    pickler.dump(obj)
    marker = b"X" + len(_MARKER).to_bytes(4, "little") + _MARKER.encode()
    assert buf.getvalue().count(marker) == 1
    return buf.getvalue().replace(marker, b"]" * depth + b"a" * (depth - 1))


@pytest.mark.parametrize("snapshot", [
    {"segments": [{"total_size": _MARKER, "blocks": []}]},
    {"segments": [{"total_size": 4096, "blocks": [{"size": 8, "state": _MARKER}]}]},
    {"segments": [], "device_traces": [[{"action": _MARKER, "size": 8}]]},
    {"segments": [], "device_traces": [[{"action": "alloc", "size": 8, "frames": [{"name": _MARKER}]}]]},
    {"segments": [], "x": {"y": _MARKER}},
    {"segments": _MARKER},
], ids=["a size", "a state", "an action", "a frame", "a field not drawn", "the segments"])
def test_a_snapshot_nested_100000_deep_is_refused_naming_the_file(tmp_path, snapshot):
    path = tmp_path / "deep.pickle"
    path.write_bytes(_with_deep_value(snapshot))
    p = cli(str(path), "-o", str(tmp_path / "d.html"))
    if "x" in snapshot:  # nothing reads it: drawn as any snapshot without segments
        assert p.returncode == 0, p.stderr[-2000:]
        return
    assert p.returncode == 2 and str(path) in p.stderr, p.stderr[-2000:]
    assert "recursion" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "d.html").exists()
