"""TieredAdamW's state through torch's own checkpoints on many ranks (torchrun, gloo):
torch.save of opt.state_dict() per rank, and DCP (save, or async_save through memtide's
StateWriter while training goes on) into torch.optim.AdamW
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


@pytest.mark.parametrize("wrap,save", [("fsdp2", "sync"), ("ddp", "sync"), ("fsdp2", "async"), ("ddp", "async"),
                                       ("hsdp", "async")])
def test_torch_save_and_dcp_into_torch_adamw_resume_training_on_every_rank(wrap, save, tmp_path):
    world = 4 if wrap == "hsdp" else 2  # HSDP: two replicas, each sharded over two ranks
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                        str(WORKER), wrap, save], env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    torch_keys = set(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0])
    frozen = []  # async: the bytes each rank's frozen state kept
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["moved"] > 1e-3, r  # the two steps after the save trained
        # torch.save's file (written over an earlier one) loads and resumes bit for bit.
        assert r["torch_save"] == 0.0, r
        # Torch's AdamW resumes from the DCP checkpoint as TieredAdamW does (their last bits differ).
        assert r["dcp_into_torch"] <= 1e-6, r
        assert set(r["keys"]) == torch_keys
        if save == "async":
            kept, numel = r["kept"]
            frozen.append((kept, numel) if wrap == "hsdp" else kept)
            if wrap == "fsdp2":  # the moments of the rank's own shards, all written by it (params: copied)
                assert kept == 8 * numel, r
    if save == "async" and wrap == "ddp":
        # Params and moments frozen on each rank; DCP has one rank write each replicated tensor,
        # and a subgroup a rank writes nothing of is let go there.
        assert 0 < sum(frozen) < 2 * 12 * numel, frozen
    if save == "async" and wrap == "hsdp":
        # Each shard's moments are held by two ranks (one per replica); DCP has one of them write
        # each tensor, and the other lets its frozen copy go: less than every rank's moments kept.
        assert 0 < sum(k for k, _ in frozen) < sum(8 * n for _, n in frozen), frozen
    if save == "async":
        # Saved on every rank while they trained, loaded on one process: the state when asked.
        _load_on_one_process_equals_the_state_asked(tmp_path)


def _load_on_one_process_equals_the_state_asked(folder):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    asked = torch.load(folder / "asked.pt", weights_only=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 61), torch.nn.GELU(), torch.nn.Linear(61, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=folder / "dcp")
    for fqn, t in asked["model"].items():
        assert torch.equal(state["model"][fqn], t), fqn
    for fqn, entry in asked["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optim"]["state"][fqn][k], entry[k]), (fqn, k)
