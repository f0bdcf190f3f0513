"""memtide.optim.TieredAdamW training a small GPT-style model on CPU."""

from __future__ import annotations

import copy
import gc
import io
import math
import os

import pytest

torch = pytest.importorskip("torch")

import memtide  # noqa: E402
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss  # noqa: E402
from memtide._memtide import UpdateEngine  # noqa: E402
from memtide.optim import POLICIES, LossScaler, TieredAdamW, engine_unavailable  # noqa: E402
from memtide_testing import (READ_PATHS, on_sized_device, one_torch_thread, sized_device,  # noqa: E402,F401
                             use_reads)

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 2, 32, 4
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# ~110k params: 12 subgroups whose boundaries fall inside tensors.
SUBGROUP = 10_000
# Each policy with the knobs it takes; all must give the same bits.
POLICY_KW = {
    "cpu": {},
    "static": dict(gpu_static_fraction=0.5),
    "interleaved": dict(k=2),
    "auto": {},
}


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyGPT(VOCAB, D, HEADS, LAYERS, SEQ).to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [arithmetic_batch(g, BATCH, SEQ, VOCAB) for _ in range(n)]


DATA = batches(50)


def backward(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    (opt.scale_loss(loss) if isinstance(opt, TieredAdamW) else loss).backward()
    return loss


def train(model, opt, data):
    losses = []
    for x, y in data:
        losses.append(backward(model, opt, x, y).item())
        opt.step()
    return losses


def flat_state(opt):
    if hasattr(opt, "sync_state"):
        opt.sync_state()
    b = opt.buffers
    return [t.clone() for t in (b.params, b.exp_avg, b.exp_avg_sq)] + ([b.lowp.clone()] if b.lowp is not None else [])


def assert_rel_close(actual, expected, tol=1e-6, what=""):
    """Normwise relative error, the figure that does not blow up for elements near zero."""
    err = (actual.double() - expected.double()).norm()
    scale = expected.double().norm()
    assert err <= tol * max(scale, 1e-30), f"{what}: relative error {float(err / max(scale, 1e-30)):.3g} > {tol}"


def mirror(model, groups=None, **kw):
    """fp32 copies of the model's params, and torch.optim.AdamW over them with the same groups."""
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    if groups is None:
        return ref, torch.optim.AdamW(ref, foreach=False, **{**HYPER, **kw})
    ref_groups = [dict(g, params=[ref[index[id(p)]] for p in g["params"]]) for g in groups]
    return ref, torch.optim.AdamW(ref_groups, foreach=False, **{**HYPER, **kw})


def teach(model, ref, grad_scale=1.0):
    """Gives the reference the model's gradients (unscaled in fp32, as GradScaler.unscale_ does)."""
    for r, p in zip(ref, model.parameters()):
        r.grad = None if p.grad is None else p.grad.to(torch.float32, copy=True).mul_(grad_scale)


# ---- against torch.optim.AdamW ------------------------------------------------------------------


def test_matches_torch_adamw_for_50_steps():
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    ref, ref_opt = mirror(model)
    losses = []
    for x, y in DATA:
        losses.append(backward(model, opt, x, y).item())
        teach(model, ref)  # same gradients: what differs is the optimizer alone
        opt.step()
        ref_opt.step()
    assert losses[-1] < losses[0] - 0.3, losses  # it trains
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")
        assert_rel_close(opt.state[p]["exp_avg"], ref_opt.state[r]["exp_avg"], what=f"exp_avg {i}")
        assert_rel_close(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], what=f"exp_avg_sq {i}")
        assert opt.state[p]["step"].item() == ref_opt.state[r]["step"].item() == 50
    assert len(opt.plan.subgroups) == math.ceil(sum(p.numel() for p in model.parameters()) / SUBGROUP)
    assert opt.stats.steps == 50 and opt.stats.params_updated == 50 * opt.buffers.params.numel()


@sized_device
def test_every_policy_gives_identical_bits():
    # On the sized device, where auto mixes CPU, streamed and resident subgroups: each policy's
    # paths ran (the params each one updated over the run, by where).
    paths = {"cpu": "c", "static": "cs", "interleaved": "cg", "auto": "cgs"}
    results = {}
    for policy, kw in POLICY_KW.items():
        model = make_model()
        opt = TieredAdamW(model.parameters(), policy=policy, subgroup_size=SUBGROUP, **HYPER, **kw)
        losses, ran = [], dict.fromkeys("cgs", 0)
        for x, y in DATA:
            losses.append(backward(model, opt, x, y).item())
            opt.step()
            r = opt.last_report
            ran["c"] += r.params_cpu
            ran["g"] += r.params_gpu
            ran["s"] += r.params_gpu_static
        results[policy] = (losses, [p.detach().clone() for p in model.parameters()], flat_state(opt))
        assert opt.plan.policy == policy
        assert len(opt.plan.placement) == len(opt.plan.subgroups) == 12
        assert {w for w, n in ran.items() if n > 0} == set(paths[policy]), (policy, ran)
    first_losses, first_params, first_state = results["cpu"]
    for policy, (losses, params, state) in results.items():
        assert losses == first_losses, policy
        assert all(torch.equal(a, b) for a, b in zip(params, first_params)), policy
        assert all(torch.equal(a, b) for a, b in zip(state, first_state)), policy


def test_plan_says_what_ran():
    model = make_model()
    opt = TieredAdamW(model.parameters(), policy="interleaved", k=2, subgroup_size=SUBGROUP)
    plan = opt.plan
    assert plan.requested == ("cpu", "gpu") * 6  # stride 2: every other subgroup on the GPU
    if isinstance(opt.engine, UpdateEngine):
        # The scheduler runs GPU placements (on a data-mode SimDevice without a GPU).
        assert plan.placement == plan.requested and plan.reason == ""
        assert plan.engine_plan.marks == "cg" * 6
    elif not torch.cuda.is_available():
        assert plan.placement == ("cpu",) * 12
        assert "no GPU" in plan.reason and "all on CPU" in plan.summary()
    assert plan.summary().startswith("policy interleaved (k=2): 12 subgroups")


# ---- the UpdateScheduler engine -----------------------------------------------------------------


class CpuEngineAdamW(TieredAdamW):
    """TieredAdamW with every subgroup on the CPU (the fused CPU kernel): the reference every other
    placement must match bit for bit."""

    def __init__(self, params, *, policy, k=None, gpu_static_fraction=0.0, **kw):
        super().__init__(params, policy="cpu", **kw)


def test_default_engine_is_the_scheduler():
    if engine_unavailable(1):
        pytest.skip(f"the runtime's device cannot run the scheduler: {engine_unavailable(1)}")
    opt = TieredAdamW(make_model().parameters(), subgroup_size=SUBGROUP)
    assert isinstance(opt.engine, UpdateEngine)


def subgroup_sizes(opt, letter):
    return sum(e - s for (s, e), c in zip(opt.plan.subgroups, opt.plan.engine_plan.marks) if c == letter)


@pytest.mark.parametrize("policy,kw,letters", [
    ("cpu", {}, "c" * 12),
    ("static", dict(gpu_static_fraction=0.5), "c" * 6 + "s" * 6),
    ("interleaved", dict(k=3), "ccg" * 4),
    ("interleaved", dict(k=2, gpu_static_fraction=0.25), "cg" * 4 + "c" + "s" * 3),
    ("interleaved", dict(k=1.5), "cgg" * 4),
])
def test_scheduler_places_subgroups_and_matches_the_cpu_engine(policy, kw, letters):
    if engine_unavailable(1):
        pytest.skip(engine_unavailable(1))
    model, ref_model = make_model(), make_model()
    opt = TieredAdamW(model.parameters(), policy=policy, subgroup_size=SUBGROUP, **HYPER, **kw)
    ref = CpuEngineAdamW(ref_model.parameters(), policy=policy, subgroup_size=SUBGROUP, **HYPER, **kw)
    assert isinstance(opt.engine, UpdateEngine)
    assert opt.plan.engine_plan.marks == letters
    losses, ref_losses = train(model, opt, DATA[:6]), train(ref_model, ref, DATA[:6])
    report = opt.last_report
    assert report.params_cpu == subgroup_sizes(opt, "c")
    assert report.params_gpu == subgroup_sizes(opt, "g")
    assert report.params_gpu_static == subgroup_sizes(opt, "s")
    gpu = report.params_gpu + report.params_gpu_static
    assert (gpu > 0) == (policy != "cpu")
    assert report.params_cpu + gpu == opt.buffers.params.numel()
    assert report.gpu.params == gpu  # the device really stepped them
    assert report.loop_allocations == 0 and report.loop_device_allocs == 0
    assert report.measured_ns > 0 and report.predicted_ns > 0
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(flat_state(opt), flat_state(ref)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_auto_plans_with_the_perf_model():
    if engine_unavailable(1):
        pytest.skip(engine_unavailable(1))
    model = make_model()
    opt = TieredAdamW(model.parameters(), policy="auto", subgroup_size=SUBGROUP, **HYPER)
    ep = opt.plan.engine_plan
    assert len(ep.marks) == len(opt.plan.subgroups) == 12
    assert set(ep.marks) <= set("cgs")
    assert ep.prediction.total_ns > 0
    train(model, opt, DATA[:4])
    # Every step was measured and fed to the calibration, which compares it with the prediction.
    assert len(opt.measured_ns) == 4 and all(ns > 0 for ns in opt.measured_ns)
    assert opt.engine.prediction_errors().count == 4
    assert opt.clock == ("simulated" if memtide.backend() == "sim" else "wall")
    assert len(opt.plan.engine_plan.marks) == 12  # re-planned every step


def test_per_step_records_keep_the_newest_steps_only(monkeypatch):
    """stats.history and measured_ns keep the last HISTORY_STEPS steps: a long run does not grow
    the optimizer by an entry per step."""
    from memtide.optim import tiered_adamw

    monkeypatch.setattr(tiered_adamw, "HISTORY_STEPS", 3)
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    seen = []
    for x, y in DATA[:5]:
        backward(model, opt, x, y)
        opt.step()
        seen.append((opt.stats.last_params, opt.stats.last_engine_seconds, opt.stats.last_step_seconds))
    assert opt.stats.steps == 5
    assert list(opt.stats.history) == seen[-3:]
    assert len(opt.measured_ns) == 3 and all(ns > 0 for ns in opt.measured_ns)


def test_scheduler_with_param_groups_and_low_precision():
    if engine_unavailable(1):
        pytest.skip(engine_unavailable(1))
    results = []
    for cls in (TieredAdamW, CpuEngineAdamW):
        model = make_model(dtype=torch.bfloat16)
        params = list(model.parameters())
        groups = [dict(params=params[::2], lr=2e-3), dict(params=params[1::2], weight_decay=0.0)]
        opt = cls(groups, policy="interleaved", k=2, gpu_static_fraction=0.25, subgroup_size=SUBGROUP,
                  loss_scale="dynamic", **HYPER)
        train(model, opt, DATA[:4])
        results.append((flat_state(opt), [p.detach().clone() for p in params]))
        if cls is TieredAdamW:
            assert isinstance(opt.engine, UpdateEngine)
            assert opt.last_report.runs == 2  # one scheduler run per hyperparameter set
            assert opt.last_report.params_gpu > 0
    (state, params), (ref_state, ref_params) = results
    assert all(torch.equal(a, b) for a, b in zip(state, ref_state))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


@pytest.mark.parametrize("policy,kw", [("cpu", {}), ("static", dict(gpu_static_fraction=0.5)),
                                       ("interleaved", dict(k=1.5, gpu_static_fraction=0.25)),
                                       ("auto", dict(k=3)), ("auto", {})])
def test_one_placement_function_and_one_meaning_of_k(policy, kw):
    """What TieredAdamW asks for is the PerfModel's plan for the same knobs (k: the stride)."""
    opt = TieredAdamW(make_model().parameters(), policy=policy, subgroup_size=SUBGROUP, **kw)
    sizes = [e - s for s, e in opt.plan.subgroups]
    if policy == "auto" and "k" not in kw:
        assert opt.plan.requested is None  # left to the performance model
        return
    ref = memtide.plan_update(sizes, policy=policy, static_fraction=kw.get("gpu_static_fraction", 0.0),
                              k=kw.get("k"), gpu_slot_limit=len(sizes), gpu_static_limit=len(sizes))
    assert opt.plan.requested == tuple("cpu" if c == "c" else "gpu" for c in ref["placement"])
    if isinstance(opt.engine, UpdateEngine):
        assert opt.plan.engine_plan.marks == ref["placement"]  # the memory fits it here


def test_a_step_moves_the_plans_bytes_and_writes_the_models_params():
    """The bf16 params are views of the engine's device buffer, written inside the update phase:
    the bytes the step moves are the bytes its plan counts, with no write-back after it."""
    if engine_unavailable(1):
        pytest.skip(engine_unavailable(1))
    model = make_model(dtype=torch.bfloat16)
    opt = TieredAdamW(model.parameters(), policy="interleaved", k=2, gpu_static_fraction=0.25,
                      subgroup_size=SUBGROUP, loss_scale="dynamic", **HYPER)
    assert opt.model_attached and not opt.sync_after_step
    buffer = opt.buffers.lowp
    for p in model.parameters():  # every param lives in the engine's buffer
        assert buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + buffer.numel() * 2
    placement = opt.plan.engine_plan.marks
    assert set(placement) == set("cgs")
    for step, (x, y) in enumerate(DATA[:3]):
        backward(model, opt, x, y)
        opt.step()
        report, pred = opt.last_report, opt.plan.engine_plan.prediction
        if step > 0:  # the first step moves the residents in, once
            assert report.h2d.bytes == pred.h2d_bytes
            assert report.d2h.bytes == pred.d2h_bytes
    opt.sync_state()
    for p, (lo, hi) in zip(model.parameters(), opt.layout.ranges):
        assert torch.equal(p.detach().reshape(-1), opt.buffers.params[lo:hi].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_optimizer_that_is_gone_gives_its_memory_back(dtype):
    """The engine's host arrays and its device buffer live exactly as long as something uses them."""
    import gc

    if engine_unavailable(1):
        pytest.skip(engine_unavailable(1))
    # Earlier tests' garbage (an optimizer with updates during backward sits in a reference cycle)
    # goes first, or its release in the middle would read as this optimizer's.
    gc.collect()
    host0, dev0 = memtide.host.stats()["allocated_bytes"], memtide.stats()["allocated_bytes.all.current"]

    def train_a_little():
        model = make_model(dtype=dtype)
        opt = TieredAdamW(model.parameters(), policy="static", gpu_static_fraction=0.5, subgroup_size=SUBGROUP)
        train(model, opt, DATA[:2])
        assert memtide.host.stats()["allocated_bytes"] > host0

    train_a_little()
    gc.collect()
    assert memtide.host.stats()["allocated_bytes"] == host0
    assert memtide.stats()["allocated_bytes.all.current"] == dev0


# ---- the gradient path --------------------------------------------------------------------------


def param_ranges(opt):
    return dict(zip(map(id, opt.layout.params), opt.layout.ranges))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_reach_the_host_buffer_during_backward(dtype):
    """Each gradient is sent the moment backward finishes it: before step() runs, the flat fp32
    gradient buffer already holds every one of them."""
    model = make_model(dtype=dtype)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    ranges = param_ranges(opt)
    x, y = DATA[0]
    backward(model, opt, x, y)
    for p in model.parameters():
        lo, hi = ranges[id(p)]
        assert torch.equal(opt.buffers.grads[lo:hi], p.grad.reshape(-1).float())


def assert_off_device_paths_ran(opt):
    """Policies other than static updated subgroups on the CPU in the last step (auto too: on the
    sized device its plan keeps state off the device)."""
    if opt.policy != "static":
        assert opt.last_report.params_cpu > 0, opt.plan.summary()


@pytest.mark.parametrize("policy", on_sized_device(POLICIES))
def test_gradient_accumulation_and_in_place_edits_are_exact(policy):
    """Accumulating over micro-batches steps the complete gradient, and a gradient edited in
    place between backward and step (a user's own clipping) is taken as edited."""
    model = make_model()
    opt = TieredAdamW(model.parameters(), policy=policy, subgroup_size=SUBGROUP, **POLICY_KW[policy], **HYPER)
    ref, ref_opt = mirror(model)
    for step, (x, y) in enumerate(DATA[:8]):
        opt.zero_grad(set_to_none=True)
        for micro in range(3):
            xm, ym = x[micro % len(x):], y[micro % len(y):]
            lm_loss(model(xm), ym).backward()
        if step % 2:
            edited = next(model.parameters())
            edited.grad[0] = 100.0  # in place: the copy sent during backward is stale now
        teach(model, ref)
        opt.step()
        ref_opt.step()
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")
    assert_off_device_paths_ran(opt)


@pytest.mark.parametrize("reads", READ_PATHS)
@pytest.mark.parametrize("change", ["none", "in place", "replaced", "dropped", "replaced in place"])
def test_every_change_to_a_gradient_after_its_hook_is_seen_by_the_step(change, reads, monkeypatch):
    """step() compares what the hooks sent (address, version) with what `.grad` holds, all params
    at once: a gradient edited in place, replaced by another tensor or dropped after backward is
    taken as it is at the step, and an untouched one is not sent again."""
    use_reads(monkeypatch, reads)
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    ref, ref_opt = mirror(model)
    params = list(model.parameters())
    for step, (x, y) in enumerate(DATA[:4]):
        backward(model, opt, x, y)
        p = params[step % len(params)]
        if change == "in place":
            p.grad.mul_(3.0)
        elif change == "replaced":
            p.grad = p.grad * 3.0
        elif change == "dropped":
            p.grad = None
        elif change == "replaced in place":  # a new tensor, then written: a version of its own
            p.grad = p.grad.clone()
            p.grad.add_(1.0)
        teach(model, ref)
        opt.step()
        ref_opt.step()
        assert opt.stats.regathered == (0 if change in ("none", "dropped") else step + 1)
    for i, (p, r) in enumerate(zip(params, ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")


@pytest.mark.parametrize("reads", READ_PATHS)
def test_frozen_params_get_no_hook_and_are_still_gathered(reads, monkeypatch):
    use_reads(monkeypatch, reads)
    model = make_model()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    frozen.requires_grad_(True)  # unfrozen after the optimizer was made: no hook, gathered at step
    ref, ref_opt = mirror(model)
    for x, y in DATA[:3]:
        backward(model, opt, x, y)
        teach(model, ref)
        opt.step()
        ref_opt.step()
    assert_rel_close(frozen.detach(), ref[0].detach(), what="unfrozen param")


# ---- checkpoints --------------------------------------------------------------------------------


def save(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("policy", on_sized_device(POLICIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_identically(dtype, policy):
    kw = dict(subgroup_size=SUBGROUP, policy=policy, **POLICY_KW[policy], **HYPER)
    if dtype != torch.float32:
        kw["loss_scale"] = LossScaler(init_scale=2.0**8, growth_interval=7)

    def fresh():
        model = make_model(dtype=dtype)
        return model, TieredAdamW(model.parameters(), **{**kw, "loss_scale": copy.deepcopy(kw.get("loss_scale"))})

    model, opt = fresh()
    train(model, opt, DATA)
    uninterrupted = ([p.detach().clone() for p in model.parameters()], flat_state(opt), opt.loss_scale)

    model, opt = fresh()
    train(model, opt, DATA[:20])
    saved_sd = copy.deepcopy(opt.state_dict())
    ckpt = save(model, opt)
    del model, opt
    model, opt = fresh()
    loaded = torch.load(ckpt, weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    # Round trip: the loaded optimizer gives back exactly what was saved.
    again = opt.state_dict()
    assert again["param_groups"] == saved_sd["param_groups"]
    assert again["memtide"] == saved_sd["memtide"]
    assert again["state"].keys() == saved_sd["state"].keys()
    for idx, entry in saved_sd["state"].items():
        assert entry.keys() == again["state"][idx].keys()
        for key, value in entry.items():
            assert torch.equal(value, again["state"][idx][key]), (idx, key)
    if dtype != torch.float32:
        assert "master_param" in saved_sd["state"][0]
    train(model, opt, DATA[20:])
    params, state, scale = [p.detach() for p in model.parameters()], flat_state(opt), opt.loss_scale
    assert scale == uninterrupted[2]
    assert all(torch.equal(a, b) for a, b in zip(params, uninterrupted[0]))
    assert all(torch.equal(a, b) for a, b in zip(state, uninterrupted[1]))
    assert_off_device_paths_ran(opt)


def _everything(model, opt):
    """The optimizer's whole state, the model's params and the loss scale, as plain copies."""
    sd = opt.state_dict()
    state = {idx: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
             for idx, e in sd["state"].items()}
    return (state, copy.deepcopy(sd["param_groups"]), copy.deepcopy(sd["memtide"]),
            [p.detach().clone() for p in model.parameters()], [t.clone() for t in flat_state(opt)])


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _corrupt(sd, what):
    sd = copy.deepcopy(sd)
    first = sd["state"][0]
    if what == "master dtype":
        first["master_param"] = first["master_param"].to(torch.int32)
    elif what == "master shape":
        first["master_param"] = first["master_param"].reshape(-1)[:-1]
    elif what == "step text":
        sd["state"][len(sd["state"]) - 1]["step"] = "abc"  # the last entry: after the others were fine
    elif what == "negative step":
        first["step"] = torch.tensor(-3.0)
    elif what == "fractional step":
        first["step"] = 2.5
    elif what == "exp_avg missing":
        del sd["state"][len(sd["state"]) - 1]["exp_avg"]
    elif what == "exp_avg size":
        first["exp_avg"] = first["exp_avg"].reshape(-1)[:3]
    elif what == "lr":
        sd["param_groups"][0]["lr"] = -1.0
    elif what == "betas":
        sd["param_groups"][0]["betas"] = (0.9, 1.5)
    elif what == "scaler":
        sd["memtide"]["loss_scaler"]["scale"] = float("nan")
    elif what == "tracker":
        sd["memtide"]["loss_scaler"]["growth_tracker"] = -1
    elif what == "groups":
        sd["param_groups"] = sd["param_groups"] * 2
    elif what == "not a dict":
        sd = ["state", "param_groups"]
    return sd


@pytest.mark.parametrize("what, words", [
    ("master dtype", "master_param of param 0 must be a floating-point"),
    ("master shape", "master_param of param 0 has"),
    ("step text", "step of param"),
    ("negative step", "step of param 0 must be a whole number >= 0"),
    ("fractional step", "whole number"),
    ("exp_avg missing", "has no 'exp_avg'"),
    ("exp_avg size", "exp_avg of param 0 has 3 elements"),
    ("lr", "lr must be"),
    ("betas", "betas must be"),
    ("scaler", "loss scaler"),
    ("tracker", "growth_tracker"),
    ("groups", "2 param groups"),
    ("not a dict", "expected a dict"),
])
def test_a_rejected_load_changes_nothing(what, words):
    model = make_model(dtype=torch.bfloat16)
    opt = TieredAdamW(model.parameters(), policy="static", gpu_static_fraction=0.5, subgroup_size=SUBGROUP,
                      loss_scale="dynamic", **HYPER)
    train(model, opt, DATA[:3])
    good = opt.state_dict()
    good = {**good, "state": {k: dict(v) for k, v in good["state"].items()}}
    before = _everything(model, opt)
    with pytest.raises(ValueError, match=words):
        opt.load_state_dict(_corrupt(good, what))
    assert _same(_everything(model, opt), before), what
    train(model, opt, DATA[3:4])  # and it still trains


def test_loads_torch_adamw_state_and_continues_like_it():
    model = make_model()
    ref, ref_opt = mirror(model)
    for x, y in DATA[:5]:
        backward(model, torch.optim.AdamW(model.parameters()), x, y)  # only for the gradients
        teach(model, ref)
        ref_opt.step()
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref):
                p.copy_(r)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for x, y in DATA[5:15]:
        backward(model, opt, x, y)
        teach(model, ref)
        opt.step()
        ref_opt.step()
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")
        assert opt.state[p]["step"].item() == 15


# ---- low precision and loss scaling -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_with_dynamic_loss_scaling(dtype):
    model = make_model(dtype=dtype)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, loss_scale=LossScaler(init_scale=2.0**10,
                      growth_interval=4), **HYPER)
    ref, ref_opt = mirror(model)  # fp32 masters and torch.optim.AdamW, fed the unscaled gradients
    expected_scale, good_run = 2.0**10, 0
    for step, (x, y) in enumerate(DATA[:24]):
        backward(model, opt, x, y)
        assert all(p.grad.dtype == dtype for p in model.parameters())
        inject = step in (9, 10)
        if inject:
            grad = next(model.parameters()).grad
            grad.view(-1)[17] = float("inf") if step == 9 else float("nan")
            before = flat_state(opt)
            before_params = [p.detach().clone() for p in model.parameters()]
            before_steps = [opt.state[p]["step"].item() for p in model.parameters()]
        else:
            teach(model, ref, grad_scale=1.0 / opt.loss_scale)
        opt.step()
        if inject:
            assert opt.last_step_skipped
            assert all(torch.equal(a, b) for a, b in zip(flat_state(opt), before)), "state changed on overflow"
            assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before_params))
            assert [opt.state[p]["step"].item() for p in model.parameters()] == before_steps
            expected_scale, good_run = expected_scale * 0.5, 0
        else:
            assert not opt.last_step_skipped
            ref_opt.step()
            good_run += 1
            if good_run == 4:
                expected_scale, good_run = expected_scale * 2.0, 0
        assert opt.loss_scale == expected_scale, step
    assert opt.stats.skipped == 2 and opt.stats.steps == 22
    opt.sync_state()  # subgroups resident on the GPU hold their newest masters there
    b = opt.buffers
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        lo = sum(q.numel() for q in list(model.parameters())[:i])
        master = b.params[lo:lo + p.numel()].view(p.shape)
        assert_rel_close(master, r.detach(), what=f"master {i}")
        # The model holds the master rounded to its dtype (the kernel writes it in the same pass).
        assert torch.equal(p.detach(), master.to(dtype)), i
        assert opt.state[p]["step"].item() == 22


def test_nonfinite_without_loss_scaling_warns():
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP)
    x, y = DATA[0]
    backward(model, opt, x, y)
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert not opt.last_step_skipped  # as torch.optim.AdamW: the step ran


def test_cpu_gradients_bring_their_own_nonfinite_verdict():
    # The hook's copy of a CPU gradient checks it in the same pass: step() gets a verdict and
    # the engine scans nothing; a NaN/Inf from backward turns it False.
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP)
    x, y = DATA[0]
    backward(model, opt, x, y)
    opt.step()
    assert opt.last_outcome.verdict is True
    opt.zero_grad()
    (lm_loss(model(x), y) * float("inf")).backward()
    for p in model.parameters():  # every gradient the hooks copied is the one backward made
        lo, hi = opt.layout.ranges[opt.gradient_path.index[id(p)]]
        g, buf = p.grad.reshape(-1).float(), opt.buffers.grads[lo:hi]
        assert torch.equal(torch.isnan(g), torch.isnan(buf))
        assert torch.equal(g.nan_to_num(), buf.nan_to_num())
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert opt.last_outcome.verdict is False and opt.stats.regathered == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_cpu_policy_reads_gradients_where_they_lie(dtype, scaled):
    # policy="cpu" in host memory: the step reads each CPU gradient where backward left it (no
    # copy into the flat buffer) and gives the bits the copying path gives (policy "auto" here),
    # with a loss scaler too (its verdict then comes from a scan in the hook), NaN steps included.
    model, ref_model = make_model(dtype=dtype), make_model(dtype=dtype)
    kw = dict(subgroup_size=SUBGROUP, max_grad_norm=1.0, **HYPER)
    if scaled:
        kw["loss_scale"] = LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    opt = TieredAdamW(model.parameters(), policy="cpu", **kw)
    if scaled:
        kw["loss_scale"] = LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    ref = TieredAdamW(ref_model.parameters(), policy="auto", **kw)
    for k, (x, y) in enumerate(DATA[:6]):
        for m, o in ((model, opt), (ref_model, ref)):
            backward(m, o, x, y)
            if k == 3 and scaled:
                next(m.parameters()).grad.view(-1)[0] = float("inf")
        assert opt.gradient_path.direct() and not ref.gradient_path.direct()
        opt.step()
        ref.step()
        assert opt.last_step_skipped == ref.last_step_skipped == (scaled and k == 3)
        assert opt.stats.regathered == (1 if scaled and k >= 3 else 0)
    # Nothing was copied into the flat gradient buffer, not even the first param's gradient,
    # edited in place after its hook ran: step() sends it again, to be read where it lies too.
    assert not opt.buffers.grads.any()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.detach(), r.detach())
    ref.engine.sync_host()  # its (simulated) GPU residents hold the newest state
    for name in ("exp_avg", "exp_avg_sq", "params"):
        assert torch.equal(getattr(opt.buffers, name), getattr(ref.buffers, name)), name


def test_gradients_read_where_they_lie_are_let_go_after_the_step():
    # Held until the next step, they outlived zero_grad(set_to_none=True): the next backward's
    # gradients could not reuse their memory and faulted in fresh pages.
    model = make_model()
    opt = TieredAdamW(model.parameters(), policy="cpu", subgroup_size=SUBGROUP, **HYPER)
    for x, y in DATA[:2]:
        backward(model, opt, x, y)
        assert opt.gradient_path.direct()
        addresses = {p.grad.data_ptr() for p in model.parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.data_ptr() in addresses]


def test_max_grad_norm_matches_clip_grad_norm():
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, max_grad_norm=0.5, **HYPER)
    ref, ref_opt = mirror(model)
    clipped = 0
    for x, y in DATA[:15]:
        backward(model, opt, x, y)
        teach(model, ref)
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=False)
        clipped += float(norm) > 0.5
        opt.step()
        ref_opt.step()
        assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert clipped > 0
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), tol=1e-5, what=f"param {i}")


def test_clipping_set_between_steps_reaches_the_engines_step():
    # max_grad_norm is the step protocol's now: set on the optimizer between steps, it clips the
    # next step as clip_grad_norm_ does; a bad value is refused and changes nothing.
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    ref, ref_opt = mirror(model)
    for k, (x, y) in enumerate(DATA[:6]):
        if k == 2:
            opt.max_grad_norm = 0.5
            for bad in (0, -1.0, float("nan"), "0.5", True):
                with pytest.raises(ValueError, match="max_grad_norm"):
                    opt.max_grad_norm = bad
        backward(model, opt, x, y)
        teach(model, ref)
        if k >= 2:
            norm = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=False)
            assert opt.max_grad_norm == 0.5
        opt.step()
        ref_opt.step()
        assert (opt.last_outcome.grad_norm is not None) == (k >= 2)
        if k >= 2:
            assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
            assert opt.last_outcome.clip < 1.0
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), tol=1e-5, what=f"param {i}")


# ---- param groups, schedulers, partial gradients ------------------------------------------------


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1, lr=2e-3), dict(params=no_decay, weight_decay=0.0)]


def test_param_groups_and_lr_scheduler():
    model = make_model()
    groups = two_groups(model)
    opt = TieredAdamW(groups, subgroup_size=SUBGROUP, **HYPER)
    ref, ref_opt = mirror(model, groups=groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    for x, y in DATA[:20]:
        backward(model, opt, x, y)
        teach(model, ref)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == pytest.approx(2e-3 / 21)
    params = list(model.parameters())
    for i, (p, r) in enumerate(zip(params, ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")
    # Changing the groups' values matters: the same run with one shared lr ends elsewhere.
    other = make_model()
    other_opt = TieredAdamW(other.parameters(), subgroup_size=SUBGROUP, **HYPER)
    train(other, other_opt, DATA[:20])
    assert not torch.equal(params[0].detach(), next(other.parameters()).detach())


def test_params_without_gradients_are_left_alone():
    model = make_model()
    frozen = model.blocks.layers[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, **HYPER)
    ref, ref_opt = mirror(model)
    before = [p.detach().clone() for p in frozen.parameters()]
    for x, y in DATA[:10]:
        backward(model, opt, x, y)
        teach(model, ref)
        opt.step()
        ref_opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(frozen.parameters(), before))
    assert all(p not in opt.state for p in frozen.parameters())
    assert len(opt.state) == len(ref_opt.state)
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")


def test_add_param_group_keeps_state():
    model = make_model()
    groups = two_groups(model)
    opt = TieredAdamW([groups[0]], subgroup_size=SUBGROUP, **HYPER)
    ref, ref_opt = mirror(model, groups=groups[:1])
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for step, (x, y) in enumerate(DATA[:10]):
        if step == 4:
            opt.add_param_group(groups[1])
            ref_opt.add_param_group(dict(groups[1], params=[ref[index[id(p)]] for p in groups[1]["params"]]))
        backward(model, opt, x, y)
        teach(model, ref)
        opt.step()
        ref_opt.step()
    assert len(opt.param_groups) == 2
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")
        assert opt.state[p]["step"].item() == ref_opt.state[r]["step"].item()


@pytest.mark.parametrize("reads", READ_PATHS)
@pytest.mark.parametrize("how", ["params", "groups"])
def test_params_swapped_in_after_construction_are_followed(how, reads, monkeypatch):
    # Accelerate's FSDP2 prepare builds the sharded params after the optimizer and assigns each
    # group's "params" anew ("params"); a wrapper may also replace the list of groups ("groups").
    use_reads(monkeypatch, reads)
    old = make_model()
    opt = TieredAdamW(two_groups(old), subgroup_size=SUBGROUP, **HYPER)
    model = make_model()  # the same values in new tensors
    new = dict(zip(map(id, old.parameters()), model.parameters()))
    if how == "params":
        for group in opt.param_groups:
            group["params"] = [new[id(p)] for p in group["params"]]
    else:
        opt.param_groups = [dict(g, params=[new[id(p)] for p in g["params"]]) for g in opt.param_groups]
    ref, ref_opt = mirror(model, groups=opt.param_groups)
    for x, y in DATA[:5]:
        backward(model, opt, x, y)
        teach(model, ref)
        opt.step()
        ref_opt.step()
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        assert_rel_close(p.detach(), r.detach(), what=f"param {i}")
    assert all(p not in opt.state for p in old.parameters())
    # Assigned params are hooked before the next backward; a new list of groups is seen at the
    # step, which copies that backward's gradients itself.
    assert opt.stats.regathered == (0 if how == "params" else len(list(model.parameters())))


def test_closure_and_zero_grad():
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP)
    x, y = DATA[0]

    def closure():
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and opt.stats.steps == 1
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # no gradients: nothing to do
    assert opt.stats.steps == 1


def test_attach_marks_phases():
    model = make_model()
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP)
    hooks = opt.attach(model)
    start = memtide.phase_report()["iterations"]
    for x, y in DATA[:3]:
        loss = lm_loss(model(x), y)
        assert memtide.phase_report()["current"] == "forward"
        opt.zero_grad()
        loss.backward()
        assert memtide.phase_report()["current"] == "backward"
        opt.step()
        assert memtide.phase_report()["current"] == "update"
    model(DATA[0][0])  # the next forward closes the third iteration
    report = memtide.phase_report()
    assert report["iterations"] == start + 3
    last = report["history"][-1]["phases"]
    assert all(last[name]["seen"] and last[name]["duration_ns"] > 0 for name in ("forward", "backward", "update"))
    hooks.remove()
    memtide.mark_phase("other")
    model(DATA[0][0])
    assert memtide.phase_report()["current"] == "other"


# ---- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(policy="gpu"), "'cpu', 'static', 'interleaved', 'auto'"),
    (dict(subgroup_size=0), "subgroup_size"),
    (dict(subgroup_size=1.5), "subgroup_size"),
    (dict(gpu_static_fraction=1.5), "gpu_static_fraction"),
    (dict(policy="interleaved", k=0), "k must be"),
    (dict(policy="interleaved", k=0.5), "stride >= 1"),
    (dict(policy="cpu", k=2), "policy 'cpu'"),
    (dict(policy="static", k=2), "not 'static'"),
    (dict(loss_scale="auto"), "loss_scale 'auto'"),
    (dict(loss_scale=-1.0), "loss_scale"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(lr=-1.0), "lr"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(eps=float("nan")), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        TieredAdamW(make_model().parameters(), **kw)


def test_absurdly_small_subgroups_are_refused_with_the_reason():
    big = torch.nn.Parameter(torch.zeros(memtide.MAX_SUBGROUPS + 10))
    with pytest.raises(ValueError, match=f"at most {memtide.MAX_SUBGROUPS} are supported: use subgroup_size >= 2"):
        TieredAdamW([big], subgroup_size=1)
    TieredAdamW([big], subgroup_size=2)  # the size it names is accepted


def test_bad_params_and_state():
    with pytest.raises(ValueError, match="float64"):
        TieredAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="one low-precision"):
        TieredAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)),
                     torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="LossScaler: growth_interval"):
        LossScaler(growth_interval=0)
    model = make_model()
    opt = TieredAdamW(model.parameters())
    opt.param_groups[0]["lr"] = float("inf")  # as a broken scheduler would
    with pytest.raises(ValueError, match="lr must be"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    sd = opt.state_dict()
    sd["param_groups"] = sd["param_groups"] * 2
    with pytest.raises(ValueError, match="2 param groups"):
        opt.load_state_dict(sd)
    assert set(POLICIES) == set(POLICY_KW)


def test_scheduler_sees_model_changes_between_steps():
    """GPU-static residents stay on the device between steps; a model checkpoint loaded into the
    (CPU, aliased) params between steps must still win over those device copies."""
    if engine_unavailable(1):
        pytest.skip(engine_unavailable(1))
    checkpoint = make_model(seed=3).state_dict()
    finals = []
    for cls in (TieredAdamW, CpuEngineAdamW):
        model = make_model()
        opt = cls(model.parameters(), policy="static", gpu_static_fraction=0.5, subgroup_size=SUBGROUP, **HYPER)
        train(model, opt, DATA[:3])
        model.load_state_dict(checkpoint)
        train(model, opt, DATA[3:6])
        finals.append((flat_state(opt), [p.detach().clone() for p in model.parameters()]))
        if cls is TieredAdamW:
            assert opt.last_report.params_gpu_static > 0
    (state, params), (ref_state, ref_params) = finals
    assert all(torch.equal(a, b) for a, b in zip(state, ref_state))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_an_optimizer_of_empty_params_steps_and_plans_nothing():
    """Params of no elements leave the engine out; the optimizer still steps, plans and saves."""
    p = torch.nn.Parameter(torch.zeros(0))
    opt = TieredAdamW([p])
    p.grad = torch.zeros(0)
    opt.step()
    assert opt.engine is None and opt.plan.placement == () and "0 subgroups" in opt.plan.summary()
    opt.load_state_dict(opt.state_dict())
    assert "nothing to update" in repr(opt)


def test_where_the_engine_cannot_run_the_optimizer_says_why():
    """A timing-only runtime (a phantom SimDevice) stores no state: TieredAdamW refuses, naming it."""
    import subprocess
    import sys

    code = ("import torch\nfrom memtide.optim import TieredAdamW\n"
            "try:\n    TieredAdamW(torch.nn.Linear(4, 4).parameters())\n"
            "except ValueError as e:\n    print(e)\n")
    env = dict(os.environ, MEMTIDE_SIM_PHANTOM="true", MEMTIDE_DEVICE="sim")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "phantom mode (MEMTIDE_SIM_PHANTOM=true)" in out.stdout, out.stdout
