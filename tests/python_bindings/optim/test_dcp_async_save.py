"""torch.distributed.checkpoint.async_save through memtide.optim.StateWriter: the optimizer's state
is staged with no copy and written by DCP's own writer while steps go on; the files are DCP's, read
by dcp.load into torch.optim.AdamW or back into TieredAdamW, and a run resumed from them equals the
uninterrupted run bit for bit."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from memtide.optim import StateWriter
from test_async_checkpoint import CASES, _model, _optimizer, _train  # the same policies and dtypes


def _state(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


class _Watched(StateWriter):
    """Keeps what it staged, to check that the optimizer's tensors were not copied."""

    def stage(self, state_dict):
        self.staged = super().stage(state_dict)
        return self.staged


def _async_save(state, writer, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        return dcp.async_save(state, checkpoint_id=path, storage_writer=writer)


def _load(state, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path)


@pytest.mark.parametrize("case", list(CASES))
def test_async_save_writes_the_state_when_asked_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path, case):
    policy, dtype, kw = CASES[case]
    model = _model(dtype)
    opt = _optimizer(model, policy, **kw)
    _train(model, opt, 2, 0)
    state = _state(model, opt)
    asked = {fqn: {k: v.detach().clone() for k, v in entry.items()} for fqn, entry in state["optim"]["state"].items()}
    asked_params = {fqn: t.detach().clone() for fqn, t in state["model"].items()}
    writer = _Watched(tmp_path / "ckpt", opt, buffer_bytes=12 << 16)  # one subgroup: most steps wait or copy
    future = _async_save(state, writer, tmp_path / "ckpt")
    _train(model, opt, 3, 2)
    future.result()
    # No second copy: the moments staged are the optimizer's own tensors, frozen.
    for fqn, entry in state["optim"]["state"].items():
        assert writer.staged["optim"]["state"][fqn]["exp_avg_sq"] is entry["exp_avg_sq"]
    p = writer.progress()
    assert p["committed"] and p["bytes_written"] == p["bytes_total"] > 0, p
    assert p["peak_buffer_bytes"] <= 12 << 16, p
    uninterrupted = [q.detach().clone() for q in model.parameters()]

    # torch's own AdamW and model read DCP's files with DCP's reader: the state when asked (in
    # the model's dtype, in which torch's AdamW keeps its moments).
    twin = _model(dtype)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=5.0)
    loaded = _state(twin, twin_opt)
    _load(loaded, tmp_path / "ckpt")
    for fqn, entry in asked.items():
        for k in ("exp_avg", "exp_avg_sq"):
            got = loaded["optim"]["state"][fqn][k]
            assert torch.equal(got, entry[k].to(got.dtype)), (case, fqn, k)
    for fqn, t in asked_params.items():
        assert torch.equal(loaded["model"][fqn], t), (case, fqn)

    # TieredAdamW resumed from them goes on as the run that never stopped.
    resumed = _model(dtype)
    resumed_opt = _optimizer(resumed, policy, **kw)
    _train(resumed, resumed_opt, 1, 0)  # some state of its own, all overwritten by the load
    state = _state(resumed, resumed_opt)
    _load(state, tmp_path / "ckpt")
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_opt, state["optim"])
    _train(resumed, resumed_opt, 3, 2)
    for a, b in zip(uninterrupted, resumed.parameters()):
        assert torch.equal(a, b), case


class _SlowPlanner(DefaultSavePlanner):
    """Plans for longer than the writer may read nothing: the save is given up on."""

    def create_local_plan(self):
        time.sleep(1.5)
        return super().create_local_plan()


def test_a_writer_that_reads_nothing_is_given_up_on_the_steps_go_on_and_the_save_fails(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    writer = StateWriter(tmp_path / "ckpt", opt, buffer_bytes=1, stall_s=0.3)  # no room: steps wait
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        future = dcp.async_save(_state(model, opt), checkpoint_id=tmp_path / "ckpt", storage_writer=writer,
                                planner=_SlowPlanner())
    began = time.monotonic()
    _train(model, opt, 1, 2)  # waits 0.3 s for the planning writer, then goes on
    assert time.monotonic() - began < 1.4
    with pytest.raises(BaseException, match="read nothing for"):
        future.result()
    p = writer.progress()
    assert p["done"] and not p["committed"] and "read nothing" in p["error"], p
    assert not (tmp_path / "ckpt" / ".metadata").exists()
    # The next save goes through.
    _train(model, opt, 1, 3)
    state = _state(model, opt)
    asked = {fqn: e["exp_avg"].clone() for fqn, e in state["optim"]["state"].items()}
    _async_save(state, StateWriter(tmp_path / "ckpt2", opt), tmp_path / "ckpt2").result()
    twin = _model()
    twin_opt = torch.optim.AdamW(twin.parameters())
    loaded = _state(twin, twin_opt)
    _load(loaded, tmp_path / "ckpt2")
    assert all(torch.equal(loaded["optim"]["state"][fqn]["exp_avg"], t) for fqn, t in asked.items())


def test_a_save_that_fails_lets_the_steps_go_and_the_future_raises(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    target = tmp_path / "not-a-folder"
    target.write_bytes(b"a file where the checkpoint's folder would go")
    writer = StateWriter(target, opt, buffer_bytes=1)
    future = _async_save(_state(model, opt), writer, target)
    with pytest.raises(BaseException):
        future.result()
    # The save's thread ends just after its future: from then on nothing is kept (a step that
    # came first waited for that moment, not for the stall limit).
    began = time.monotonic()
    _train(model, opt, 2, 2)
    assert time.monotonic() - began < 5
    assert opt.engine.running_save() is None
    p = writer.progress()
    assert p["done"] and not p["committed"] and "planning failed" in p["error"], p
    assert target.read_bytes().startswith(b"a file")


def test_bad_arguments_and_an_nvme_tier_are_refused_naming_them(tmp_path):
    from memtide_testing import direct_io_dir

    model = _model()
    opt = _optimizer(model, "cpu")
    with pytest.raises(ValueError, match="path must be"):
        StateWriter("", opt)
    with pytest.raises(ValueError, match="must be a memtide TieredAdamW"):
        StateWriter(tmp_path, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="buffer_bytes must be"):
        StateWriter(tmp_path, opt, buffer_bytes=-1)
    for bad in (0, float("inf"), float("nan"), "60"):
        with pytest.raises(ValueError, match="stall_s must be"):
            StateWriter(tmp_path, opt, stall_s=bad)
    with pytest.raises(ValueError, match="cache_staged_state_dict"):
        StateWriter(tmp_path, opt, cache_staged_state_dict=True)
    spilled = _model(torch.bfloat16)
    spill_opt = _optimizer(spilled, "cpu", nvme_dir=direct_io_dir(tmp_path), host_budget=24 << 20)
    _train(spilled, spill_opt, 1, 0)
    with pytest.raises(ValueError, match="spills to NVMe.*save_checkpoint"):
        _async_save(_state(spilled, spill_opt), StateWriter(tmp_path / "ckpt", spill_opt), tmp_path / "ckpt")
    _train(spilled, spill_opt, 1, 1)  # nothing was frozen
    # A blocking dcp.save writes through it as through FileSystemWriter.
    _train(model, opt, 1, 0)
    state = _state(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=tmp_path / "blocking", storage_writer=StateWriter(tmp_path / "blocking", opt))
    assert (tmp_path / "blocking" / ".metadata").is_file()


def test_under_fsdp2_the_shards_of_the_state_are_frozen_and_load_into_a_plain_torch_adamw(tmp_path, one_rank_mesh):
    from torch.distributed.fsdp import fully_shard

    sharded = _model()
    fully_shard(sharded, mesh=one_rank_mesh)
    opt = _optimizer(sharded, "cpu")
    _train(sharded, opt, 2, 0)
    state = _state(sharded, opt)
    asked = {fqn: {k: v.full_tensor().clone() for k, v in e.items() if k != "step"}
             for fqn, e in state["optim"]["state"].items()}
    # Two of DCP's writer threads read the frozen state at once.
    writer = _Watched(tmp_path / "ckpt", opt, buffer_bytes=12 << 16, thread_count=2)
    group = torch.distributed.new_group(backend="gloo")  # the save's collectives apart from training's
    future = dcp.async_save(state, checkpoint_id=tmp_path / "ckpt", storage_writer=writer, process_group=group)
    _train(sharded, opt, 2, 2)
    future.result()
    fqn = next(iter(state["optim"]["state"]))
    assert writer.staged["optim"]["state"][fqn]["exp_avg"] is state["optim"]["state"][fqn]["exp_avg"]
    assert writer.progress()["committed"]
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters())
    loaded = _state(plain, plain_opt)
    _load(loaded, tmp_path / "ckpt")
    for fqn, entry in asked.items():
        for k, v in entry.items():
            assert torch.equal(loaded["optim"]["state"][fqn][k], v), (fqn, k)


def test_a_second_save_waits_for_the_first_and_each_holds_its_own_state(tmp_path):
    model = _model()
    opt = _optimizer(model, "cpu")
    _train(model, opt, 2, 0)
    futures, asked = [], []
    for i in range(2):
        state = _state(model, opt)
        asked.append({fqn: e["exp_avg"].clone() for fqn, e in state["optim"]["state"].items()})
        # The second async_save returns once the first's writer has read what it froze.
        futures.append(_async_save(state, StateWriter(tmp_path / f"ckpt{i}", opt, buffer_bytes=1), tmp_path / f"ckpt{i}"))
        _train(model, opt, 1, 2 + i)
    for i, future in enumerate(futures):
        future.result()
        twin = _model()
        twin_opt = torch.optim.AdamW(twin.parameters())
        loaded = _state(twin, twin_opt)
        _load(loaded, tmp_path / f"ckpt{i}")
        for fqn, t in asked[i].items():
            assert torch.equal(loaded["optim"]["state"][fqn]["exp_avg"], t), (i, fqn)
    assert not torch.equal(next(iter(asked[0].values())), next(iter(asked[1].values())))
