"""TieredAdamW with an NVMe tier (host_budget, nvme_dir): training with spilled subgroups gives
the same bits as training without (SimDevice, torch on CPU), checkpoints continue bit for bit,
each I/O fault is an OSError naming the subgroup and the spill file that loses nothing, and every
bad argument or setup is refused naming it."""

from __future__ import annotations

import copy
import errno
import io
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import memtide  # noqa: E402,F401
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss  # noqa: E402
from memtide.optim import LossScaler, TieredAdamW  # noqa: E402
from memtide_testing import direct_io_dir, everything, on_sized_device, one_torch_thread, same, sized_device  # noqa: E402,F401

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 32, 4
SUBGROUP = 10_000  # ~110k params: 12 subgroups
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
POLICY_KW = {"cpu": {}, "interleaved": dict(k=1.5), "auto": {}}


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(VOCAB, D, HEADS, LAYERS, SEQ).to(torch.bfloat16)


def numel(model):
    return sum(p.numel() for p in model.parameters())


def half_budget(model):
    """Host memory for about half the state: 16 B/param less 12 B for each spilled one, plus
    the read-ahead's staging (two subgroups)."""
    return 10 * numel(model) + 2 * 12 * SUBGROUP


DATA = [arithmetic_batch(torch.Generator().manual_seed(1 + i), BATCH, SEQ, VOCAB) for i in range(12)]


@pytest.fixture
def spill_dir(tmp_path):
    return direct_io_dir(tmp_path)


def train(model, opt, data, accumulate=1):
    for i in range(0, len(data), accumulate):
        opt.zero_grad(set_to_none=True)
        for x, y in data[i:i + accumulate]:
            opt.scale_loss(lm_loss(model(x), y) / accumulate).backward()
        opt.step()


def make_opt(model, policy, spill_dir=None, **kw):
    kw = dict(subgroup_size=SUBGROUP, policy=policy, **POLICY_KW[policy], **HYPER, **kw)
    if spill_dir is not None:
        kw.update(host_budget=half_budget(model), nvme_dir=spill_dir)
    return TieredAdamW(model.parameters(), **kw)


def assert_the_last_step_moved_spilled_state(opt):
    """The last step read spilled subgroups from NVMe and wrote them back (none was a resident
    whose state stays on the device)."""
    last = opt.nvme_info()["last"]
    assert last["read_bytes"] > 0 and last["write_bytes"] > 0, (opt.plan.engine_plan.marks, last)


@pytest.mark.parametrize("policy", on_sized_device(sorted(POLICY_KW)))
def test_training_with_spill_equals_training_without(spill_dir, policy):
    # Gradient accumulation, clipping and dynamic loss scaling, on each placement policy.
    kw = dict(max_grad_norm=0.5)
    results = []
    for where in (None, spill_dir):
        model = make_model()
        opt = make_opt(model, policy, where, loss_scale=LossScaler(init_scale=2.0**10, growth_interval=3), **kw)
        train(model, opt, DATA, accumulate=2)
        if where is not None:
            info = opt.nvme_info()
            assert 4 <= info["spilled"] <= 8, info
            # Each spilled subgroup is read and written once, but GPU residents (state stays there).
            placement = opt.plan.engine_plan.marks
            moved = sum(1 for p, s in zip(placement, info["on_nvme"]) if s and p != "s")
            assert info["last"]["reads"] == moved and info["last"]["writes"] == moved, (placement, info["last"])
            assert_the_last_step_moved_spilled_state(opt)
            assert opt.engine.host_bytes < 16 * numel(model)
        results.append((everything(model, opt), opt.loss_scale))
    assert results[0][1] == results[1][1]
    assert same(results[0][0], results[1][0]), "spilling changed the training"


def test_interleaved_streams_spilled_subgroups_through_the_gpu(spill_dir):
    model = make_model()
    opt = make_opt(model, "interleaved", spill_dir)
    train(model, opt, DATA[:2])
    placement = opt.plan.engine_plan.marks
    on_nvme = opt.nvme_info()["on_nvme"]
    assert any(p == "g" and s for p, s in zip(placement, on_nvme)), (placement, on_nvme)


def save(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return buf


@sized_device
def test_a_checkpoint_continues_bit_for_bit(spill_dir):
    model = make_model()
    opt = make_opt(model, "auto", spill_dir)
    train(model, opt, DATA)
    assert_the_last_step_moved_spilled_state(opt)
    uninterrupted = everything(model, opt)

    model = make_model()
    opt = make_opt(model, "auto", spill_dir)
    train(model, opt, DATA[:6])
    ckpt = save(model, opt)
    del model, opt
    model = make_model(seed=5)  # other initial values: everything must come from the checkpoint
    opt = make_opt(model, "auto", spill_dir)
    loaded = torch.load(ckpt, weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    train(model, opt, DATA[6:])
    assert_the_last_step_moved_spilled_state(opt)
    assert same(everything(model, opt), uninterrupted)


@pytest.mark.parametrize("fault,words", [
    (dict(write_errno=errno.EIO), "Input/output error"),
    (dict(write_errno=errno.ENOSPC), "No space left"),
    (dict(short_write=True), "short write"),
])
def test_a_failed_write_back_is_named_and_loses_nothing(spill_dir, fault, words):
    model = make_model()
    opt = make_opt(model, "cpu", spill_dir)
    train(model, opt, DATA[:2])
    opt.engine.inject_nvme_faults(**fault)
    x, y = DATA[2]
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    with pytest.raises(OSError) as e:
        opt.step()
    info = opt.nvme_info()
    first = info["on_nvme"].index(True)
    assert f"subgroup {first}" in str(e.value) and info["file"] in str(e.value) and words in str(e.value)
    assert info["held"] == [first], "the state whose write failed is kept in memory"
    # A checkpoint can be taken, and it holds the held subgroup's new state.
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"]
    # Training goes on: the held state is written first.
    opt.step()
    assert opt.nvme_info()["held"] == []


def test_a_spill_file_truncated_by_someone_else_is_caught(spill_dir):
    model = make_model()
    opt = make_opt(model, "cpu", spill_dir)
    train(model, opt, DATA[:2])
    os.truncate(opt.nvme_info()["file"], 0)
    x, y = DATA[2]
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    with pytest.raises(OSError, match="truncated") as e:
        opt.step()
    assert opt.nvme_info()["file"] in str(e.value)


def test_the_spill_directory_is_private_and_goes_with_the_optimizer(spill_dir):
    model = make_model()
    opt = make_opt(model, "cpu", spill_dir)
    info = opt.nvme_info()
    folder = os.path.dirname(info["file"])
    assert os.path.dirname(folder) == str(spill_dir)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert os.stat(info["file"]).st_mode & 0o777 == 0o600
    assert os.path.getsize(info["file"]) >= 12 * info["spilled_params"], "space is reserved up front"
    del opt, model  # the model's params are views of the engine's buffer: they keep it alive
    import gc
    gc.collect()
    assert not os.path.exists(folder)


def test_a_stale_spill_directory_is_reported(spill_dir, capfd):
    # A directory a crashed run left: the pid in its name is gone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = spill_dir / f"memtide-spill-{dead.stdout.strip()}-abcdef"
    stale.mkdir(mode=0o700)
    (stale / "state.spill").write_bytes(b"x" * 8192)
    model = make_model()
    make_opt(model, "cpu", spill_dir)
    err = capfd.readouterr().err
    assert str(stale) in err and "did not exit cleanly" in err


@pytest.mark.parametrize("kw,error,words", [
    (dict(nvme_dir="SPILL"), ValueError, "nvme_dir needs host_budget"),
    (dict(host_budget="lots", nvme_dir="SPILL"), ValueError, '"lots" is not a size'),
    (dict(host_budget=-1, nvme_dir="SPILL"), ValueError, "host_budget must be > 0"),
    (dict(host_budget=True, nvme_dir="SPILL"), ValueError, "host_budget must be bytes"),
    (dict(host_budget="1MiB", nvme_dir="SPILL", nvme_read_ahead=0), ValueError, "nvme_read_ahead"),
    (dict(host_budget="1MiB", nvme_dir=""), ValueError, "nvme_dir is empty"),
    (dict(host_budget="1MiB", nvme_dir="SPILL/missing"), OSError, "missing"),
    (dict(host_budget="1MiB", nvme_dir="SPILL/file"), OSError, "file"),
    (dict(host_budget="1MiB", nvme_dir="SPILL/dangling"), OSError, "dangling"),
    (dict(host_budget="1MiB"), ValueError, "no NVMe directory"),
    (dict(host_budget=1000, nvme_dir="SPILL"), ValueError, "too small"),
])
def test_bad_nvme_arguments_are_named(spill_dir, kw, error, words):
    (spill_dir / "file").write_text("not a directory")
    (spill_dir / "dangling").symlink_to(spill_dir / "gone")
    kw = {k: (v.replace("SPILL", str(spill_dir)) if isinstance(v, str) and k == "nvme_dir" else v) for k, v in kw.items()}
    model = make_model()
    with pytest.raises(error, match=words):
        TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **kw)


def test_fp32_params_cannot_spill(spill_dir):
    model = make_model().float()
    with pytest.raises(ValueError, match="fp16/bf16"):
        TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, host_budget=half_budget(model), nvme_dir=spill_dir)


def test_a_budget_the_state_fits_spills_nothing(spill_dir):
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, host_budget="1GiB", nvme_dir=spill_dir)
    assert opt.spilled_subgroups == 0 and opt.nvme_info() is None
    assert not any(spill_dir.iterdir())


def test_param_groups_added_later_and_a_relative_folder_left_behind(spill_dir, monkeypatch):
    # The model's params in two groups, the second added later (the layout is rebuilt and the
    # state moved); the folder named relative to a directory the script leaves afterwards.
    monkeypatch.chdir(spill_dir)
    os.mkdir("spill")
    model = make_model()
    params = list(model.parameters())
    opt = TieredAdamW(params[:5], subgroup_size=SUBGROUP, host_budget=half_budget(model), nvme_dir="spill", **HYPER)
    train(model, opt, DATA[:2])
    opt.add_param_group({"params": params[5:]})
    monkeypatch.chdir("/")
    train(model, opt, DATA[2:4])
    assert opt.spilled_subgroups > 0
    folder = os.path.dirname(opt.nvme_info()["file"])
    assert os.path.isabs(folder)
    del opt, model, params
    import gc
    gc.collect()
    assert not os.path.exists(folder), "the spill folder must go even after a chdir"


def test_memtide_run_trains_with_the_nvme_tier(spill_dir, cli):
    # The CPU policy: with auto, spilled subgroups may live on the (simulated) GPU and move nothing.
    p = cli("run", "--host-budget", "60MB", "--nvme-dir", str(spill_dir), "--iterations", "2", "--policy", "cpu",
            "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    r = json.loads(p.stdout)
    assert r["model"]["dtype"] == "bfloat16"
    assert r["nvme"]["spilled"] > 0 and r["nvme"]["last"]["reads"] == r["nvme"]["spilled"]
    assert r["optimizer"]["host_arena"]["state_bytes"] < 60e6
    assert r["steps"][-1]["loss"] < r["steps"][0]["loss"] * 1.5
    assert not any(spill_dir.iterdir()), "the spill folder goes with the process"
    for args, words in ((["--host-budget", "60MB"], "go together"),
                        (["--host-budget", "1MB", "--nvme-dir", str(spill_dir)], "too small")):
        p = cli("run", "--iterations", "1", *args)
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
