"""memtide.optim.checkpoint: state dicts whose tensors are the optimizer's own."""

from __future__ import annotations

import copy

import pytest
import torch

from memtide.optim import LossScaler, TieredAdamW


def _trained(policy: str = "cpu", dtype: torch.dtype = torch.float32, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)
    opt = TieredAdamW(model.parameters(), **{"lr": 1e-2, "policy": policy, "subgroup_size": 16, **kwargs})
    for _ in range(2):
        opt.scale_loss(model(torch.randn(3, 6).to(dtype)).square().sum()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_loading_its_own_state_dict_keeps_the_state():
    # state_dict() hands out views of the live buffers (as torch's does); loading them back must
    # not zero the moments before reading them (torch.distributed.checkpoint loads in place into
    # exactly these views, then calls load_state_dict with them).
    model, opt = _trained()
    moments = (opt.buffers.exp_avg.clone(), opt.buffers.exp_avg_sq.clone())
    assert float(moments[0].abs().sum()) > 0
    opt.load_state_dict(opt.state_dict())
    assert torch.equal(opt.buffers.exp_avg, moments[0])
    assert torch.equal(opt.buffers.exp_avg_sq, moments[1])
    # And it goes on as an uninterrupted twin does.
    twin_model, twin = _trained()
    for m, o in ((model, opt), (twin_model, twin)):
        torch.manual_seed(5)
        m(torch.randn(3, 6)).square().sum().backward()
        o.step()
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)


# -- a rejected load changes nothing --------------------------------------------------------------

BAD = 2  # the param whose entry is spoiled: the second Linear's weight, (2, 5), in group 0
MKLDNN = torch.backends.mkldnn.is_available()


class _Subclass(torch.Tensor):
    """A tensor subclass, as a wrapper library could leave in a state dict."""


def _setup(config: str):
    """(model, optimizer, state dict to spoil): the optimizer's own dict (fp32, or an fp16 model with
    master params and a loss scaler), or torch.optim.AdamW's dict of the same model."""
    if config == "fp16":
        model, opt = _trained(dtype=torch.float16, loss_scale=LossScaler(init_scale=2.0 ** 8))
        assert len(opt.state) == 4 and opt.scaler.growth_tracker == 2
        return model, opt, copy.deepcopy(opt.state_dict())
    model, opt = _trained()
    if config == "fp32":
        return model, opt, copy.deepcopy(opt.state_dict())
    torch.manual_seed(0)
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    adamw = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(2):
        twin(torch.randn(3, 6)).square().sum().backward()
        adamw.step()
        adamw.zero_grad()
    return model, opt, copy.deepcopy(adamw.state_dict())


def _frozen(obj):
    """A copy of obj whose tensors are clones (compared bit for bit by _same)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _frozen(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_frozen(v) for v in obj)
    return copy.deepcopy(obj)


def _same(a, b, where="state"):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), (where, a, b)


def _everything(model, opt):
    """The optimizer's whole state, as seen from outside and inside, and the model's params."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    b = opt.buffers
    return _frozen({
        "state_dict": opt.state_dict(),
        "params": params,
        "buffers": [t for t in (b.params, b.exp_avg, b.exp_avg_sq, b.lowp) if t is not None],
        "steps": torch.from_dlpack(opt.engine.steps()),
        "state": {index[id(p)]: dict(s) for p, s in opt.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "group params": [[index[id(p)] for p in g["params"]] for g in opt.param_groups],
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
    })


def _one_more_step(model, opt):
    torch.manual_seed(5)
    dtype = next(model.parameters()).dtype
    opt.scale_loss(model(torch.randn(3, 6).to(dtype)).square().sum()).backward()
    opt.step()
    opt.zero_grad()


def _entry(key):
    def spoil(make):
        def apply(sd):
            sd["state"][BAD][key] = make(sd["state"][BAD][key])
        return apply
    return spoil


def _group(key, value):
    def apply(sd):
        sd["param_groups"][0][key] = value
    return apply


def _scaler(key, value):
    def apply(sd):
        sd["memtide"]["loss_scaler"][key] = value
    return apply


def _moment_cases():
    cases = []
    for config, key in (("fp32", "exp_avg"), ("fp32", "exp_avg_sq"), ("fp16", "master_param"),
                        ("torch", "exp_avg"), ("torch", "exp_avg_sq")):
        spoil = _entry(key)
        for name, make, words in (
                ("meta", lambda v: torch.empty_like(v, device="meta"), ["meta"]),
                ("sparse_coo", lambda v: v.to_sparse(), ["sparse_coo"]),
                ("sparse_csr", lambda v: v.to_sparse_csr(), ["sparse_csr"]),
                ("mkldnn", lambda v: v.float().to_mkldnn(), ["mkldnn"]),
                ("nested", lambda v: torch.nested.nested_tensor([v]), ["nested"]),
                ("subclass", lambda v: v.as_subclass(_Subclass), ["_Subclass"]),
                ("int32", lambda v: v.to(torch.int32), ["int32"]),
                ("bool", lambda v: v.bool(), ["bool"]),
                ("complex64", lambda v: v.to(torch.complex64), ["complex64"]),
                ("list", lambda v: v.tolist(), ["list"])):
            marks = [pytest.mark.skipif(not MKLDNN, reason="no mkldnn")] if name == "mkldnn" else []
            cases.append(pytest.param(config, spoil(make), [f"{key} of param {BAD} must be a floating-point tensor",
                                                            "dense", "CPU or a CUDA device", *words],
                                      id=f"{config}-{key}-{name}", marks=marks))
    return cases


def _other_cases():
    step = _entry("step")
    cases = [
        ("fp32", step(lambda v: "3"), ["step", f"param {BAD}", "'3'"], "step-str"),
        ("fp32", step(lambda v: [3]), ["step", f"param {BAD}", "[3]"], "step-list"),
        ("fp32", step(lambda v: torch.tensor(3.0, device="meta")), ["step", f"param {BAD}", "meta"], "step-meta"),
        ("torch", step(lambda v: torch.tensor(3.0, device="meta")), ["step", f"param {BAD}", "meta"],
         "torch-step-meta"),
        ("fp32", step(lambda v: torch.tensor([3.0, 3.0])), ["step", f"param {BAD}"], "step-two-elements"),
        ("fp32", step(lambda v: torch.tensor(3.0).to_sparse()), ["step", f"param {BAD}", "sparse"],
         "step-sparse"),
        ("fp32", _group("lr", "0.1"), ["param group 0", "lr", "'0.1'", "real number"], "lr-str"),
        ("torch", _group("lr", "0.1"), ["param group 0", "lr", "'0.1'", "real number"], "torch-lr-str"),
        ("fp32", _group("lr", True), ["param group 0", "lr", "True", "real number"], "lr-bool"),
        ("fp32", _group("lr", float("nan")), ["param group 0", "lr", "nan"], "lr-nan"),
        ("fp32", _group("lr", torch.tensor(0.1, device="meta")), ["param group 0", "lr", "meta"], "lr-meta"),
        ("fp32", _group("lr", torch.tensor([0.1, 0.2])), ["param group 0", "lr", "real number"], "lr-two-elements"),
        ("fp32", _group("lr", torch.tensor(1 + 1j)), ["param group 0", "lr", "real number"], "lr-complex"),
        ("fp32", _group("betas", (0.9,)), ["param group 0", "betas", "(0.9,)", "pair"], "betas-one"),
        ("fp32", _group("betas", (0.9, 0.99, 0.999)), ["param group 0", "betas", "0.999", "pair"], "betas-three"),
        ("fp32", _group("betas", ("0.9", "0.99")), ["param group 0", "betas", "'0.9'", "pair"], "betas-str"),
        ("fp32", _group("betas", "ab"), ["param group 0", "betas", "'ab'", "pair"], "betas-one-str"),
        ("fp32", _group("weight_decay", None), ["param group 0", "weight_decay", "None", "real number"], "wd-none"),
        ("fp32", _group("eps", "1e-8"), ["param group 0", "eps", "'1e-8'", "real number"], "eps-str"),
        ("fp16", _scaler("dynamic", "no"), ["loss scaler", "dynamic", "'no'"], "scaler-dynamic-str"),
        ("fp16", _scaler("scale", True), ["loss scaler", "scale", "True"], "scaler-scale-bool"),
    ]
    return [pytest.param(config, apply, words, id=name) for config, apply, words, name in cases]


@pytest.mark.parametrize("config, spoil, words", _moment_cases() + _other_cases())
def test_a_rejected_load_changes_nothing_and_training_goes_on_as_if_it_never_came(config, spoil, words):
    model, opt, state = _setup(config)
    sane = copy.deepcopy(state)
    spoil(state)
    before = _everything(model, opt)
    with pytest.raises(ValueError) as refused:
        opt.load_state_dict(state)
    for w in words:
        assert w in str(refused.value), (w, str(refused.value))
    _same(_everything(model, opt), before)
    # It trains on as a twin that never saw the load does.
    twin_model, twin, _ = _setup(config)
    for m, o in ((model, opt), (twin_model, twin)):
        _one_more_step(m, o)
    _same(_everything(model, opt), _everything(twin_model, twin))
    # Unspoiled, the same dict loads.
    _setup(config)[1].load_state_dict(sane)


def _steps_alike(model, opt, twin_model, twin, groups=True):
    """Both hold the same state, and the next step leaves them the same again."""
    for _ in range(2):
        a, b = _everything(model, opt), _everything(twin_model, twin)
        if not groups:
            for d in (a, b):
                d.pop("groups")
                for g in d["state_dict"]["param_groups"]:
                    g.pop("lr")
        _same(a, b)
        for m, o in ((model, opt), (twin_model, twin)):
            _one_more_step(m, o)


@pytest.mark.parametrize("config, key, dtype", [("fp32", "exp_avg", torch.float64),
                                                ("fp32", "exp_avg_sq", torch.bfloat16),
                                                ("fp32", "exp_avg", torch.float16),
                                                ("torch", "exp_avg_sq", torch.float64),
                                                ("fp16", "master_param", torch.float64),
                                                ("fp16", "exp_avg", torch.bfloat16)])
def test_a_floating_state_tensor_of_another_precision_is_converted_as_torch_converts_it(config, key, dtype):
    # torch.optim.Optimizer.load_state_dict casts floating state to its param's dtype; memtide's
    # state is float32 whatever the param (moments and master params alike), so it casts to that.
    model, opt, state = _setup(config)
    exact = state["state"][BAD][key]
    assert exact.dtype == torch.float32
    other = (exact.double() * (1 + 2.0 ** -40)).to(dtype)  # float64: bits that float32 rounds away
    state["state"][BAD][key] = other
    converted = copy.deepcopy(state)
    converted["state"][BAD][key] = other.to(torch.float32)
    if key != "master_param" and config != "fp16":  # torch.optim.AdamW itself converts it so
        torch.manual_seed(0)
        reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        adamw.load_state_dict(copy.deepcopy({"state": state["state"], "param_groups": state["param_groups"]}))
        _same(adamw.state[list(reference.parameters())[BAD]][key], converted["state"][BAD][key])
    opt.load_state_dict(state)
    _same(opt.state_dict()["state"][BAD][key], converted["state"][BAD][key])
    twin_model, twin, _ = _setup(config)
    twin.load_state_dict(converted)
    _steps_alike(model, opt, twin_model, twin)


@pytest.mark.parametrize("config", ["fp32", "torch"])
def test_a_tensor_lr_loads_and_trains_as_the_same_number(config):
    # torch.optim takes a one-element tensor lr; a state dict holding one loads as one.
    model, opt, state = _setup(config)
    twin_model, twin, twin_state = _setup(config)
    state["param_groups"][0]["lr"] = torch.tensor(2.0 ** -7)  # exact in float32 and float64 alike
    twin_state["param_groups"][0]["lr"] = 2.0 ** -7
    opt.load_state_dict(state)
    twin.load_state_dict(twin_state)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and float(opt.param_groups[0]["lr"]) == 2.0 ** -7
    _steps_alike(model, opt, twin_model, twin, groups=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("key", ["exp_avg", "step"])
def test_state_on_a_cuda_device_loads_as_its_cpu_copy_would(key):
    # As torch.optim moves state to its param's device, a checkpoint saved on a GPU loads into
    # an optimizer of CPU params (and the other way round).
    model, opt, state = _setup("fp32")
    twin_model, twin, twin_state = _setup("fp32")
    state["state"][BAD][key] = torch.as_tensor(state["state"][BAD][key]).cuda()
    opt.load_state_dict(state)
    twin.load_state_dict(twin_state)
    _steps_alike(model, opt, twin_model, twin)


def test_a_dtensor_whose_local_shard_has_another_shape_is_refused_changing_nothing(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    def lying(whole):  # the param's global shape, but a local shard of another: nothing to read from
        if isinstance(whole, DTensor):
            whole = whole.to_local()  # on one rank, the whole
        return DTensor.from_local(whole[:1].clone(), one_rank_mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                  stride=whole.stride())

    # A plain param: the DTensor's global shape matches, its shard is what would be copied.
    model, opt, state = _setup("fp32")
    state["state"][BAD]["exp_avg"] = lying(state["state"][BAD]["exp_avg"])
    before = _everything(model, opt)
    with pytest.raises(ValueError, match=rf"exp_avg of param {BAD} is a DTensor whose local shard is \(1, 5\).*"
                                         r"\(2, 5\).*accepted"):
        opt.load_state_dict(state)
    _same(_everything(model, opt), before)
    twin_model, twin, _ = _setup("fp32")
    _steps_alike(model, opt, twin_model, twin)

    # FSDP2's params (DTensors; on one rank, each shard is the whole param).
    torch.manual_seed(0)
    sharded = fully_shard(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)),
                          mesh=one_rank_mesh)
    opt = TieredAdamW(sharded.parameters(), lr=1e-2, policy="cpu", subgroup_size=16)
    _one_more_step(sharded, opt)
    state = opt.state_dict()
    before = _everything(sharded, opt)
    state["state"][BAD]["exp_avg_sq"] = lying(state["state"][BAD]["exp_avg_sq"])
    with pytest.raises(ValueError, match=rf"exp_avg_sq of param {BAD} must be a DTensor sharded as the param .*"
                                         r"\(2, 5\).*a DTensor whose shard is \(1, 5\)"):
        opt.load_state_dict(state)
    _same(_everything(sharded, opt), before)


def test_fsdp2_with_an_nvme_tier_is_refused_saying_fsdp2_owns_the_shard(one_rank_mesh, tmp_path):
    # The refusal used to say "params must be fp16/bf16 on the optimizer's device ... param 0 is
    # torch.bfloat16 on cpu": it contradicted itself. An FSDP2 shard cannot be written in place.
    from torch.distributed.fsdp import fully_shard

    from memtide_testing import direct_io_dir

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(torch.bfloat16)
    fully_shard(model, mesh=one_rank_mesh)
    n = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError) as e:
        TieredAdamW(model.parameters(), subgroup_size=4096, host_budget=10 * n + 2 * 12 * 4096,
                    nvme_dir=direct_io_dir(str(tmp_path)))
    message = str(e.value)
    assert "FSDP2 shard" in message and "owns the shard's storage" in message, message
    assert "must be fp16/bf16 on the optimizer's device" not in message
