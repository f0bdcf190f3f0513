"""TieredAdamW's gradient hooks in C++ (memtide.optim.gradients.GradientHooks,
torch_bridge/gradient_hooks.cpp): they hand CPU gradients to the step protocol without Python,
leave to Python's hook what they cannot send, share torch's hook slot with Python hooks, survive
what Python hooks survive, and go with the optimizer."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from memtide.optim import TieredAdamW  # noqa: E402
from memtide.optim.gradients import GradientHooks, GradientPath  # noqa: E402
from memtide_testing import READ_PATHS, use_reads  # noqa: E402

pytestmark = pytest.mark.usefixtures("native")


@pytest.fixture
def native(monkeypatch, request):
    if "reads" not in request.fixturenames:
        use_reads(monkeypatch, "native")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def train(m, opt, steps=3, seed=1):
    torch.manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()


def same_as_torch(m, **kw):
    ref = model()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, **kw))
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def python_hook_calls(monkeypatch):
    calls = []
    ready = GradientPath.ready
    monkeypatch.setattr(GradientPath, "ready", lambda self, i, p: (calls.append(i), ready(self, i, p))[1])
    return calls


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_cpu_gradients_are_sent_without_python(monkeypatch, policy):
    calls = python_hook_calls(monkeypatch)
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy=policy)
    train(m, opt)
    hooks = opt.gradient_path.native
    assert hooks is not None and hooks.sent == 3 * 4 and calls == []
    assert opt.stats.regathered == 0  # what they sent is what the step found
    same_as_torch(m)


def test_what_the_python_hook_must_do_goes_through_it(monkeypatch):
    # Updates during backward start workers from the hook: the route is Python's.
    calls = python_hook_calls(monkeypatch)
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu", subgroup_size=64, update_during_backward=2)
    train(m, opt)
    assert opt.gradient_path.native.sent == 0 and len(calls) == 3 * 4
    same_as_torch(m)


def test_a_python_hook_registered_before_runs_after_the_native_one():
    m = model()
    seen = []
    first = next(m.parameters())
    first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    train(m, opt)
    assert len(seen) == 3 and opt.gradient_path.native.sent == 3 * 4
    same_as_torch(m)


def test_a_python_hook_registered_after_takes_the_slot_and_the_step_sends_that_gradient():
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    seen = []
    next(m.parameters()).register_post_accumulate_grad_hook(lambda p: seen.append(1))
    train(m, opt)
    assert len(seen) == 3
    assert opt.gradient_path.native.sent == 3 * 3 and opt.stats.regathered == 3
    same_as_torch(m)


def edit(p):
    p.grad.add_(0.3)  # not a scale: AdamW's update would hide one


@pytest.mark.parametrize("reads", READ_PATHS)
@pytest.mark.parametrize("registered", ["before", "after"])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_a_hook_editing_the_gradient_in_place_is_what_the_step_uses(monkeypatch, reads, registered, policy):
    # Registered before the optimizer, the edit runs before its hook, which sends the edited
    # gradient; after, the step finds a new version and sends it again. Under policy "auto" the
    # hook copies the gradient: the copy taken before the edit must not be what the step uses.
    use_reads(monkeypatch, reads)
    m = model()
    if registered == "before":
        next(m.parameters()).register_post_accumulate_grad_hook(edit)
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy=policy)
    if registered == "after":
        next(m.parameters()).register_post_accumulate_grad_hook(edit)
    train(m, opt)
    assert opt.stats.regathered == (3 if registered == "after" else 0)
    ref = model()
    next(ref.parameters()).register_post_accumulate_grad_hook(edit)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_an_error_in_the_python_hook_is_raised_by_backward(monkeypatch):
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    opt.gradient_path.native.route(opt.gradient_path.native.PYTHON)

    def broken(self, i, p):
        raise KeyError("from the hook")

    monkeypatch.setattr(GradientPath, "ready", broken)
    with pytest.raises(KeyError, match="from the hook"):
        m(torch.randn(4, 16)).sum().backward()


def test_accumulated_micro_batches_send_the_last_gradient():
    m = model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch.manual_seed(3)
    batches = [torch.randn(4, 16) for _ in range(6)]
    for net, o in ((m, opt), (ref, ref_opt)):
        for step in range(3):
            o.zero_grad()
            for x in batches[2 * step:2 * step + 2]:
                net(x).pow(2).mean().backward()
            o.step()
    assert opt.stats.regathered == 0 and opt.gradient_path.native.sent == 3 * 2 * 4
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_the_hooks_go_with_the_optimizer_and_leave_torch_s_slot_as_it_was():
    m = model()
    seen = []
    first = next(m.parameters())
    first.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    train(m, opt, steps=1)
    gone = weakref.ref(opt)
    assert GradientHooks.depth(first) == 1
    del opt
    gc.collect()
    assert gone() is None and GradientHooks.depth(first) == 0
    m(torch.randn(4, 16)).sum().backward()  # no hook of the dead optimizer runs; the user's still does
    assert seen == [1, 1]
    # Nor do the hooks keep the params alive.
    p = torch.nn.Parameter(torch.randn(8))
    opt = TieredAdamW([p], lr=1e-2, policy="cpu")
    (p * p).sum().backward()
    opt.step()
    param = weakref.ref(p)
    del p, opt
    gc.collect()
    assert param() is None


def test_a_rebuilt_optimizer_hooks_its_params_once():
    m = model()
    params = list(m.parameters())
    opt = TieredAdamW(params[:2], lr=1e-2, policy="cpu")
    train(m, opt, steps=1)
    old = opt.gradient_path.native
    opt.add_param_group({"params": params[2:]})
    train(m, opt, steps=1)
    assert old.sent == 0  # taken off at the rebuild (a removed handle counts nothing)
    assert opt.gradient_path.native.sent == 4 and opt.stats.regathered == 0


def test_a_param_resized_after_the_optimizer_was_built_trains_as_before():
    # torch makes the accumulator anew for the new shape; the hook is the param's, not the accumulator's.
    p = torch.nn.Parameter(torch.randn(16))
    opt = TieredAdamW([p], lr=1e-2, policy="cpu")
    p.data = torch.randn(3)
    (p * p).sum().backward()
    opt.step()
    assert p.shape == (3,) and int(opt.state[p]["step"]) == 1
    (p * p).sum().backward()
    opt.step()
    assert opt.gradient_path.native.sent == 1 and int(opt.state[p]["step"]) == 2


def test_a_second_optimizer_over_the_same_params_and_the_first_one_going():
    # A careless loop makes a new optimizer each epoch: each one's hook takes torch's slot and holds
    # the previous one's; a dead optimizer's hook is cut out, so no chain grows.
    m = model()
    first = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    second = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    train(m, second, steps=1)
    assert first.gradient_path.native.sent == 4 and second.gradient_path.native.sent == 4
    p = next(m.parameters())
    assert GradientHooks.depth(p) == 2
    hooks = weakref.ref(first.gradient_path.native)
    del first
    gc.collect()
    assert hooks() is None and GradientHooks.depth(p) == 1  # the first's cut out of the second's
    for _ in range(3):  # and again: every new one replaces the last
        second = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
        gc.collect()
        assert GradientHooks.depth(p) == 1
    m2 = model()
    opt = TieredAdamW(m2.parameters(), lr=1e-2, policy="cpu")
    train(m2, opt)
    same_as_torch(m2)
    train(m, second, steps=2, seed=1)
    assert second.gradient_path.native.sent == 2 * 4 and second.stats.regathered == 0
