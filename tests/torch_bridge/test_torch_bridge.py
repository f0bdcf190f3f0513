"""The torch bridge: memtide as torch's own C++ CUDA allocator (torch_bridge/).

No GPU is needed: memtide runs on its simulated device, and the checks call torch's own entry
points (torch._C's allocator functions, which are what torch.cuda's Python functions call once
CUDA is up). Each case runs in a fresh interpreter: an allocator is chosen once per process.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import memtide  # noqa: E402
import memtide.torch_bridge as torch_bridge  # noqa: E402
from memtide_testing import clean_env, run_python  # noqa: E402

MiB = 1 << 20


def bridge_expected() -> bool:
    """The install must have built the bridge wherever memtide has CUDA and torch does."""
    return memtide.cuda_status()["compiled"] and torch.version.cuda is not None


def run(script: str, **env: str) -> dict:
    """Runs `script` (which prints one JSON line last) in a fresh interpreter on the sim device,
    with torch's default segment policy (expandable segments off) unless `env` says otherwise."""
    env.setdefault("MEMTIDE_EXPANDABLE_SEGMENTS", "false")
    p = run_python(["-c", script], env=clean_env(MEMTIDE_DEVICE="sim", **env))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_bridge_is_built_against_this_torch():
    status = torch_bridge.build_status()
    if not bridge_expected():
        pytest.skip(f"memtide or torch without CUDA here: {status}")
    assert status == f"built against torch {torch.__version__}", status


@pytest.fixture
def need_bridge():
    if not bridge_expected():
        pytest.skip("the bridge needs memtide and torch with CUDA")


PRELUDE = """
import json, torch, memtide, memtide.torch_bridge as tb
C = torch._C
chosen = memtide.use_with_torch()
out = {"chosen": chosen}
"""


def test_use_with_torch_installs_the_bridge(need_bridge):
    r = run(PRELUDE + """
out["active"] = tb.load().memtide_torch_bridge_active()
out["installed"] = memtide.torch_allocator_installed()
out["again"] = memtide.use_with_torch()["path"]
print(json.dumps(out))
""")
    assert r["chosen"]["path"] == "bridge", r
    assert r["active"] == 1 and r["installed"] and r["again"] == "bridge"


def test_allocation_stats_and_peaks_under_torchs_names(need_bridge):
    r = run(PRELUDE + f"""
a = C._cuda_cudaCachingAllocator_raw_alloc(3 * {MiB}, 0)
b = C._cuda_cudaCachingAllocator_raw_alloc(5000, 0)
during = C._cuda_memoryStats(0)
C._cuda_cudaCachingAllocator_raw_delete(b)
C._cuda_resetPeakMemoryStats(0)
after = C._cuda_memoryStats(0)
mine = memtide.stats(0)
C._cuda_cudaCachingAllocator_raw_delete(a)
out.update(during=during, after=after, mine=mine, end=C._cuda_memoryStats(0))
print(json.dumps(out))
""")
    during, after, mine, end = r["during"], r["after"], r["mine"], r["end"]
    # torch's nested names, with memtide's values (5000 B rounds to 5120).
    assert during["allocated_bytes"]["all"]["current"] == 3 * MiB + 5120
    assert during["allocation"]["all"]["current"] == 2
    assert during["requested_bytes"]["all"]["current"] == 3 * MiB + 5000
    assert during["allocated_bytes"]["small_pool"]["current"] == 5120
    assert during["reserved_bytes"]["all"]["current"] == 2 * MiB + 20 * MiB
    assert during["segment"]["large_pool"]["current"] == 1
    # reset_peak_memory_stats reached memtide: the peak fell to the current value.
    assert after["allocated_bytes"]["all"]["peak"] == after["allocated_bytes"]["all"]["current"] == 3 * MiB
    assert mine["allocated_bytes.all.peak"] == 3 * MiB
    assert end["allocated_bytes"]["all"]["current"] == 0
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                "active_bytes", "inactive_split", "inactive_split_bytes", "max_split_size"):
        assert key in during, key


def test_out_of_memory_is_torch_out_of_memory_error_and_the_allocator_goes_on(need_bridge):
    r = run(PRELUDE + f"""
keep = C._cuda_cudaCachingAllocator_raw_alloc(40 * {MiB}, 0)
try:
    C._cuda_cudaCachingAllocator_raw_alloc(30 * {MiB}, 0)
    out["raised"] = None
except Exception as e:
    out["raised"] = type(e).__module__ + "." + type(e).__qualname__
    out["is_oom"] = isinstance(e, torch.OutOfMemoryError)
    out["message"] = str(e)
C._cuda_cudaCachingAllocator_raw_delete(keep)
again = C._cuda_cudaCachingAllocator_raw_alloc(30 * {MiB}, 0)  # fits now
C._cuda_cudaCachingAllocator_raw_delete(again)
out["num_ooms"] = C._cuda_memoryStats(0)["num_ooms"]
print(json.dumps(out))
""", MEMTIDE_MAX_BYTES="64MiB")
    assert r["is_oom"], r["raised"]
    msg = r["message"]
    for part in ("tried to allocate 30.00 MiB", "Limit 64.00 MiB", "allocated 40.00 MiB", "reserved 40.00 MiB",
                 "device free", "Current phase: other", "on loan to tiering"):
        assert part in msg, (part, msg)
    assert r["num_ooms"] == 1


def test_hooks_reach_memtide(need_bridge):
    r = run(PRELUDE + f"""
p = C._cuda_cudaCachingAllocator_raw_alloc(12 * {MiB}, 0)
C._cuda_cudaCachingAllocator_raw_delete(p)
out["reserved_before"] = memtide.stats(0)["reserved_bytes.all.current"]
C._cuda_emptyCache()
out["reserved_after"] = memtide.stats(0)["reserved_bytes.all.current"]
C._cuda_setMemoryFraction(0.25, 0)
out["fraction"] = C._cuda_getMemoryFraction(0)
try:
    C._cuda_cudaCachingAllocator_raw_alloc(30 << 30, 0)  # over a quarter of the 80 GiB device
except torch.OutOfMemoryError as e:
    out["limit_in_message"] = "Limit 20.00 GiB" in str(e)
# Graph pools: what torch.cuda.graph and MemPool call.
C._cuda_beginAllocateCurrentThreadToPool(0, (5, 0))
q = C._cuda_cudaCachingAllocator_raw_alloc({MiB}, 0)
C._cuda_endAllocateToPool(0, (5, 0))
snap = torch.cuda.memory._snapshot()
out["pools"] = sorted({{tuple(s["segment_pool_id"]) for s in snap["segments"]}})
C._cuda_cudaCachingAllocator_raw_delete(q)
C._cuda_releasePool(0, (5, 0))
C._cuda_emptyCache()
out["reserved_released"] = memtide.stats(0)["reserved_bytes.all.current"]
out["selfcheck"] = tb.selfcheck()
print(json.dumps(out))
""")
    assert r["reserved_before"] == 12 * MiB and r["reserved_after"] == 0
    assert r["fraction"] == 0.25 and r["limit_in_message"]
    assert r["pools"] == [[5, 0]]
    assert r["reserved_released"] == 0
    check = r["selfcheck"]
    assert check["name"] == "memtide"
    assert check["base"] == check["ptr"] and check["segment_bytes"] == 20 * MiB
    assert check["largest_free"] >= 17 * MiB
    # record_stream reached memtide: the freed block stays active until the side stream is done.
    assert check["allocated_bytes_after_free"] == 0
    assert check["active_bytes_after_free"] == 3 * MiB


def test_snapshot_and_dump_through_torch(need_bridge, tmp_path):
    path = tmp_path / "snap.pickle"
    r = run(PRELUDE + f"""
p = C._cuda_cudaCachingAllocator_raw_alloc(2 * {MiB}, 0)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._dump_snapshot({str(path)!r})
C._cuda_cudaCachingAllocator_raw_delete(p)
seg = snap["segments"][0]
out.update(segments=len(snap["segments"]), blocks=seg["blocks"], total=seg["total_size"],
           actions=[e["action"] for e in snap["device_traces"][0]])
print(json.dumps(out))
""", MEMTIDE_RECORD_HISTORY="1")
    assert r["segments"] == 1 and r["total"] == 20 * MiB
    assert r["blocks"][0]["state"] == "active_allocated" and r["blocks"][0]["size"] == 2 * MiB
    assert r["actions"] == ["segment_alloc", "alloc"]
    # torch's own viewer code reads the file memtide's allocator produced through torch.
    from torch.cuda import _memory_viz

    import pickle

    with open(path, "rb") as f:
        dumped = pickle.load(f)
    assert "segments" in _memory_viz.segsum(dumped)


def test_expandable_segments_show_in_torchs_snapshot(need_bridge):
    r = run(PRELUDE + f"""
a = C._cuda_cudaCachingAllocator_raw_alloc(3 * {MiB}, 0)
b = C._cuda_cudaCachingAllocator_raw_alloc(5 * {MiB}, 0)
snap = torch.cuda.memory._snapshot()
stats = C._cuda_memoryStats(0)
C._cuda_cudaCachingAllocator_raw_delete(a)
C._cuda_cudaCachingAllocator_raw_delete(b)
C._cuda_emptyCache()
out.update(segments=[(s["is_expandable"], s["total_size"], len(s["blocks"])) for s in snap["segments"]],
           actions=[e["action"] for e in snap["device_traces"][0]], allocated=stats["allocated_bytes"]["all"]["current"],
           reserved=stats["reserved_bytes"]["all"]["current"], after=C._cuda_memoryStats(0)["reserved_bytes"]["all"]["current"])
print(json.dumps(out))
""", MEMTIDE_EXPANDABLE_SEGMENTS="true", MEMTIDE_RECORD_HISTORY="1")
    # One segment grown twice by 2 MiB granules: 3 MiB + 5 MiB in 8 MiB, nothing stranded.
    assert r["segments"] == [[True, 8 * MiB, 2]]
    assert r["actions"] == ["segment_map", "alloc", "segment_map", "alloc"]
    assert r["allocated"] == 8 * MiB and r["reserved"] == 8 * MiB and r["after"] == 0


def test_bridge_off_falls_back_to_pluggable_and_says_why():
    r = run(PRELUDE + """
out["status"] = tb.status()
print(json.dumps(out))
""", MEMTIDE_TORCH_BRIDGE="false")
    assert r["chosen"]["path"] == "pluggable"
    assert r["chosen"]["why"] == "MEMTIDE_TORCH_BRIDGE=false"


def test_missing_or_mismatched_bridge_falls_back(tmp_path, need_bridge):
    # A package whose bridge was built for another torch: the status file says so.
    script = PRELUDE.replace("chosen = memtide.use_with_torch()", """
import warnings
tb.build_status = lambda: "built against torch 0.0.1"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    chosen = memtide.use_with_torch()
""") + """
out["warned"] = [str(w.message) for w in caught]
print(json.dumps(out))
"""
    r = run(script)
    assert r["chosen"]["path"] == "pluggable"
    assert "built against torch 0.0.1, but torch" in r["chosen"]["why"]
    assert any("pluggable allocator" in w for w in r["warned"])


def test_info_reports_the_torch_path():
    p = run_python(["-c", "import memtide.cli, sys; sys.exit(memtide.cli.main([\"info\", \"--json\"]))"],
                   env=clean_env(MEMTIDE_DEVICE="sim"))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["torch_allocator"]["built"] == torch_bridge.build_status()
    expected = "would be the bridge" if bridge_expected() else "would be pluggable"
    assert info["torch_allocator"]["why"].startswith(expected), info["torch_allocator"]


def test_info_reports_how_the_optimizer_reads_its_params():
    from memtide.optim import torch_reads

    for env, expected in (({}, torch_reads.status()), ({"MEMTIDE_TORCH_READS": "false"}, "python: MEMTIDE_TORCH_READS=false")):
        p = run_python(["-c", "import memtide.cli, sys; sys.exit(memtide.cli.main([\"info\", \"--json\"]))"],
                       env=clean_env(MEMTIDE_DEVICE="sim", **env))
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["optimizer_reads"] == expected
