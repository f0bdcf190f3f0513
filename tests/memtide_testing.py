"""Helpers shared by the Python tests of the installed memtide package."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

import pytest

#: The simulated device the `sized_device` tests run on (tests/conftest.py runs each in a child
#: process with these settings). 80 GiB holds the test models' whole state, so `auto` makes every
#: subgroup a GPU resident and never updates one on the CPU, streams one, or reads a spilled one;
#: with 1 MiB beyond the headroom margin the ~110k-param models' 1.8 MiB of state does not fit,
#: and `auto` mixes CPU, streamed and resident subgroups. The tests assert which ran.
SIZED_DEVICE = {"MEMTIDE_DEVICE": "sim", "MEMTIDE_SIM_CAPACITY": "257MiB", "MEMTIDE_HEADROOM_MARGIN": "256MiB"}

#: Marks a test (or a pytest.param) to run on the SIZED_DEVICE.
sized_device = pytest.mark.sized_device


def on_sized_device(policies: Sequence[str]) -> List:
    """`policies` for parametrize, with `auto` on the sized device (where its paths all run)."""
    return [pytest.param(p, marks=sized_device) if p == "auto" else p for p in policies]


def clean_env(**overrides: str) -> Dict[str, str]:
    """The environment without MEMTIDE_* settings, plus `overrides`.

    The runtime reads its options once per process, so scenarios that need their own settings run
    in a subprocess with an environment of their own.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTIDE_")}
    env.update(overrides)
    return env


def default_signals() -> None:
    """A child's preexec_fn for the tests that signal it: SIGINT, SIGTERM and SIGHUP at their
    defaults, as a fresh process has them. A test run started as `cmd &` ignores SIGINT, one under
    nohup SIGHUP; a child inherits that, Python then installs no KeyboardInterrupt handler, and
    memtide rightly leaves an ignored signal alone: the signal the test sends would do nothing."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def run_python(args: Sequence[str], env: Optional[Dict[str, str]] = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `python <args>` and captures text output."""
    return subprocess.run(
        [sys.executable, *args],
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def direct_io_dir(path):
    """`path` when its file system takes O_DIRECT (the NVMe tier's I/O), else the test is
    skipped (tmpfs has none)."""
    probe = os.path.join(path, "probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        pytest.skip(f"{path} has no direct I/O (tmpfs?)")
    os.close(fd)
    os.unlink(probe)
    return path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """torch on one thread for the module that imports this: bitwise comparisons need the same
    reduction order every run, and torch's OpenMP threads spin while they wait (a tiny model runs
    100x slower on a busy 2-core machine); memtide's kernel pool, which sleeps, still uses every core."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def same(a: Sequence, b: Sequence) -> bool:
    """Two lists of tensors are equal bit for bit."""
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def everything(model, opt) -> List:
    """Copies of the model's parameters and of every tensor in the optimizer's state dict."""
    import torch

    sd = opt.state_dict()
    state = [t.clone() for entry in sd["state"].values() for k, t in sorted(entry.items()) if torch.is_tensor(t)]
    return [p.detach().clone() for p in model.parameters()] + state


#: The two ways TieredAdamW's step reads its params (memtide.optim.torch_reads): for parametrize.
READ_PATHS = ["native", "python"]


def use_reads(monkeypatch, path: str) -> None:
    """Makes the optimizers built from now on read their params and hook their gradients natively
    ("native": skipped where that library was not built; test_torch_reads says whether it must be)
    or in Python ("python")."""
    from memtide.optim import torch_reads

    if path == "python":
        monkeypatch.setattr(torch_reads, "for_params", lambda params: None)
        monkeypatch.setattr(torch_reads, "library", lambda: None)
    elif torch_reads.status() != "native":
        pytest.skip(f"TieredAdamW reads in Python here: {torch_reads.status()}")
