"""TieredAdamW on many ranks: torchrun, gloo on CPU, FSDP2 (fully_shard) and DDP, against
torch.optim.AdamW under the same wrapper from the same start (distributed_worker.py is one rank)."""

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

WORKER = Path(__file__).with_name("distributed_worker.py")
NUMEL = 7 * 61 + 61 + 61 * 13 + 13 + 13 * 3 + 3  # the worker's model
SIDE = 7 * 3 + 3  # its side branch (the frozen scenario)


def run(wrap: str, scenario: str, ranks: int, tmp_path: Path) -> dict:
    out = tmp_path / f"{wrap}-{scenario}-{ranks}.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        str(WORKER), wrap, scenario, str(out)], env=clean_env(), cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("wrap, scenario, ranks", [("fsdp2", "clip", 2), ("fsdp2", "scaled", 4), ("ddp", "clip", 2),
                                                   ("ddp", "scaled", 2), ("ddp-view", "clip", 2),
                                                   ("ddp", "scaled+eager", 2), ("fsdp2", "scaled+eager", 2),
                                                   ("fsdp2-mp", "scaled", 2), ("fsdp2-mp", "clip", 2),
                                                   ("fsdp2", "frozen", 2), ("ddp", "frozen", 2),
                                                   ("fsdp2-hsdp", "clip", 4), ("fsdp2-hsdp", "scaled", 4)])
def test_many_ranks_train_as_torch_adamw_does(wrap, scenario, ranks, tmp_path):
    r = run(wrap, scenario, ranks, tmp_path)
    assert r["world"] == ranks
    assert r["moved"] > 1e-3  # the params did train
    assert r["first_diff"] <= 1e-6, r
    if wrap == "fsdp2-mp":
        # bf16 compute (MixedPrecisionPolicy) turns the last-bit differences of the two AdamWs' fp32
        # arithmetic (3e-8 after the first step, above) into bf16 roundings that go the other way,
        # and those into different gradients: 6e-5 after five steps, against 2e-2 of training.
        assert r["max_diff"] <= 1e-4, r
    else:
        assert r["max_diff"] <= 1e-6, r
    if scenario == "frozen":
        # The frozen block stayed as it was (no weight decay either), and the side branch, without
        # a gradient on odd steps, took 3 steps of 5 as torch.optim.AdamW's.
        assert r["frozen_moved"] == 0.0
        assert r["side_steps"] == [3, 3]
    # The scaled scenario's inf (on rank 1 only) skips one step on every rank, as the reference does.
    assert r["skipped"] == ([1, 1] if scenario.startswith("scaled") else [0, 0])
    if scenario.endswith("+eager"):
        # Updates during backward ran on the reduced gradients and were kept (the results above
        # equal the reference, the skipped step included).
        assert r["eager"]["kept"] > 0, r["eager"]
    # Every gradient entered the optimizer reduced, during backward (FSDP2's reduce-scatter, DDP's
    # bucket hook): step() copied none itself.
    assert r["regathered"] == 0
    numel = NUMEL + (SIDE if scenario == "frozen" else 0)
    if wrap.startswith("fsdp2"):
        # Each rank keeps the state of its own shards: 1/N of the elements, not the whole model
        # (HSDP: 1/N of a shard group's, each of its two replicas holding the whole model).
        replicas = 2 if wrap == "fsdp2-hsdp" else 1
        assert sum(r["numel_per_rank"]) == replicas * numel
        assert max(r["numel_per_rank"]) <= numel // (ranks // replicas) + 61
        assert r["host_bytes"] == 16 * r["numel_per_rank"][0]
    else:
        assert r["numel_per_rank"] == [numel] * ranks


def test_register_ddp_refuses_a_model_that_is_not_ddp():
    from memtide.optim import TieredAdamW

    model = torch.nn.Linear(3, 2)
    opt = TieredAdamW(model.parameters(), policy="cpu")
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        opt.register_ddp(model)


def test_a_sharded_checkpoint_resumes_on_other_world_sizes_even_after_a_rank_died_saving_the_next(tmp_path):
    # torch.distributed.checkpoint with TieredAdamW's sharded state: saved on 2 ranks after step 0
    # (rank 1 then killed by SIGKILL in the middle of the next save), resumed on 4 (resharded)
    # which saves after step 1, resumed on 1: the same end as 2 ranks that never stopped. DCP
    # records a checkpoint (its .metadata) once every rank's data is written: the half-written one
    # is refused, naming what it lacks.
    worker = WORKER.with_name("distributed_checkpoint_worker.py")

    def launch(ranks: int, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={ranks}", str(worker), *args], env=clean_env(OMP_NUM_THREADS="1"),
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)

    def params(ranks: int, load: str, save: str, out: str) -> list:
        p = launch(ranks, load, save, str(tmp_path / out))
        assert p.returncode == 0, p.stderr[-4000:]
        return torch.load(tmp_path / out)

    import torch.distributed.checkpoint as dcp

    at1, at2, half = (str(tmp_path / name) for name in ("at1", "at2", "half"))
    killed = launch(2, "-", at1, str(tmp_path / "killed.pt"), half)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-4000:]
    assert (tmp_path / "at1" / ".metadata").is_file()
    assert any((tmp_path / "half").glob("*.distcp")) and not (tmp_path / "half" / ".metadata").exists()
    # DCP's CheckpointException is a BaseException.
    with pytest.raises(BaseException, match=r"No such file or directory: .*half/\.metadata"):
        dcp.load({"next_step": torch.zeros((), dtype=torch.int64)}, checkpoint_id=half)

    params(4, at1, at2, "four.pt")
    resumed = params(1, at2, "-", "one.pt")
    straight = params(2, "-", "-", "straight.pt")
    # (Loaded without its moments, the same resume ends 0.026 away.)
    assert max(float((a - b).abs().max()) for a, b in zip(straight, resumed)) <= 1e-6


def test_accelerate_fsdp2_trains_as_torch_adamw_does(tmp_path):
    # Accelerate's prepare(model, optimizer, scheduler) under its FSDP2 plugin shards the model after
    # TieredAdamW was built and swaps the sharded params into its groups: TieredAdamW follows them
    # (hooked before the first backward), each rank holding its shards' state.
    pytest.importorskip("accelerate", reason="Hugging Face Accelerate is not installed (scripts/test.sh installs it)")
    worker = WORKER.with_name("distributed_accelerate_worker.py")
    env = clean_env(OMP_NUM_THREADS="1")  # the two launches compute alike

    def launch(optimizer: str) -> dict:
        out = tmp_path / f"{optimizer}.pt"
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(worker), optimizer, str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        return torch.load(out)

    mine, ref = launch("memtide"), launch("torch")
    assert mine["world"] == 2 and mine["sharded"] and ref["sharded"]
    assert max(float((a - b).abs().max()) for a, b in zip(mine["params"], mine["start"])) > 1e-3  # it trained
    assert max(float((a - b).abs().max()) for a, b in zip(mine["params"], ref["params"])) <= 1e-6
    assert mine["same_params"] and mine["steps"] == 4  # 8 micro-batches, 2 per step
    assert mine["regathered"] == 0
    total = sum(t.numel() for t in mine["start"])
    assert sum(mine["numel_per_rank"]) == total and max(mine["numel_per_rank"]) < total


@pytest.mark.parametrize("when, words", [("train", ["Connection", "peer"]),
                                         ("build", ["TimeoutError", "rank(s) 1", "did not build", "10 s"])])
def test_a_rank_that_leaves_makes_the_others_fail_not_hang(when, words, tmp_path):
    # Rank 1 ends with status 0 (torchrun then waits for the others) in the middle of training, or
    # before building its optimizer: rank 0 must fail by itself within the process group's
    # timeout (10 s here). The subprocess timeout is the bound: a hang fails the test there.
    worker = WORKER.with_name("distributed_death_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(worker), when, "10"], env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stderr[-4000:]
    said = (tmp_path / "rank0.txt").read_text()
    for w in words:
        assert w in said, (w, said)


@pytest.mark.parametrize("wrap, setting, words", [("fsdp2", "policy", ["policy", "'cpu'", "'auto'"]),
                                                  ("ddp", "subgroup_size", ["subgroup_size", "32", "16"]),
                                                  ("fsdp2", "lr", ["hyper-parameters", "0.5"]),
                                                  ("fsdp2", "whole_state", ["DTensor", "whole tensor", "state kept"])])
def test_ranks_that_disagree_on_the_optimizer_or_its_state_are_refused_naming_it(wrap, setting, words, tmp_path):
    worker = WORKER.with_name("distributed_settings_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(worker), wrap, setting], env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    for line in lines:  # every rank fails, naming the setting, both values and the ranks
        if setting != "whole_state":
            assert "disagree" in line and "rank 0" in line and "rank 1" in line, line
        for w in words:
            assert w in line, (w, line)
