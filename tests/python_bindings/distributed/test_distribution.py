"""Distribution: the one object of TieredAdamW that knows how its params are spread over ranks,
and what follows (in one process: plain params, and FSDP2's DTensors over a one-rank mesh)."""

from __future__ import annotations

import torch

from memtide.optim import TieredAdamW
from memtide.optim.distributed import Distribution


def _train(model, opt, steps=3):
    for _ in range(steps):
        model(torch.ones(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_plain_params_are_one_process_and_views_of_the_buffers():
    model = torch.nn.Linear(6, 5)
    opt = TieredAdamW(model.parameters(), policy="cpu")
    d = opt.distribution
    assert isinstance(d, Distribution) and d.kind == "none" and d.ddp is None
    assert d.protocol_kwargs() == dict(sharded=[], sum_sharded=None, any=None)
    assert all(d.can_view(p, opt.buffers.params) for p in model.parameters())
    assert opt.layout.copied == []  # nothing to write back: every param is a view
    assert opt.gradient_path.direct()  # one process, policy cpu: gradients read where they lie


def test_fsdp2_shards_are_wrapped_written_back_and_summed_over_the_shard_group(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)),
                        mesh=one_rank_mesh)
    opt = TieredAdamW(model.parameters(), policy="cpu", max_grad_norm=0.5)
    d = opt.distribution
    assert d.kind == "fsdp2"
    kwargs = d.protocol_kwargs()
    assert kwargs["sharded"] == [True] * 4 and callable(kwargs["sum_sharded"]) and callable(kwargs["any"])
    assert kwargs["sum_sharded"](2.5) == 2.5  # one rank: the sum is its own
    assert not any(d.can_view(p, opt.buffers.params) for p in model.parameters())
    assert opt.layout.copied == [0, 1, 2, 3]  # FSDP2 owns each shard's storage: written back
    assert not opt.gradient_path.direct()
    _train(model, opt)
    for i, p in enumerate(model.parameters()):
        lo, hi = opt.layout.ranges[i]
        assert torch.equal(d.local(p).reshape(-1), opt.buffers.params[lo:hi])  # the step's values, written back
        state = opt.state[p]["exp_avg"]
        assert isinstance(state, DTensor) and state.placements == p.placements  # wrapped as the param is
    assert opt.last_grad_norm is not None  # clipped by the norm the protocol summed over the shard group


def test_the_ddp_model_found_once_survives_a_rebuild():
    class Found:  # stands in for DdpGradients: what the distribution carries is the object itself
        params = set()

    model = torch.nn.Linear(6, 5)
    opt = TieredAdamW(model.parameters(), policy="cpu")
    found = Found()
    opt.distribution.ddp = found
    assert opt.distribution.kind == "ddp"
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # a new layout, a new Distribution
    assert opt.distribution.ddp is found and opt.distribution.kind == "ddp"
    assert not opt.gradient_path.direct()  # DDP's reduced gradients go into the buffer
