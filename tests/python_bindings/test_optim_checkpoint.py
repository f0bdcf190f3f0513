"""memtide.optim.checkpoint: state dicts whose tensors are the optimizer's own."""

from __future__ import annotations

import torch

from memtide.optim import TieredAdamW


def _trained(policy: str = "cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = TieredAdamW(model.parameters(), lr=1e-2, policy=policy, subgroup_size=16)
    for _ in range(2):
        model(torch.randn(3, 6)).square().sum().backward()
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
