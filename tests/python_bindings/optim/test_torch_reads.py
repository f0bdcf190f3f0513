"""The step's native reads of its params (memtide.optim.torch_reads, torch_bridge/torch_reads.cpp):
the values torch gives Python, read in one call; whatever cannot be read so is left to Python; and
the step reads nothing else while nothing changed, and follows what did."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memtide import torch_bridge  # noqa: E402
from memtide.optim import TieredAdamW, torch_reads  # noqa: E402
from memtide.optim.gradients import GradientPath  # noqa: E402
from memtide_testing import clean_env, run_python, use_reads  # noqa: E402


@pytest.fixture
def native(monkeypatch):
    use_reads(monkeypatch, "native")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def test_the_native_reads_are_built_wherever_the_bridge_is():
    # Both compile against the installed torch at install time; the reads also need torch's Python
    # headers. Where the bridge built and the reads did not, their status file says why.
    if not torch_bridge.build_status().startswith("built against torch "):
        pytest.skip(f"no bridge here: {torch_bridge.build_status()}")
    assert torch_reads.build_status() == torch_bridge.build_status()
    assert torch_reads.status() == "native"


def test_native_reads_are_what_torch_gives_python(native):
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2)), torch.randn(4)]
    params[0].grad = torch.randn(5)
    params[1].grad = torch.randn(8)[2:].view(3, 2)  # a view: its address is not its storage's
    reads = torch_reads.for_params(params)

    def expected():
        return ([p.data_ptr() for p in params], [p._version for p in params],
                [torch_reads.NO_GRAD if p.grad is None else p.grad.data_ptr() for p in params],
                [torch_reads.NO_GRAD if p.grad is None else p.grad._version for p in params])

    def read():
        assert reads.read()
        return list(reads.data), list(reads.version), list(reads.grad_data), list(reads.grad_version)

    assert read() == expected()
    with torch.no_grad():
        params[0].mul_(2.0)  # the param's version
        params[1].grad.add_(1.0)  # the gradient's
    params[2].data = torch.zeros(4)  # another storage
    params[0].grad = None
    before = read()
    assert before == expected()
    assert before[1][0] == 1 and before[3][1] == 1 and before[2][0] == torch_reads.NO_GRAD


def test_what_native_reads_cannot_read_is_left_to_python(native):
    class Marked(torch.Tensor):
        pass

    assert torch_reads.for_params([torch.nn.Parameter(torch.randn(3)), torch.randn(3).as_subclass(Marked)]) is None
    sparse = torch.nn.Parameter(torch.randn(3, 3))
    sparse.grad = torch.randn(3, 3).to_sparse()
    assert not torch_reads.for_params([torch.randn(2), sparse]).read()
    with torch.inference_mode():
        inference = torch.ones(3)  # no version counter: torch raises in Python too
    assert not torch_reads.for_params([inference]).read()
    with pytest.raises(RuntimeError):
        inference._version


def test_the_step_reads_nothing_in_python_while_nothing_changed_and_follows_what_did(native, monkeypatch):
    m, ref_m = model(), model()
    opt = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu", subgroup_size=500)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    checks, loops = [], []
    bindings, gather_each = TieredAdamW._bindings, GradientPath._gather_each
    monkeypatch.setattr(TieredAdamW, "_bindings", lambda self: checks.append(1) or bindings(self))
    monkeypatch.setattr(GradientPath, "_gather_each", lambda self: loops.append(1) or gather_each(self))
    g = torch.Generator().manual_seed(1)
    per_step = []
    for step in range(8):
        x = torch.randn(8, 16, generator=g)
        for net, o in ((m, opt), (ref_m, ref)):
            net(x).square().mean().backward()
        if step == 4:
            first = next(m.parameters())
            first.grad.mul_(0.5)  # after its hook: the step must send it again
            next(ref_m.parameters()).grad.mul_(0.5)
        del checks[:], loops[:]
        opt.step()
        ref.step()
        per_step.append((len(checks), len(loops)))
        opt.zero_grad()
        ref.zero_grad()
        if step == 5:
            for net in (m, ref_m):
                for p in net.parameters():
                    p.data = p.data.clone()  # as HF Trainer's model.to("cpu:0")
    # The first step takes what "nothing moved" reads like; after that only a change is read in
    # Python: the edited gradient at step 4, the replaced storages at step 6 (and the step after,
    # whose read the optimizer's own rebinding changed).
    assert per_step[0] == (1, 0)
    assert [s for s, (c, _) in enumerate(per_step) if c] == [0, 6, 7]
    assert [s for s, (_, lp) in enumerate(per_step) if lp] == [4]
    assert opt.stats.followed == len(list(m.parameters()))
    for p, r in zip(m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)


def test_a_library_for_another_torch_or_one_that_does_not_load_is_not_used(monkeypatch, tmp_path):
    try:
        monkeypatch.setattr(torch_reads, "build_status", lambda: "built against torch 0.0.1")
        torch_reads.reset()
        assert torch_reads.status().startswith("python: built against torch 0.0.1, but torch ")
        assert torch_reads.for_params([torch.nn.Parameter(torch.ones(2))]) is None
        broken = tmp_path / torch_reads.LIBRARY
        broken.write_bytes(b"not a library")
        monkeypatch.setattr(torch_reads, "build_status", lambda: f"built against torch {torch.__version__}")
        monkeypatch.setattr(torch_reads, "library_path", lambda: str(broken))
        torch_reads.reset()
        assert torch_reads.status().startswith(f"python: {broken} does not load")
        m = model()
        opt = TieredAdamW(m.parameters(), policy="cpu")
        m(torch.ones(2, 16)).sum().backward()
        opt.step()  # and trains, reading in Python
        assert opt._reads is None and opt.stats.steps == 1
    finally:
        monkeypatch.undo()
        torch_reads.reset()


def test_memtide_torch_reads_false_reads_in_python():
    script = ("import torch; from memtide.optim import torch_reads, TieredAdamW\n"
              "m = torch.nn.Linear(4, 4); opt = TieredAdamW(m.parameters(), policy='cpu')\n"
              "m(torch.ones(2, 4)).sum().backward(); opt.step()\n"
              "print(torch_reads.status(), opt._reads is None, opt.stats.steps)\n")
    out = run_python(["-c", script], env=clean_env(MEMTIDE_TORCH_READS="false"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python:", "MEMTIDE_TORCH_READS=false", "True", "1"]
