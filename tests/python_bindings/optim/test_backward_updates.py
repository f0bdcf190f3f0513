"""TieredAdamW(update_during_backward=...): subgroups updated on the CPU while backward goes on
give bit for bit what the sequential step gives (SimDevice, torch on CPU), whether the speculation
stands (no clipping needed, finite gradients) or is put back and redone (the norm clips, a loss
scale overflows, the learning rate or a gradient changed before step(), a second backward)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import memtide  # noqa: E402,F401
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss  # noqa: E402
from memtide.optim import LossScaler, TieredAdamW  # noqa: E402
from memtide_testing import everything, on_sized_device, one_torch_thread, same  # noqa: E402,F401

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 32, 4
SUBGROUP = 10_000  # ~110k params: 12 subgroups
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
POLICY_KW = {"cpu": {}, "interleaved": dict(k=1.5), "auto": {}}
DATA = [arithmetic_batch(torch.Generator().manual_seed(1 + i), BATCH, SEQ, VOCAB) for i in range(8)]


def make(policy="cpu", eager=True, dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, D, HEADS, LAYERS, SEQ).to(dtype)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, policy=policy, **POLICY_KW[policy], **HYPER,
                      update_during_backward=12 if eager else False, **kw)
    return model, opt


def train(model, opt, accumulate=1, between=None, during=None):
    """`during(n, model, opt)` before step n's backward; `between(n, model, opt)` after it."""
    for n, i in enumerate(range(0, len(DATA), accumulate)):
        opt.zero_grad(set_to_none=True)
        if during is not None:
            during(n, model, opt)
        for j, (x, y) in enumerate(DATA[i:i + accumulate]):
            opt.last_micro_batch = j == accumulate - 1
            opt.scale_loss(lm_loss(model(x), y) / accumulate).backward()
        if between is not None:
            between(n, model, opt)
        opt.step()


@pytest.mark.parametrize("policy", on_sized_device(sorted(POLICY_KW)))
def test_updates_during_backward_give_the_sequential_result(policy):
    results = []
    for eager in (False, True):
        model, opt = make(policy, eager)
        train(model, opt, accumulate=2)
        results.append((everything(model, opt), opt))
    (ref, _), (got, opt) = results
    assert same(ref, got)
    marks = opt.plan.engine_plan.marks
    # Subgroups were updated during backward (else this compared two sequential runs: auto on a
    # device that holds the whole state makes every subgroup a resident), and the step took them.
    stats = opt.backward_updates.stats
    assert stats["speculated"] > 0 and stats["kept"] == stats["speculated"], (marks, stats)
    if policy == "interleaved":
        # Streamed subgroups keep their state in host memory between steps: they take part too.
        assert any(marks[sg] == "g" for sg in opt.backward_updates._chosen)
    # GPU residents hold their newest state on the device: they never do.
    assert not any(marks[sg] == "s" for sg in opt.backward_updates._chosen)


def test_at_most_the_given_number_of_subgroups_take_part_the_first_backward_completes():
    model, opt = make(eager=False)
    opt2_model, opt2 = make()
    eager = opt2.backward_updates
    eager.max_subgroups = 3
    eager.choose()
    assert eager._chosen == {9, 10, 11}  # untimed: the last layers' (backward runs in reverse)
    assert eager.last_choice["rule"] == "count"
    train(opt2_model, opt2)
    train(model, opt)
    assert same(everything(model, opt), everything(opt2_model, opt2))
    assert 3 <= eager.stats["kept"] <= 3 * len(DATA)
    # Timed now: the next choice is what the worker can finish before backward ends.
    assert eager.last_choice["rule"] == "time"
    assert eager.last_choice["backward_tail_s"] > 0 and eager.last_choice["ns_per_param"] > 0
    eager._ns_per_param = 1e12  # an update slower than any backward: none is worth starting
    eager.choose()
    assert eager._chosen == set()
    eager._ns_per_param = 1e-9  # instant: as many as allowed, the first that backward completed
    eager.choose()
    first = sorted(eager._ready_ns, key=eager._ready_ns.get)[:3]
    assert eager._chosen == set(first)
    # New subgroups: the timing was of the old ones, so the count rule again until timed anew.
    opt2.add_param_group({"params": [torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))]})
    assert eager.last_choice["rule"] == "count"


def test_the_worker_takes_what_it_can_finish_before_backward_ends():
    from memtide.optim.backward_updates import fit_before_end

    ready = {0: 20.0, 1: 10.0, 2: 0.0}  # backward completes subgroup 2 first
    assert fit_before_end(ready, {0: 5.0, 1: 5.0, 2: 5.0}, 30.0, 8) == [2, 1, 0]
    # The worker is busy until 15, then 30: the third would end at 45.
    assert fit_before_end(ready, {0: 15.0, 1: 15.0, 2: 15.0}, 30.0, 8) == [2, 1]
    # One too long for the time left is skipped; a later, shorter one still fits.
    assert fit_before_end(ready, {0: 5.0, 1: 5.0, 2: 100.0}, 30.0, 8) == [1, 0]
    assert fit_before_end(ready, {0: 5.0, 1: 5.0, 2: 5.0}, 30.0, 2) == [2, 1]
    assert fit_before_end({}, {}, 30.0, 8) == []


def test_clipping_that_bites_redoes_and_clipping_that_does_not_keeps():
    for max_norm, expect_kept in ((1e-3, False), (1e6, True)):
        ref_model, ref = make(eager=False, max_grad_norm=max_norm)
        train(ref_model, ref)
        model, opt = make(max_grad_norm=max_norm)
        train(model, opt)
        assert same(everything(ref_model, ref), everything(model, opt))
        stats = opt.backward_updates.stats
        assert stats["speculated"] > 0
        assert (stats["kept"] > 0) == expect_kept and (stats["redone"] > 0) != expect_kept


def subgroups_of(opt, param):
    """The subgroups `param`'s elements fall in."""
    i = next(j for j, p in enumerate(opt.layout.params) if p is param)
    lo, hi = opt.layout.ranges[i]
    return {g for g, (s, e) in enumerate(opt.layout.subgroups) if s < hi and lo < e}


def test_an_overflow_seen_after_updates_during_backward_puts_them_back():
    # One gradient overflows, the last that backward finishes (the position embedding's): by
    # then other subgroups were updated, with finite gradients, and the step takes them as done;
    # the engine's scan then finds the overflow and skips the step, so rollback() must put every
    # taken update back.
    def run(eager):
        model, opt = make(eager=eager, loss_scale=LossScaler(init_scale=2.0**10, growth_interval=2))
        at = {}

        def inf_in(g):
            if at["n"] != 2:
                return None
            if opt.backward_updates is not None:  # the others were updated before this gradient arrived
                assert opt.backward_updates.stats["speculated"] > at["speculated"]
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

        def before_backward(n, model, opt):
            at.update(n=n, speculated=opt.backward_updates.stats["speculated"] if opt.backward_updates is not None else 0)

        model.pos.weight.register_hook(inf_in)
        train(model, opt, during=before_backward)
        return model, opt

    ref_model, ref = run(False)
    model, opt = run(True)
    assert ref.stats.skipped == opt.stats.skipped == 1
    assert same(everything(ref_model, ref), everything(model, opt))
    assert opt.backward_updates.stats["rolled_back"] > 0, opt.backward_updates.stats


def test_changes_between_backward_and_step_are_seen():
    seen = {}

    def meddle(n, model, opt):
        if n == 1:
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 0.5  # a schedule set right before the step
        if n == 3:
            # An in-place edit of a gradient whose subgroup was updated during this backward: the
            # final norm's bias, in the last subgroup, which backward completes first.
            edited = list(model.parameters())[-1]
            if opt.backward_updates is not None:
                assert subgroups_of(opt, edited) <= opt.backward_updates._chosen and opt.backward_updates.native.pending
                seen["redone"] = opt.backward_updates.stats["redone"]
            edited.grad.mul_(0.25)
        if n == 4 and opt.backward_updates is not None:
            assert opt.backward_updates.stats["redone"] > seen["redone"], "the edited gradient's update was not redone"
        if n == 5:
            x, y = DATA[0]
            lm_loss(model(x), y).backward()  # a second backward: gradients accumulate

    ref_model, ref = make(eager=False)
    train(ref_model, ref, between=meddle)
    model, opt = make()
    train(model, opt, between=meddle)
    assert same(everything(ref_model, ref), everything(model, opt))
    assert opt.backward_updates.stats["redone"] > 0 and opt.backward_updates.stats["kept"] > 0


def test_a_checkpoint_between_backward_and_step_holds_no_speculation():
    model, opt = make()
    train(model, opt)
    before = everything(model, opt)
    x, y = DATA[0]
    opt.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    assert opt.backward_updates.stats["speculated"] > 0
    assert same(before, everything(model, opt))  # state_dict() rolled every update back
    opt.step()  # and the step then runs them as usual
    assert not same(before, everything(model, opt))


def test_the_argument_is_checked():
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, D, HEADS, LAYERS, SEQ)
    for bad in (0, -1, 2.5, "yes"):
        with pytest.raises(ValueError, match="update_during_backward"):
            TieredAdamW(model.parameters(), update_during_backward=bad)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_with_the_layer_window_the_updates_stand_and_are_exact(accumulate):
    # The window first, then the optimizer (the order that works on a GPU too): the window's
    # gradient hooks are registered at the first forward, so TieredAdamW's hook still takes each
    # gradient before the window sends it home, and the copy the window leaves on p.grad is known
    # to be the same one.
    from memtide.window import LayerWindow

    def run(eager, window):
        if window:
            torch.manual_seed(0)
            model = TinyGPT(VOCAB, D, HEADS, LAYERS, SEQ)
            w = LayerWindow(model.blocks.layers, size=1)
            opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, policy="cpu", **HYPER,
                              update_during_backward=12 if eager else False)
            w.attach_optimizer(opt)
        else:
            model, opt = make(eager=eager, dtype=torch.float32)
        train(model, opt, accumulate=accumulate)
        return everything(model, opt), opt

    ref, _ = run(False, False)
    got, opt = run(True, True)
    assert same(ref, got)
    assert opt.backward_updates.stats["kept"] > 0


def test_memtide_run_with_the_window_and_updates_during_backward_trains_the_same(tmp_path):
    import json
    import subprocess
    import sys

    from memtide_testing import clean_env

    def run(*extra):
        p = subprocess.run([sys.executable, "-m", "memtide.cli", "run", "--policy", "cpu", "--iterations", "3",
                            "--json", *extra], env=clean_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout)

    plain = run()
    both = run("--window", "2", "--updates-during-backward")
    assert [s["loss"] for s in plain["steps"]] == [s["loss"] for s in both["steps"]]
    assert plain["final_loss"] == both["final_loss"]
    assert both["window"]["size"] == 2 and both["window"]["fetches"] > 0
    assert both["backward_updates"]["kept"] > 0 and plain["window"] is None
    assert both["backward_updates"]["choice"]["rule"] == "time"  # timed after the first step


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the gradients then travel the engine's gradient path, which the "
                    "updates during backward wait for (wait_grads_pushed)")
@pytest.mark.parametrize("policy", ["cpu", "interleaved"])
def test_on_a_gpu_the_updates_wait_for_the_gradient_path_and_are_exact(policy):
    def run(eager):
        torch.manual_seed(0)
        model = TinyGPT(VOCAB, D, HEADS, LAYERS, SEQ).to("cuda", torch.bfloat16)
        opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, policy=policy, **POLICY_KW[policy], **HYPER,
                          max_grad_norm=1e6, update_during_backward=12 if eager else False)
        for x, y in DATA:
            opt.zero_grad(set_to_none=True)
            lm_loss(model(x.cuda()), y.cuda()).backward()
            opt.step()
        torch.cuda.synchronize()
        return everything(model, opt), opt

    ref, _ = run(False)
    got, opt = run(True)
    assert same(ref, got)
    assert opt.backward_updates.stats["kept"] > 0
