"""TieredAdamW where frameworks touch it as they touch torch.optim.AdamW: params moved or replaced
after the optimizer was built, torch's own keyword arguments, and state dicts that move both ways
between the two optimizers."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from torch.optim.optimizer import (register_optimizer_step_post_hook,  # noqa: E402
                                   register_optimizer_step_pre_hook)

from memtide.optim import POLICIES, TieredAdamW  # noqa: E402
from memtide_testing import READ_PATHS, on_sized_device, sized_device, use_reads  # noqa: E402

POLICY_KW = {"cpu": {}, "static": dict(gpu_static_fraction=0.5), "interleaved": dict(k=2), "auto": {}}
STEPS = 6


def model(dtype=torch.float32):
    torch.manual_seed(0)
    # Large enough for several subgroups of 500 (every policy places some on its 'GPU').
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(dtype)


def train(m, opt, steps=STEPS, at=None, move=None):
    """`steps` steps; `move(m)` runs after the step numbered `at` (None: right after building)."""
    g = torch.Generator().manual_seed(1)
    if at is None and move is not None:
        move(m)
    for s in range(steps):
        x = torch.randn(8, 16, generator=g).to(next(m.parameters()).dtype)
        m(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if s == at and move is not None:
            move(m)
    return [p.detach().float().clone() for p in m.parameters()]


def diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def replace_data(m):
    for p in m.parameters():
        p.data = p.data.clone()


def shift_in_place(m):
    m.load_state_dict({k: v + 0.01 for k, v in m.state_dict().items()})


MOVES = {
    # HF Trainer and Accelerate (MULTI_CPU) call model.to("cpu:0"): not "cpu" to torch, so it copies.
    "to cpu:0": lambda m: m.to("cpu:0"),
    "p.data = x": replace_data,
    # Cast away and back: every param is a new tensor of the same dtype and values.
    "to float64 and back": lambda m: m.to(torch.float64).to(torch.float32),
    "load_state_dict": shift_in_place,
    "p.data = new values": lambda m: [setattr(p, "data", p.data * 0.5) for p in m.parameters()],
}


@pytest.mark.parametrize("policy, at", [("cpu", None), ("cpu", 2), ("static", 2), ("interleaved", 2),
                                        pytest.param("auto", 2, marks=sized_device)])
@pytest.mark.parametrize("move", list(MOVES))
@pytest.mark.parametrize("reads", READ_PATHS)
def test_params_moved_after_the_optimizer_was_built_keep_training_as_torch_adamw(policy, move, at, reads, monkeypatch):
    use_reads(monkeypatch, reads)
    ref_model = model()
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2), at=at, move=MOVES[move])
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy=policy, subgroup_size=500, **POLICY_KW[policy])
    start = [p.detach().clone() for p in m.parameters()]
    mine = train(m, opt, at=at, move=MOVES[move])
    assert diff(mine, start) > 1e-3  # it trained
    assert diff(mine, ref) <= 1e-6, (move, policy)
    assert opt.stats.steps == STEPS
    if move != "load_state_dict":  # an in-place write into a view of the buffers is the master itself
        assert opt.stats.followed == len(start)
    # Every param is again a view of the optimizer's buffers: the step writes it, nothing copies.
    assert all(opt.layout.aliased)
    base = opt.buffers.params.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in m.parameters())


@pytest.mark.parametrize("reads", READ_PATHS)
def test_nothing_is_followed_when_nothing_moved(reads, monkeypatch):
    use_reads(monkeypatch, reads)
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    train(m, opt)
    assert opt.stats.followed == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_moved_low_precision_model_keeps_its_fp32_masters_bits(dtype):
    # model.to("cpu:0") copies the bf16 values as they are: the fp32 masters (finer than the model)
    # must survive the move, or every move would round the masters to the model's precision.
    still, moved = model(dtype), model(dtype)
    a = TieredAdamW(still.parameters(), lr=1e-2, policy="cpu")
    b = TieredAdamW(moved.parameters(), lr=1e-2, policy="cpu")
    train(still, a)
    train(moved, b, at=2, move=lambda m: m.to("cpu:0"))
    assert torch.equal(a.buffers.params, b.buffers.params)
    assert all(torch.equal(x, y) for x, y in zip(still.parameters(), moved.parameters()))
    assert b.stats.followed == len(list(moved.parameters()))


def test_a_cast_model_is_followed_with_its_moments_and_steps():
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    train(m, opt, steps=2)
    moments = opt.buffers.exp_avg.clone()
    m.to(torch.bfloat16)  # the engine is rebuilt around bf16 params with fp32 masters
    train(m, opt, steps=1)
    assert opt.layout.lowp_of == [True] * 4 and opt.buffers.lowp.dtype == torch.bfloat16
    assert [int(opt.state[p]["step"]) for p in m.parameters()] == [3] * 4
    assert not torch.equal(opt.buffers.exp_avg, moments) and opt.buffers.exp_avg.abs().sum() > 0
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


def test_a_param_resized_after_its_first_step_is_refused_naming_it():
    p, q = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(4))
    opt = TieredAdamW([{"params": [q]}, {"params": [p]}], lr=1e-2, policy="cpu")
    ((p * p).sum() + q.sum()).backward()
    opt.step()
    p.data = torch.randn(3)
    p.grad = None
    (p * p).sum().backward()
    with pytest.raises(ValueError, match=r"param 0 of group 1 now has 3 elements \(shape \(3,\)\), 16 when"):
        opt.step()
    with pytest.raises(ValueError, match="param 0 of group 1"):
        opt.step()  # and again: the refusal does not pass once it was said


def test_a_param_resized_before_its_first_step_starts_anew():
    p = torch.nn.Parameter(torch.randn(16))
    opt = TieredAdamW([p], lr=1e-2, policy="cpu")
    p.data = torch.randn(3)
    (p * p).sum().backward()
    before = p.detach().clone()
    opt.step()
    assert p.shape == (3,) and not torch.equal(p.detach(), before) and int(opt.state[p]["step"]) == 1


# -- torch.optim.Optimizer's step: hooks, the profiler, grad mode ---------------------------------


def test_step_hooks_run_as_torch_runs_them():
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2)
    seen = []
    handles = [opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o))),
               opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o))),
               register_optimizer_step_pre_hook(lambda o, args, kwargs: seen.append(("global pre", o))),
               register_optimizer_step_post_hook(lambda o, args, kwargs: seen.append(("global post", o)))]
    try:
        train(m, opt, steps=2)
    finally:
        for h in handles:
            h.remove()
    assert seen == [("global pre", opt), ("pre", opt), ("post", opt), ("global post", opt)] * 2
    train(m, opt, steps=1)
    assert len(seen) == 8  # removed: not called again


def test_a_subclass_step_runs_the_hooks_once():
    # torch wraps the subclass's step (hooks, profiler range); the step it calls runs without them.
    # (torch.optim.AdamW's own subclasses run them twice once any AdamW wrapped AdamW.step.)
    class Counting(TieredAdamW):
        steps = 0

        def step(self, closure=None):
            type(self).steps += 1
            return super().step(closure)

    calls = []
    m = model()
    opt = Counting(m.parameters(), lr=1e-2)
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    before = [p.detach().clone() for p in m.parameters()]
    train(m, opt, steps=2)
    assert Counting.steps == 2 and calls == ["pre", "post"] * 2
    assert all(int(opt.state[p]["step"]) == 2 for p in m.parameters())
    assert not any(torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_a_profiler_sees_the_step_and_nothing_else_pays_for_its_range(monkeypatch):
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2)
    train(m, opt, steps=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(m, opt, steps=1)
    assert {"Optimizer.step#TieredAdamW.step", "Optimizer.zero_grad#TieredAdamW.zero_grad"} <= {
        e.name for e in prof.events()}
    # Without a profiler or a hook, step and zero_grad open no profiler range: torch's wrapper cost
    # about 0.1 ms a step, entered cold after backward (bench/results/step-overhead/).
    ranges = []
    real = torch.autograd.profiler.record_function.__enter__
    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__",
                        lambda self: ranges.append(self.name) or real(self))
    train(m, opt, steps=2)
    assert ranges == []
    monkeypatch.undo()
    ref = torch.optim.AdamW(m.parameters())  # the counting itself works: torch's own step opens one
    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__",
                        lambda self: ranges.append(self.name) or real(self))
    train(m, ref, steps=1)
    assert ranges == ["Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"]
    m(torch.randn(2, 16)).sum().backward()
    ranges.clear()
    opt.zero_grad(set_to_none=False)  # zeroing in place: torch's own, range included
    assert ranges == ["Optimizer.zero_grad#TieredAdamW.zero_grad"]
    assert all(torch.count_nonzero(p.grad) == 0 for p in m.parameters())


def test_the_step_leaves_grad_mode_as_it_found_it_even_when_it_fails():
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 16)).sum().backward()
    loss = opt.step(lambda: m(torch.randn(2, 16)).sum())  # a closure runs with grad enabled
    assert loss.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        opt.step()
        assert not torch.is_grad_enabled()

    def broken():
        raise KeyError("from the closure")

    with pytest.raises(KeyError, match="from the closure"):
        opt.step(broken)
    assert torch.is_grad_enabled()


# -- torch.optim.AdamW's keyword arguments and param groups -----------------------------------------


@pytest.mark.parametrize("kw", [dict(fused=None), dict(fused=True), dict(fused=False), dict(foreach=None),
                                dict(foreach=True), dict(capturable=False), dict(capturable=True),
                                dict(differentiable=False), dict(maximize=False), dict(decoupled_weight_decay=True),
                                # torchtitan's builder passes these three together
                                dict(fused=False, foreach=True, amsgrad=False)])
def test_torch_adamw_keyword_arguments_are_accepted(kw):
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, **kw)
    for key, value in kw.items():
        assert opt.param_groups[0][key] == value
    train(m, opt, steps=1)


@pytest.mark.parametrize("kw, words", [(dict(differentiable=True), "differentiable=True is not supported"),
                                       (dict(decoupled_weight_decay=False), "decoupled_weight_decay=False"),
                                       (dict(maximize="yes"), "maximize must be a bool"),
                                       (dict(fused="always"), "fused must be a bool or None"),
                                       (dict(amsgrad=True), "amsgrad=True is not supported"),
                                       (dict(capturable=None), "capturable must be a bool"),
                                       # torch refuses these with a TypeError somewhere inside; a str lr
                                       # used to be taken and converted at every step
                                       (dict(lr="0.1"), "lr must be a real number .*; got a str"),
                                       (dict(lr=True), "lr must be a real number .*; got a bool"),
                                       (dict(weight_decay=None), "weight_decay must be a real number .*; got None"),
                                       (dict(lr=torch.tensor([0.1, 0.2])), "got a tensor of 2 elements")])
def test_torch_keyword_values_memtide_cannot_honour_are_refused_naming_them(kw, words):
    with pytest.raises(ValueError, match=words):
        TieredAdamW(model().parameters(), **kw)


@pytest.mark.parametrize("key, value, words", [
    ("lr", float("nan"), "lr must be a finite number"), ("lr", -1, "lr must be a finite number"),
    ("eps", float("inf"), "eps must be a finite number"), ("weight_decay", -0.5, "weight_decay must be"),
    ("betas", (0.9, 1.0), "betas must be a pair of numbers in"), ("betas", [0.9, 0.999, 0.5], "3 values"),
    ("betas", (0.9, "0.999"), "a str in it"), ("amsgrad", True, "amsgrad=True is not supported"),
    ("maximize", 1, "maximize must be a bool"), ("foreach", 0, "foreach must be a bool or None"),
    ("decoupled_weight_decay", 1, "decoupled_weight_decay=1"), ("lr", None, "got None")])
def test_a_group_value_set_between_steps_is_checked_by_the_next_step(key, value, words):
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2)
    train(m, opt, steps=1)
    before = [p.detach().clone() for p in m.parameters()]
    opt.param_groups[0][key] = value
    m(torch.randn(2, 16)).sum().backward()
    with pytest.raises(ValueError, match=words):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))  # refused before anything moved


def test_group_values_changed_between_steps_in_every_accepted_form_step_as_torch_adamw():
    """Each step takes the groups' values as they are then: a float, an int, a list of betas
    changed in place, a tensor lr changed in place (the checks' fast path and slow path alike)."""
    changes = [("lr", 0.02), ("lr", 0), ("betas", [0.8, 0.99]), ("betas", "in place"), ("lr", torch.tensor(0.01)),
               ("lr", "in place"), ("weight_decay", 0), ("eps", 1e-6)]
    ref_model, m = model(), model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    opt = TieredAdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for key, value in changes:
        for o in (ref_opt, opt):
            group = o.param_groups[0]
            if isinstance(value, torch.Tensor):
                group[key] = value.clone()  # each optimizer its own, changed in place later
            elif isinstance(value, list):
                group[key] = list(value)
            elif value != "in place":
                group[key] = value
            elif key == "betas":
                group["betas"][1] = 0.95
            else:
                group["lr"].mul_(0.5)
        x = torch.randn(8, 16, generator=g)
        for net, o in ((ref_model, ref_opt), (m, opt)):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert diff(list(m.parameters()), list(ref_model.parameters())) <= 1e-6


def test_param_groups_carry_every_key_torch_adamw_groups_carry():
    mine = TieredAdamW(model().parameters()).param_groups[0]
    theirs = torch.optim.AdamW(model().parameters()).param_groups[0]
    assert set(mine) == set(theirs)
    assert {k: mine[k] for k in theirs if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}


@pytest.mark.parametrize("policy", on_sized_device(POLICIES) + ["cpu+eager"])
def test_maximize_steps_along_the_gradient_as_torch_adamw(policy):
    ref_model, m = model(), model()
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, maximize=True, foreach=False))
    eager = policy.endswith("+eager")  # updates during backward take the same direction
    policy = policy.replace("+eager", "")
    opt = TieredAdamW(m.parameters(), lr=1e-2, maximize=True, policy=policy, subgroup_size=500,
                      update_during_backward=eager, **POLICY_KW[policy])
    mine = train(m, opt)
    assert diff(mine, ref) <= 1e-6


def test_maximize_with_loss_scaling_and_clipping_matches_torch():
    ref_model, m = model(), model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, maximize=True)
    opt = TieredAdamW(m.parameters(), lr=1e-2, maximize=True, policy="cpu", loss_scale=1024.0, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        ref_model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.scale_loss(m(x).square().mean()).backward()
        opt.step()
        opt.zero_grad()
    assert diff(list(m.parameters()), list(ref_model.parameters())) <= 1e-6


def test_groups_that_mix_maximize_are_refused_at_step():
    m = model()
    opt = TieredAdamW([{"params": m[0].parameters()}, {"params": m[2].parameters(), "maximize": True}])
    m(torch.randn(2, 16)).sum().backward()
    with pytest.raises(ValueError, match="mix maximize=True and maximize=False"):
        opt.step()


def test_state_dicts_move_both_ways_between_tiered_and_torch_adamw():
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu", fused=True)
    train(m, opt, steps=3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    # Into torch.optim.AdamW (every group key present), then one more step each: the same.
    twin = model()
    twin.load_state_dict(m.state_dict())
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    theirs.load_state_dict(saved)
    assert theirs.param_groups[0]["fused"] is True
    a = train(m, opt, steps=2)
    b = train(twin, theirs, steps=2)
    assert diff(a, b) <= 1e-6
    # And back.
    again = model()
    again.load_state_dict(twin.state_dict())
    mine = TieredAdamW(again.parameters(), lr=1e-2, policy="cpu")
    mine.load_state_dict(theirs.state_dict())
    assert diff(train(again, mine, steps=2), train(twin, theirs, steps=2)) <= 1e-6


@pytest.mark.parametrize("how", ["deepcopy", "copy", "torch.save"])
def test_copying_or_pickling_the_optimizer_itself_is_refused_naming_the_way_out(how):
    # torch.optim.Optimizer would pickle the groups and state and rebuild nothing: the copy had no
    # engine and failed at its first step, far from the copy.
    import copy

    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    copier = {"deepcopy": copy.deepcopy, "copy": copy.copy, "torch.save": lambda o: torch.save(o, io.BytesIO())}[how]
    with pytest.raises(TypeError, match=r"cannot be pickled or copied.*opt\.state_dict\(\)"):
        copier(opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # the way out works
    buf.seek(0)
    fresh = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    fresh.load_state_dict(torch.load(buf, weights_only=True))


def test_params_written_back_are_written_where_they_are_now(monkeypatch):
    # Params that are not views of the optimizer's buffers (FSDP2's shards, GPU params) are written
    # back after each step into where they were found; one a LayerWindow moves every iteration
    # (marked _memtide_windowed, which the follow check leaves to the window) must be found again.
    from memtide.optim.distributed import Distribution

    monkeypatch.setattr(Distribution, "can_view", staticmethod(lambda p, buffer: False))
    m, ref_m = model(), model()
    windowed = next(m.parameters())
    windowed._memtide_windowed = True
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    assert opt.layout.copied == list(range(len(opt.layout.params)))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(8, 16, generator=g)
        for net, o in ((m, opt), (ref_m, ref)):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad()
        windowed.data = windowed.data.clone()  # as the window moves a block between its buffers
    for p, r in zip(m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
