"""examples/train_gpt_distributed.py under torchrun on CPU (gloo): FSDP2 and DDP against
torch.optim.AdamW, and two "nodes" through torchrun's c10d rendezvous against one node."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memtide_testing import clean_env

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt_distributed.py"


def _env() -> dict:
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"  # torchrun sets it only for several ranks per node: the same everywhere
    return env


def _torchrun(launch, args, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, str(EXAMPLE), *args], env=_env(),
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-4000:]
    return out


def _one_node(args, cwd) -> str:
    return _finish(_torchrun(["--standalone", "--nproc-per-node=2"], args, cwd))


def _diff(a: Path, b: Path) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(torch.load(a), torch.load(b)))


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_a_step_equals_torch_adamw_under_the_same_wrapper(wrap, tmp_path):
    # One step: after that, Adam's normalised update turns a last-bit difference in a near-zero
    # gradient into a difference of the order of lr, for either optimizer against itself alike.
    for opt in ("memtide", "torch"):
        _one_node(["--wrap", wrap, "--steps", "1", "--optimizer", opt, "--save", str(tmp_path / f"{opt}.pt")],
                  tmp_path)
    assert _diff(tmp_path / "memtide.pt", tmp_path / "torch.pt") <= 1e-6


def test_two_nodes_through_c10d_rendezvous_train_as_one_node_does(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--wrap", "fsdp2", "--steps", "6"]
    launch = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=memtide-test"]
    nodes = [_torchrun(launch, args + ["--save", str(tmp_path / "two.pt")], tmp_path) for _ in range(2)]
    printed = "".join(_finish(p) for p in nodes)
    one = _one_node(args + ["--save", str(tmp_path / "one.pt")], tmp_path)
    assert _diff(tmp_path / "two.pt", tmp_path / "one.pt") == 0.0
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", one)]
    assert losses[-1] < losses[0], one  # it learns
    assert re.findall(r"loss (\d+\.\d+)", printed) == re.findall(r"loss (\d+\.\d+)", one)
