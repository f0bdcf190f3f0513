"""TieredAdamW's state through torch's own checkpoints on many ranks (torchrun, gloo):
torch.save of opt.state_dict() per rank, and DCP into torch.optim.AdamW
(distributed_torch_checkpoint_worker.py is one rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memtide_testing import clean_env

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

WORKER = Path(__file__).with_name("distributed_torch_checkpoint_worker.py")


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_torch_save_and_dcp_into_torch_adamw_resume_training_on_every_rank(wrap, tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(WORKER), wrap], env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    torch_keys = set(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["moved"] > 1e-3, r  # the two steps after the save trained
        # torch.save's file (written over an earlier one) loads and resumes bit for bit.
        assert r["torch_save"] == 0.0, r
        # Torch's AdamW resumes from the DCP checkpoint as TieredAdamW does (their last bits differ).
        assert r["dcp_into_torch"] <= 1e-6, r
        assert set(r["keys"]) == torch_keys
