"""memtide as torch's CUDA allocator through CUDAPluggableAllocator (the fallback when the
bridge of test_torch_bridge.py cannot be used; MEMTIDE_TORCH_BRIDGE=false chooses it).

Each case runs in a fresh interpreter: torch only accepts a new allocator before CUDA's first
allocation, and the test process may already have touched CUDA.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from memtide_testing import clean_env, run_python  # noqa: E402

MARKER = "MEMTIDE-ALLOCATOR-INSTALLED"

INSTALL = f"""
import torch, memtide
assert not torch.cuda.is_initialized()
alloc = torch.cuda.memory.CUDAPluggableAllocator(memtide.library_path(), "memtide_malloc", "memtide_free")
torch.cuda.memory.change_current_allocator(alloc)
print({MARKER!r})
"""

USE_WITH_TORCH = f"""
import os
os.environ["MEMTIDE_TORCH_BRIDGE"] = "false"
import torch, memtide
chosen = memtide.use_with_torch()
assert chosen["path"] == "pluggable", chosen
print({MARKER!r})
"""

# Allocates real tensors through memtide and reports memtide's own counters around them.
ALLOCATE = f"""
import json, sys
import torch, memtide
if memtide.backend() != "cuda":
    print(json.dumps({{"skip": "memtide runs on " + memtide.backend() + " (built without CUDA?)"}}))
    sys.exit(0)
memtide.use_with_torch()
print({MARKER!r})
key = "allocated_bytes.all.current"
before = memtide.stats(0)[key]
x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
y = torch.empty((1024, 1024), dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
during = memtide.stats(0)
del x, y
torch.cuda.synchronize()
after = memtide.stats(0)[key]
print(json.dumps({{"before": before, "during": during[key], "after": after,
                  "allocations": during["allocation.all.current"], "sum": float(torch.ones(10, device="cuda").sum())}}))
"""


@pytest.mark.parametrize("script", [INSTALL, USE_WITH_TORCH], ids=["CUDAPluggableAllocator", "use_with_torch"])
def test_change_current_allocator(script):
    # Needs no GPU: torch swaps allocators before CUDA is initialized.
    p = run_python(["-c", script], env=clean_env())
    assert p.returncode == 0, p.stderr
    assert MARKER in p.stdout.splitlines()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bridge", ["true", "false"], ids=["bridge", "pluggable"])
def test_tensors_are_allocated_by_memtide(bridge):
    p = run_python(["-c", ALLOCATE], env=clean_env(MEMTIDE_TORCH_BRIDGE=bridge))
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert MARKER in p.stdout.splitlines()
    assert report["during"] >= report["before"] + (64 << 20) + (4 << 20)
    assert report["allocations"] >= 2
    assert report["after"] < report["during"]
    assert report["sum"] == 10.0
