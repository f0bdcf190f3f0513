"""TieredAdamW on many ranks: torchrun, gloo on CPU, FSDP2 (fully_shard) and DDP, against
torch.optim.AdamW under the same wrapper from the same start (distributed_worker.py is one rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from memtide.optim import torch_reads
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
    out = run(wrap, scenario, ranks, tmp_path)
    assert out["world"] == ranks and len(out["ranks"]) == ranks
    numel = NUMEL + (SIDE if scenario == "frozen" else 0)
    for rank, r in enumerate(out["ranks"]):  # every rank's own findings, not rank 0's alone
        assert r["moved"] > 1e-3, (rank, r)  # the params did train
        assert r["first_diff"] <= 1e-6, (rank, r)
        if wrap == "fsdp2-mp":
            # bf16 compute (MixedPrecisionPolicy) turns the last-bit differences of the two AdamWs' fp32
            # arithmetic (3e-8 after the first step, above) into bf16 roundings that go the other way,
            # and those into different gradients: 6e-5 after five steps, against 2e-2 of training.
            assert r["max_diff"] <= 1e-4, (rank, r)
        else:
            assert r["max_diff"] <= 1e-6, (rank, r)
        if scenario == "frozen":
            # The frozen block stayed as it was (no weight decay either), and the side branch, without
            # a gradient on odd steps, took 3 steps of 5 as torch.optim.AdamW's.
            assert r["frozen_moved"] == 0.0, (rank, r)
            assert r["side_steps"] == [3, 3], (rank, r)
        # The scaled scenario's inf (on rank 1 only) skips one step on every rank, as the reference does.
        assert r["skipped"] == ([1, 1] if scenario.startswith("scaled") else [0, 0]), (rank, r)
        if scenario.endswith("+eager"):
            # Updates during backward ran on the reduced gradients and were kept (the results above
            # equal the reference, the skipped step included).
            assert r["eager"]["kept"] > 0, (rank, r["eager"])
        # Every gradient entered the optimizer reduced, during backward (FSDP2's reduce-scatter, DDP's
        # bucket hook): step() copied none itself, but for the ones rank 1 of the FSDP2 scaled
        # scenarios writes its inf into after backward, which step() must have seen and copied.
        edited = wrap.startswith("fsdp2") and scenario.startswith("scaled") and rank == 1
        assert (r["regathered"] > 0) if edited else (r["regathered"] == 0), (rank, r)
        # ... and saw it where the step reads every param natively, FSDP2's DTensors included.
        assert r["native_reads"] == (torch_reads.status() == "native"), (rank, r)
        assert r["reads_match"] in (None, [True, True]) and (r["reads_match"] is not None) == r["native_reads"], (rank, r)
        # DDP's params take their reduced gradients from its bucket hook: with the C++ hooks none of
        # theirs runs Python or sends anything; FSDP2's DTensors keep the Python hook.
        if wrap.startswith("ddp") and r["native_reads"]:
            assert r["python_hooks"] == 0 and r["native_hooks"] == 0, (rank, r)
        if wrap.startswith("fsdp2"):
            assert r["python_hooks"] > 0 and r["native_hooks"] is None, (rank, r)
        assert r["host_bytes"] == 16 * r["numel"], (rank, r)
    numels = [r["numel"] for r in out["ranks"]]
    if wrap.startswith("fsdp2"):
        # Each rank keeps the state of its own shards: 1/N of the elements, not the whole model
        # (HSDP: 1/N of a shard group's, each of its two replicas holding the whole model).
        replicas = 2 if wrap == "fsdp2-hsdp" else 1
        assert sum(numels) == replicas * numel
        assert max(numels) <= numel // (ranks // replicas) + 61
    else:
        assert numels == [numel] * ranks


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


def test_a_checkpoint_saved_by_sharded_ranks_while_training_resumes_on_other_world_sizes(tmp_path):
    # TieredAdamW.save_checkpoint under FSDP2 and HSDP: each rank writes its shard as one part
    # while the steps go on. Saved on 2 FSDP2 ranks after step 0, resumed on 4 HSDP ranks (2
    # replicas of 2 shards: the first replica writes) which save after step 1, resumed on 1 rank:
    # the same end as the 2 ranks that never stopped (within 1e-6: other world sizes sum the
    # gradients in another order; resumed on 2, bit for bit). Read in one process, the parts put together
    # are the state as it was asked for.
    worker = WORKER.with_name("distributed_async_checkpoint_worker.py")

    def params(ranks: int, wrap: str, load: str, save: str, out: str) -> list:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                            str(worker), wrap, load, save, str(tmp_path / out)], env=clean_env(OMP_NUM_THREADS="1"),
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        return torch.load(tmp_path / out)

    from memtide.optim import read_checkpoint

    at1, at2 = str(tmp_path / "at1"), str(tmp_path / "at2")
    straight = params(2, "fsdp2", "-", at1, "straight.pt")
    assert sorted(os.listdir(at1)) == [".commit", ".parts-expected", "parts.manifest", "shard-00000-of-00002",
                                       "shard-00001-of-00002"]
    four = params(4, "hsdp", at1, at2, "four.pt")
    assert sorted(n for n in os.listdir(at2) if n.startswith("shard-")) == ["shard-00000-of-00002",
                                                                            "shard-00001-of-00002"]
    one = params(1, "fsdp2", at2, "-", "one.pt")
    for resumed in (four, one):
        assert max(float((a - b).abs().max()) for a, b in zip(straight, resumed)) <= 1e-6
    # On as many ranks as saved it, the resumed run is the uninterrupted one bit for bit.
    two = params(2, "fsdp2", at1, "-", "two.pt")
    assert all(torch.equal(a, b) for a, b in zip(straight, two))
    # One process reads the parts whole: after one step, the moments of the first weight have
    # its full shape and the step count is 1.
    state = read_checkpoint(at1)["state"]
    assert tuple(state[0]["exp_avg"].shape) == (61, 7) and int(state[0]["step"]) == 1
    assert all(v.abs().sum() > 0 for v in (state[0]["exp_avg"], state[0]["exp_avg_sq"]))
    assert [f for f in os.listdir(tmp_path) if "memtide-part" in f] == []
    # torch.distributed.checkpoint.load reshards it onto 4 ranks into torch's own AdamW and the
    # model, through memtide's CheckpointReader: the same values, whole.
    torch_loaded = params(4, "fsdp2-torch", at1, "-", "torch.pt")
    for i, entry in sorted(state.items()):
        assert torch.equal(torch_loaded["exp_avg"][i], entry["exp_avg"])
        assert torch.equal(torch_loaded["exp_avg_sq"][i], entry["exp_avg_sq"])
        assert torch.equal(torch_loaded["params"][i], entry["master_param"])
        assert torch_loaded["step"][i] == 1
    assert torch_loaded["lr"] == 1e-2
    # Ranks that name different paths would each wait forever for the others' parts: they fail
    # together, naming the paths, and nothing is written.
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(worker), "fsdp2", "-", str(tmp_path / "r{rank}"), str(tmp_path / "no.pt")],
                       env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "disagree on checkpoint path" in p.stderr, p.stderr[-3000:]
    assert not any(f.startswith(("r0", "r1", ".r0", ".r1")) for f in os.listdir(tmp_path))


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


def launch_every_rank(worker: str, ranks: int, args: List[str], where: Path) -> List[dict]:
    """Runs `worker` on `ranks` ranks in `where`; what each rank wrote there (rank<N>.json)."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        str(WORKER.with_name(worker)), *args], env=clean_env(OMP_NUM_THREADS="1"), cwd=where,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((where / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def disagreements(tmp_path_factory) -> List[dict]:
    """Every case of distributed_settings_worker.py on 2 ranks, one launch: what each rank got."""
    return launch_every_rank("distributed_settings_worker.py", 2, ["pairs"], tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def hsdp_disagreements(tmp_path_factory) -> List[dict]:
    """The HSDP cases (4 ranks, 2 replicas of 2 shards; the second replica differs), one launch."""
    return launch_every_rank("distributed_settings_worker.py", 4, ["hsdp"], tmp_path_factory.mktemp("hsdp"))


# What rank 1 passes against rank 0 (distributed_settings_worker.py), and what every rank's error
# says; {p} is a param's placements under FSDP2.
DISAGREEMENTS = {
    "policy": ["policy (rank 0: 'cpu'; rank 1: 'auto')"],
    "subgroup_size": ["subgroup_size (rank 0: 32; rank 1: 16)"],
    "lr": ["lr of group 0 (rank 0: 0.001; rank 1: 0.5); they also disagree on lr of group 1."],
    "weight_decay": ["weight_decay of group 0 (rank 0: 0.01; rank 1: 0.1)."],
    "betas": ["betas of group 0 (rank 0: [0.9, 0.999]; rank 1: [0.8, 0.999])"],
    "eps": ["eps of group 0 (rank 0: 1e-08; rank 1: 1e-06)"],
    "max_grad_norm": ["max_grad_norm (rank 0: None; rank 1: 1.0)"],
    "loss_scale": ["loss_scale (rank 0: 'dynamic'; rank 1: 1024.0)"],
    "growth_interval": ["loss_scale.growth_interval (rank 0: 2000; rank 1: 100)"],
    "host_budget": ["host_budget (rank 0: 68719476736; rank 1: 34359738368)"],
    "update_during_backward": ["update_during_backward (rank 0: False; rank 1: True)"],
    "k": ["disagree on k (rank 0: None; rank 1: 4.0)"],
    "gpu_static_fraction": ["gpu_static_fraction (rank 0: 0.0; rank 1: 0.5)"],
    "group_key": ["tag of group 1 (rank 0: 'no_decay'; rank 1: 'other')"],
    "left_out": ["params of group 0 (rank 0: 4 params; rank 1: 3 params), and param 3 is the first that differs "
                 "(rank 0: [2] float32{p}; rank 1: none)"],
    "shape": ["params of group 1: param 0 is the first that differs (rank 0: [4, 3] float32{p}; "
              "rank 1: [3, 4] float32{p})"],
    "dtype": ["params of group 1: param 0 is the first that differs (rank 0: [4, 3] float32{p}; "
              "rank 1: [4, 3] bfloat16{p})"],
}


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
@pytest.mark.parametrize("wrap", ["fsdp2", "ddp", "ddp-auto"])
def test_ranks_that_disagree_on_a_setting_or_their_params_all_fail_naming_it(disagreements, wrap, case):
    # FSDP2: at construction. DDP: at register_ddp, or (ddp-auto, nobody calls it) at the first
    # forward, where TieredAdamW finds the DDP model holding its params. Every rank fails alike.
    who = "TieredAdamW.register_ddp" if wrap == "ddp" else "TieredAdamW"
    placements = " (Shard(dim=0))" if wrap == "fsdp2" else ""
    for rank, said in enumerate(disagreements):
        line = said[f"{wrap}/{case}"]
        assert line.startswith(f"{who}: the ranks disagree on "), (rank, line)
        assert line == disagreements[0][f"{wrap}/{case}"]
        for w in DISAGREEMENTS[case]:
            assert w.format(p=placements) in line, (rank, w, line)


def test_ranks_that_agree_build_alike_even_with_uneven_shards(disagreements, hsdp_disagreements):
    # Updates during backward on every rank: FSDP2's uneven shards cut 23 subgroups on one rank and
    # 20 on the other, so the quarter taken differs (6 and 5): the setting is True on both.
    for said in disagreements:
        assert [said[f"{wrap}/same"] for wrap in ("fsdp2", "ddp", "ddp-auto")] == ["no error"] * 3, said
    for said in hsdp_disagreements:
        assert said["hsdp/same"] == "no error", said


def test_hsdp_replicas_that_disagree_all_fail_naming_each_replicas_ranks(hsdp_disagreements):
    # Each replica agrees within itself: only a comparison over the whole 2-D mesh sees it.
    placements = "(Replicate(), Shard(dim=0))"
    expected = {
        "weight_decay": "weight_decay of group 0 (ranks 0, 1: 0.01; ranks 2, 3: 0.1).",
        "shape": f"params of group 1: param 0 is the first that differs (ranks 0, 1: [4, 3] float32 {placements}; "
                 f"ranks 2, 3: [3, 4] float32 {placements})",
        "left_out": f"params of group 0 (ranks 0, 1: 4 params; ranks 2, 3: 3 params), and param 3 is the first that "
                    f"differs (ranks 0, 1: [2] float32 {placements}; ranks 2, 3: none)"}
    for rank, said in enumerate(hsdp_disagreements):
        for case, words in expected.items():
            line = said[f"hsdp/{case}"]
            assert line.startswith("TieredAdamW: the ranks disagree on "), (rank, line)
            assert words in line, (rank, case, line)


def test_a_whole_moment_loaded_into_a_sharded_param_is_refused_on_every_rank(disagreements):
    for rank, said in enumerate(disagreements):
        line = said["fsdp2/whole_state"]
        for w in ["DTensor", "whole tensor", "state kept"]:
            assert w in line, (rank, w, line)


def test_ddp_without_register_ddp_is_found_at_its_first_forward(tmp_path):
    # Frameworks wrap DDP themselves (HF Trainer, Accelerate, Lightning): nobody calls register_ddp.
    # TieredAdamW finds the DDP model at its first forward and takes its reduced gradients during
    # backward, as register_ddp does; a hook of the user's own stays, with one warning.
    said = launch_every_rank("distributed_ddp_worker.py", 2, [], tmp_path)
    for rank, r in enumerate(said):
        for scenario in ("auto", "auto+eager", "auto-inner", "own-hook", "builtin-hook", "explicit",
                         "explicit-own-hook"):
            s = r[scenario]
            assert s["moved"] > 1e-3 and s["max_diff"] <= 1e-6, (rank, scenario, s)  # trained as torch.optim.AdamW
            assert not s["watching"], (rank, scenario)
            mine = not scenario.endswith("hook")
            # Found at the first forward (or registered): every gradient came reduced, during backward.
            assert s["found_at_first_forward"] is mine and s["found"] is mine, (rank, scenario, s)
            assert s["regathered"] == (0 if mine else 6 * 4), (rank, scenario, s)  # else 6 params x 4 steps
            hooked = scenario in ("own-hook", "builtin-hook")
            assert len(s["warnings"]) == (1 if hooked else 0), (rank, scenario, s["warnings"])
        assert "communication hook of its own already (allreduce_hook)" in r["own-hook"]["warnings"][0]
        assert "(BuiltinCommHookType.ALLREDUCE)" in r["builtin-hook"]["warnings"][0]
        for w in r["own-hook"]["warnings"]:
            assert "does not overlap backward; results are unaffected" in w
        assert r["auto+eager"]["eager_kept"] > 0
        assert r["auto"]["register_again"] == r["explicit"]["register_again"] == "no error"
        assert r["explicit"]["register"] == "no error"
        assert r["explicit-own-hook"]["register"].startswith(
            "TieredAdamW.register_ddp: the DDP model has a communication hook of its own already (allreduce_hook)")
        # An optimizer whose params are not in the DDP model is left alone; its watch ends with its
        # first step.
        assert r["not-mine"] == {"mine": True, "other": False, "other_watching_before_step": True,
                                 "other_watching_after_step": False, "hooks_left": 0}
        # Dropped before any forward: collected (the global hook holds it weakly) and its hook gone.
        assert r["collected"] == {"watching": 1, "alive": False, "hooks_left": 0, "ddp_hooks": 0}
        assert r["hooks_at_end"] == 0
