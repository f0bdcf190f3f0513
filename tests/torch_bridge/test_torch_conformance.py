"""Allocator conformance: the same tensor operations under torch's native allocator and under
memtide (the bridge), side by side, compared (torch_conformance.py does one side).

Every check needs a CUDA GPU, so without one the suite skips, saying so; what can be checked
without a device (torch's stats names and meanings, torch.OutOfMemoryError, the hooks reaching
memtide, snapshots) is in test_torch_bridge.py, on the simulated device.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from memtide_testing import clean_env, run_python  # noqa: E402

gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: each check runs tensor operations on the device under both allocators "
           "(the no-device checks are in test_torch_bridge.py)")

WORKLOAD = os.path.join(os.path.dirname(__file__), "torch_conformance.py")
MiB = 1 << 20


@pytest.fixture(scope="module")
def sides():
    out = {}
    for allocator in ("native", "memtide"):
        p = run_python([WORKLOAD, allocator], env=clean_env(), timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        out[allocator] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def both(sides, check):
    native, memtide = sides["native"][check], sides["memtide"][check]
    assert "error" not in native, native
    assert "error" not in memtide, memtide
    return native, memtide


@gpu
def test_memtide_side_ran_on_the_bridge(sides):
    assert sides["memtide"]["path"] == "bridge"


@gpu
def test_stats_keys_and_meaning(sides):
    native, memtide = both(sides, "stats")
    assert memtide["keys"] == native["keys"]
    for key in ("allocated", "requested", "allocations", "small_pool_allocated", "allocated_after_free"):
        assert memtide[key] == native[key], key
    assert memtide["allocated"] == 3 * MiB + 5120
    for key in ("peak_is_current_after_reset", "memory_allocated_agrees", "max_reserved_agrees"):
        assert memtide[key] and native[key], key


@gpu
def test_out_of_memory_exception(sides):
    native, memtide = both(sides, "out_of_memory")
    assert native["is_torch_oom"] and memtide["is_torch_oom"], (native, memtide)
    assert memtide["raised"] == native["raised"]
    assert memtide["works_after"] == native["works_after"] == 10.0
    assert memtide["num_ooms"] == native["num_ooms"] == 1


@gpu
def test_record_stream_holds_the_block_until_the_side_stream_is_done(sides):
    native, memtide = both(sides, "record_stream")
    assert memtide["side_stream_was_busy"], "the side stream finished before the check; the test proves nothing"
    assert not native["reused_while_busy"]
    assert not memtide["reused_while_busy"]


@gpu
def test_empty_cache_releases(sides):
    native, memtide = both(sides, "empty_cache")
    assert native["released_at_least_256MiB"] and memtide["released_at_least_256MiB"]


@gpu
def test_cuda_graph_capture_and_replay(sides):
    native, memtide = both(sides, "cuda_graph")
    assert native["replay_correct"] and memtide["replay_correct"]
    assert memtide["private_pool_segments"] == native["private_pool_segments"] is True


@gpu
def test_cudnn_benchmark(sides):
    native, memtide = both(sides, "cudnn_benchmark")
    assert memtide["shape"] == native["shape"] == [8, 32, 64, 64]


@gpu
def test_two_process_ddp_step(sides):
    native, memtide = both(sides, "ddp")
    assert memtide["paths"] == ["bridge", "bridge"]
    assert len(set(native["checksums"])) == 1 and len(set(memtide["checksums"])) == 1
    assert memtide["checksums"][0] == pytest.approx(native["checksums"][0], rel=1e-6)


def test_workload_runs_or_says_it_needs_a_gpu():
    p = run_python([WORKLOAD, "memtide", "--only", "empty_cache"], env=clean_env())
    if torch.cuda.is_available():
        assert p.returncode == 0, p.stderr
        assert "empty_cache" in json.loads(p.stdout.strip().splitlines()[-1])
    else:
        assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr, p.stderr
