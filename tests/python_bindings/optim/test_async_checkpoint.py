"""TieredAdamW.save_checkpoint: a checkpoint written while training goes on holds the state as it
was when asked for, commits whole or not at all, and a run resumed from it equals the
uninterrupted run bit for bit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from memtide.optim import TieredAdamW, read_checkpoint

HIDDEN = 1024  # about 3.1M params, 37 MB of state in 48 subgroups: steps outrun the writer


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1024)).to(dtype)


def _optimizer(model, policy, **kw):
    return TieredAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, policy=policy, subgroup_size=1 << 16, **kw)


def _train(model, opt, steps, first):
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(8, HIDDEN, generator=g).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _frozen(opt):
    """The optimizer's state now, as plain tensors that no later step changes."""
    sd = opt.state_dict()
    return {idx: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in e.items()}
            for idx, e in sd["state"].items()}


CASES = {
    "cpu": ("cpu", torch.float32, {}),
    "interleaved": ("interleaved", torch.float32, {}),  # streamed GPU subgroups flush into the host
    "auto": ("auto", torch.float32, {}),  # GPU residents: their host ranges are synced at the save
    "bf16": ("cpu", torch.bfloat16, {}),  # fp32 masters of a bf16 model
    "during-backward": ("cpu", torch.float32, {"update_during_backward": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_checkpoint_holds_the_state_when_asked_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path, case):
    policy, dtype, kw = CASES[case]
    model = _model(dtype)
    opt = _optimizer(model, policy, **kw)
    _train(model, opt, 2, 0)
    asked = _frozen(opt)
    # A buffer of one subgroup: most of the next steps' subgroups wait for the writer or are copied.
    save = opt.save_checkpoint(tmp_path / "ckpt", buffer_bytes=12 << 16)
    _train(model, opt, 3, 2)
    save.wait()
    p = save.progress()
    assert p["committed"] and p["bytes_written"] == p["bytes_total"] == 12 * opt.layout.numel
    assert p["peak_buffer_bytes"] <= 12 << 16
    after = [q.detach().clone() for q in model.parameters()]

    # The folder holds the state at the save, not the state now.
    saved = read_checkpoint(tmp_path / "ckpt")["state"]
    for idx, entry in asked.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[idx][key], entry[key]), (case, idx, key)
        assert int(saved[idx]["step"]) == int(entry["step"]) == 2

    # Resumed from it on a fresh model and optimizer, the same three steps give the same bits.
    model2 = _model(dtype)
    opt2 = _optimizer(model2, policy, **kw)
    opt2.load_checkpoint(tmp_path / "ckpt")
    _train(model2, opt2, 3, 2)
    for a, b in zip(after, model2.parameters()):
        assert torch.equal(a, b), case


def test_a_second_save_waits_for_the_first_and_replaces_it(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 1, 0)
    first = opt.save_checkpoint(tmp_path / "ckpt")
    _train(model, opt, 1, 1)
    second = opt.save_checkpoint(tmp_path / "ckpt")  # never interleaved with the first
    assert first.done()
    second.wait()
    assert first.progress()["committed"] and second.progress()["committed"]
    state = read_checkpoint(tmp_path / "ckpt")["state"]
    assert all(int(e["step"]) == 2 for e in state.values())
    assert [f for f in os.listdir(tmp_path) if "partial" in f] == []


def test_bad_targets_and_arguments_are_refused_naming_them(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 1, 0)
    (tmp_path / "file").write_text("x")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep")
    os.symlink(tmp_path / "theirs", tmp_path / "link")
    for target, words in ((tmp_path / "file", "not a folder"), (tmp_path / "theirs", "not a memtide checkpoint"),
                          (tmp_path / "link", "symbolic link")):
        with pytest.raises(ValueError, match=words):
            opt.save_checkpoint(target)
    with pytest.raises(OSError, match="does not exist"):
        opt.save_checkpoint(tmp_path / "missing" / "ckpt")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="buffer_bytes"):
            opt.save_checkpoint(tmp_path / "ckpt", buffer_bytes=bad)
    with pytest.raises(ValueError, match="path"):
        opt.save_checkpoint("")
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "keep"


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of a chosen size: mount(size) mounts a tmpfs at tmp_path/"disk" (root
    only: skipped elsewhere), unmounted at the end."""
    disk = tmp_path / "disk"
    mounted = []

    def mount(size):
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
            mounted.clear()
        disk.mkdir(exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"a tmpfs cannot be mounted here: {r.stderr.strip()}")
        mounted.append(size)
        return disk

    yield mount
    if mounted:
        subprocess.run(["umount", str(disk)], check=True)


def _files(folder):
    return {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}


def test_a_full_disk_fails_the_save_naming_it_and_leaves_the_previous_checkpoint(tmp_path, small_disk):
    """A real full disk, not an injected error: a tmpfs with room for one checkpoint, then for one
    checkpoint and the new one's state.bin but not the rest."""
    def trained():
        model = _model()
        opt = _optimizer(model, "cpu")
        _train(model, opt, 2, 0)
        return model, opt

    model, opt = trained()
    opt.save_checkpoint(tmp_path / "sized", blocking=True)
    sizes = _files(tmp_path / "sized")
    page = 4096
    whole = sum(-(-n // page) * page for n in sizes.values())
    state = -(-sizes["state.bin"] // page) * page
    # Refused when state.bin is reserved (fallocate), or a real ENOSPC from a write after it.
    for room, why, words in ((whole + whole // 2, "no room for the new state", "cannot reserve"),
                             (whole + state + page, "room for the new state.bin, not for the rest",
                              "did not complete: writing")):
        model, opt = trained()
        disk = small_disk(room)
        target = disk / "ckpt"
        opt.save_checkpoint(target, blocking=True)  # the previous checkpoint: it fits
        _train(model, opt, 1, 2)
        with pytest.raises(OSError, match="No space left on device") as failed:
            opt.save_checkpoint(target).wait()
        assert "ckpt" in str(failed.value) and words in str(failed.value), (why, str(failed.value))
        assert os.listdir(disk) == ["ckpt"], (why, os.listdir(disk))  # nothing half written is left
        assert set(os.listdir(target)) == set(sizes), why
        assert all(int(e["step"]) == 2 for e in read_checkpoint(target)["state"].values()), why
        _train(model, opt, 1, 3)  # training goes on
        shutil.rmtree(target)  # room made: the next save goes through
        opt.save_checkpoint(target, blocking=True)
        assert all(int(e["step"]) == 4 for e in read_checkpoint(target)["state"].values()), why


def test_a_refused_load_changes_nothing(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    opt.save_checkpoint(tmp_path / "ckpt", blocking=True)
    _train(model, opt, 1, 2)
    before = _frozen(opt)
    params = [p.detach().clone() for p in model.parameters()]
    data = tmp_path / "ckpt" / "state.bin"
    with open(data, "r+b") as f:  # one byte of the moments flipped
        f.seek(12 * opt.layout.numel // 2)
        f.write(b"\x7f")
    with pytest.raises(OSError, match="corrupt: subgroup"):
        opt.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(OSError, match="no checkpoint"):
        opt.load_checkpoint(tmp_path / "none")
    os.truncate(data, 100)
    with pytest.raises(OSError, match="truncated"):
        opt.load_checkpoint(tmp_path / "ckpt")
    after = _frozen(opt)
    for idx in before:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before[idx][key], after[idx][key])
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["cpu", "interleaved", pytest.param("auto", marks=pytest.mark.sized_device)])
def test_subgroups_spilled_to_nvme_are_saved_as_asked_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path, policy):
    # The writer reads spilled subgroups from the spill file; a step about to update one hands
    # the save its old state from the staging buffer it was read into (a copy) or waits.
    from memtide_testing import direct_io_dir  # here: the killed-save script imports this module

    spill = direct_io_dir(tmp_path)

    def build():
        model = _model(torch.bfloat16)
        return model, _optimizer(model, policy, nvme_dir=spill, host_budget=24 << 20)

    # Whether the steps meet the writer depends on the threads' timing: on a busy machine the
    # writer may finish first. Up to three tries for one that meets it; every try must be exact.
    for _ in range(3):
        model, opt = build()
        _train(model, opt, 2, 0)
        assert opt.spilled_subgroups > 0
        asked = _frozen(opt)
        save = opt.save_checkpoint(tmp_path / "ckpt")
        _train(model, opt, 2, 2)
        save.wait()
        p = save.progress()
        saved = read_checkpoint(tmp_path / "ckpt")["state"]
        for idx, entry in asked.items():
            for k in ("exp_avg", "exp_avg_sq", "master_param"):
                assert torch.equal(saved[idx][k], entry[k]), (idx, k)
        if p["copied_bytes"] > 0 or p["waited_s"] > 0:
            break
    assert p["copied_bytes"] > 0 or p["waited_s"] > 0, p  # the steps met the writer
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pass  # a file system that refuses O_DIRECT: everything goes through the page cache
    else:  # what was read from the spill file is placed as in state.bin and goes with O_DIRECT too
        assert p["direct_bytes"] > 0.95 * p["bytes_total"], p
    uninterrupted = [t.detach().clone() for t in model.parameters()]
    del model, opt
    model, opt = build()
    written = _bytes_written()
    opt.load_checkpoint(tmp_path / "ckpt")
    if written is not None:  # the spilled state goes back to NVMe once (it went twice: moments, then masters)
        spilled = opt.nvme_info()["spilled_params"] * 12
        assert _bytes_written() - written <= 1.1 * spilled, (_bytes_written() - written, spilled)
    _train(model, opt, 2, 2)
    for a, b in zip(uninterrupted, model.parameters()):
        assert torch.equal(a, b)


def _bytes_written():
    """What this process has written to storage (Linux's I/O accounting; None without it)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return None


def test_the_state_goes_to_disk_with_o_direct_where_the_file_system_takes_it(tmp_path):
    # Straight from the engine's arrays (each skewed in memory; the file places each array as it
    # lies), not through the page cache: only the edges of subgroups go through it.
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 1, 0)
    p = opt.save_checkpoint(tmp_path / "ckpt", blocking=True).progress()
    assert p["direct_bytes"] > 0.95 * p["bytes_total"], p
    b = opt.buffers
    saved = read_checkpoint(tmp_path / "ckpt")["state"][0]
    assert torch.equal(saved["exp_avg_sq"].flatten(), b.exp_avg_sq[:saved["exp_avg_sq"].numel()])


def test_torch_adamw_loads_the_checkpoint(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    opt.save_checkpoint(tmp_path / "ckpt", blocking=True)
    twin = torch.optim.AdamW(_model().parameters(), lr=1e-3, weight_decay=0.01)
    twin.load_state_dict(read_checkpoint(tmp_path / "ckpt"))
    for idx, entry in opt.state_dict()["state"].items():
        assert torch.equal(twin.state_dict()["state"][idx]["exp_avg"], entry["exp_avg"])


def test_torch_dcp_load_reads_the_checkpoint_into_torch_adamw_and_the_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from memtide.optim import CheckpointReader

    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    opt.save_checkpoint(tmp_path / "ckpt", blocking=True)
    saved = read_checkpoint(tmp_path / "ckpt")["state"]
    twin = _model()
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=5.0)
    state = {"model": get_model_state_dict(twin), "optim": get_optimizer_state_dict(twin, twin_opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, storage_reader=CheckpointReader(tmp_path / "ckpt", state["optim"], model_key="model"))
    set_model_state_dict(twin, state["model"])
    set_optimizer_state_dict(twin, twin_opt, state["optim"])
    assert twin_opt.param_groups[0]["lr"] == 1e-3 and twin_opt.param_groups[0]["weight_decay"] == 0.01
    for i, p in enumerate(twin.parameters()):
        assert torch.equal(p.detach(), saved[i]["master_param"])
        assert torch.equal(twin_opt.state[p]["exp_avg_sq"], saved[i]["exp_avg_sq"])
        assert float(twin_opt.state[p]["step"]) == 2
    with pytest.raises(ValueError, match="optim_state_dict must be"):
        CheckpointReader(tmp_path / "ckpt", {"state": {}})
    small = torch.nn.Linear(3, 3)
    small_opt = torch.optim.AdamW(small.parameters())
    state = {"optim": get_optimizer_state_dict(small, small_opt)}
    with warnings.catch_warnings(), pytest.raises(BaseException, match="holds 6 param tensors, the optimizer state dict names 2"):
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=CheckpointReader(tmp_path / "ckpt", state["optim"]))


KILLED = textwrap.dedent("""
    import os, signal, sys, time, torch
    sys.path.insert(0, sys.argv[2])
    from test_async_checkpoint import _model, _optimizer, _train
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    opt.save_checkpoint(sys.argv[1], blocking=True)
    _train(model, opt, 1, 2)
    save = opt.save_checkpoint(sys.argv[1], buffer_bytes=12 << 16)
    while save.progress()["bytes_written"] == 0:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(tmp_path):
    target = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-c", KILLED, str(target), os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    partial = [f for f in os.listdir(tmp_path) if ".memtide-partial-" in f]
    assert partial, "the killed save left its partial folder"
    state = read_checkpoint(target)["state"]  # the previous one, whole
    assert all(int(e["step"]) == 2 for e in state.values())
    model = _model()
    opt = _optimizer(model, "cpu")
    opt.load_checkpoint(target)
    opt.save_checkpoint(target, blocking=True)
    assert [f for f in os.listdir(tmp_path) if ".memtide-partial-" in f] == []


def test_under_ddp_a_rank_saves_its_whole_state_and_under_fsdp2_its_shard_as_a_part(tmp_path, one_rank_mesh):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(model, "cpu")
    opt.register_ddp(model)
    _train(model, opt, 2, 0)
    assert opt.distribution.kind == "ddp"
    asked = _frozen(opt)
    save = opt.save_checkpoint(tmp_path / "ckpt", buffer_bytes=12 << 16)
    _train(model, opt, 2, 2)
    save.wait()
    saved = read_checkpoint(tmp_path / "ckpt")["state"]
    for idx, entry in asked.items():
        assert torch.equal(saved[idx]["exp_avg_sq"], entry["exp_avg_sq"])

    # FSDP2 (a mesh of one rank here; many ranks in test_distributed.py): the shard is one part.
    sharded = _model()
    fully_shard(sharded, mesh=one_rank_mesh)
    opt = _optimizer(sharded, "cpu")
    _train(sharded, opt, 2, 0)
    asked = {idx: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in e.items()}
             for idx, e in _frozen(opt).items()}
    for idx, p in enumerate(sharded.parameters()):
        asked[idx]["master_param"] = p.full_tensor().detach().clone()
    save = opt.save_checkpoint(tmp_path / "sharded", buffer_bytes=12 << 16)
    _train(sharded, opt, 2, 2)
    save.wait()
    assert (tmp_path / "sharded" / "shard-00000-of-00001" / "state.manifest").is_file()
    saved = read_checkpoint(tmp_path / "sharded")["state"]
    for idx, entry in asked.items():
        for k in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(saved[idx][k], entry[k]), (idx, k)
    # A plain model in one process resumes from the shards as the sharded one goes on.
    plain = _model()
    plain_opt = _optimizer(plain, "cpu")
    plain_opt.load_checkpoint(tmp_path / "sharded")
    sharded_again = _model()
    fully_shard(sharded_again, mesh=one_rank_mesh)
    opt = _optimizer(sharded_again, "cpu")
    opt.load_checkpoint(tmp_path / "sharded")
    _train(plain, plain_opt, 2, 2)
    _train(sharded_again, opt, 2, 2)
    for a, b in zip(plain.parameters(), sharded_again.parameters()):
        assert torch.equal(a, b.full_tensor())
    # A corrupt part is refused, naming it, before anything changes.
    with open(tmp_path / "sharded" / "shard-00000-of-00001" / "state.bin", "r+b") as f:
        f.seek(4096 + 64)
        f.write(b"\x7f\x7f\x7f\x7f")
    before = [p.detach().clone() for p in plain.parameters()]
    with pytest.raises(OSError, match="shard-00000-of-00001.*corrupt: subgroup"):
        plain_opt.load_checkpoint(tmp_path / "sharded")
    assert all(torch.equal(a, b) for a, b in zip(before, plain.parameters()))


UNWAITED = textwrap.dedent("""
    import sys, torch
    from memtide.optim import TieredAdamW
    # 134M params: a 1.6 GB save, still running when the script ends.
    model = torch.nn.Sequential(torch.nn.Linear(8192, 8192, bias=False), torch.nn.Linear(8192, 8192, bias=False))
    opt = TieredAdamW(model.parameters(), policy="cpu", subgroup_size=1 << 22)
    model(torch.randn(2, 8192)).square().mean().backward()
    opt.step()
    save = opt.save_checkpoint(sys.argv[1])  # the script ends without save.wait()
    assert not save.done()
    # And the optimizer outlives the interpreter (as objects still referenced at exit may): its
    # destructor, which would wait too, never runs.
    import ctypes
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(opt))
""")


def test_a_script_that_ends_without_waiting_still_gets_its_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-c", UNWAITED, str(target)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, MEMTIDE_LOG_LEVEL="info"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "waiting for the save" in r.stderr
    state = read_checkpoint(target)["state"]
    assert all(int(e["step"]) == 1 for e in state.values())
    assert [f for f in os.listdir(tmp_path) if ".memtide-partial-" in f] == []


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 1, 0)
    opt.save_checkpoint(tmp_path / "ckpt", blocking=True)
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 512), torch.nn.Tanh(), torch.nn.Linear(512, HIDDEN))
    other_opt = _optimizer(other, "cpu")
    _train(other, other_opt, 1, 0)
    before = _frozen(other_opt)
    with pytest.raises(ValueError, match="TieredAdamW.load_checkpoint: .* holds 6 param tensors, the optimizer has 4"):
        other_opt.load_checkpoint(tmp_path / "ckpt")
    after = _frozen(other_opt)
    assert all(torch.equal(before[i]["exp_avg"], after[i]["exp_avg"]) for i in before)


def test_a_checkpoint_saved_before_the_first_step_restores_the_params(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    opt.save_checkpoint(tmp_path / "ckpt", blocking=True)
    torch.manual_seed(7)
    other = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1024))
    other_opt = _optimizer(other, "cpu")
    other_opt.load_checkpoint(tmp_path / "ckpt")
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_a_meta_file_that_lies_about_the_layout_is_refused(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 1, 0)
    opt.save_checkpoint(tmp_path / "ckpt", blocking=True)
    meta_path = tmp_path / "ckpt" / "meta.pt"
    meta = torch.load(meta_path, weights_only=True)
    meta["places"][0] = (0, 10 ** 9, (10 ** 9,), (10 ** 9,), (0,))
    torch.save(meta, meta_path)
    with pytest.raises(OSError, match="places param 0 outside"):
        read_checkpoint(tmp_path / "ckpt")
    meta_path.write_bytes(b"not a pickle")
    with pytest.raises(OSError, match="meta.pt cannot be read"):
        opt.load_checkpoint(tmp_path / "ckpt")
