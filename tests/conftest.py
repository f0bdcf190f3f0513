"""Fixtures for the Python tests of the installed memtide package."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memtide_testing import SIZED_DEVICE, clean_env, run_python


@pytest.fixture
def cli():
    """Runs the memtide CLI (as `python -m memtide.cli`, which needs no PATH entry)."""

    def invoke(*args: str, **env: str) -> subprocess.CompletedProcess:
        return run_python(["-m", "memtide.cli", *args], env=clean_env(**env))

    return invoke


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A device mesh of this process alone (a gloo group of one rank), for DTensors."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "sized_device: run the test in a child process on a SimDevice of memtide_testing.SIZED_DEVICE "
        "(the runtime reads its device settings once per process)")


def pytest_pyfunc_call(pyfuncitem):
    """A `sized_device` test runs in a child pytest whose runtime has the sized SimDevice, unless
    this process is that child."""
    if pyfuncitem.get_closest_marker("sized_device") is None:
        return None
    if all(os.environ.get(k) == v for k, v in SIZED_DEVICE.items()):
        return None  # the child: run it here
    root = str(pyfuncitem.config.rootpath)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", pyfuncitem.nodeid],
                       cwd=root, env=clean_env(**SIZED_DEVICE), capture_output=True, text=True, timeout=900)
    out = p.stdout[-6000:] + p.stderr[-2000:]
    if p.returncode != 0:
        pytest.fail(f"on the sized SimDevice ({SIZED_DEVICE}):\n{out}", pytrace=False)
    if "1 passed" not in (p.stdout.strip().splitlines() or [""])[-1]:
        pytest.skip(f"on the sized SimDevice it did not run:\n{out}")
    return True
