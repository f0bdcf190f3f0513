"""The layer window (memtide.window.LayerWindow, STRONGHOLD): training with only a window of
blocks in device memory gives bit for bit what training without it gives.

torch runs on the CPU here, where "device" and "host" are both host memory: the window still
keeps each block's parameters in its own home buffer, copies them into a small pool of buffers
that it reuses round robin (so a block read from the wrong buffer computes garbage), sends
gradients home as backward goes on, and resolves saved tensors against the buffers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

import memtide  # noqa: E402
import memtide.window as window_module  # noqa: E402
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss  # noqa: E402
from memtide.window import LayerWindow  # noqa: E402
from memtide_testing import one_torch_thread, same  # noqa: E402,F401

LAYERS = 6


def make_model(ckpt: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=64, heads=4, layers=LAYERS, seq=16)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if ckpt:
        for layer in model.blocks.layers:
            forward = layer.forward
            layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(forward)
    return model


def train(size=None, *, steps=3, micro=1, clip=None, scale=None, ckpt=False, evict=False, prepare=None,
          **window_args):
    """Trains TinyGPT (changed first by `prepare`); returns its final parameters (and the window)."""
    model = make_model(ckpt)
    if prepare is not None:
        prepare(model)
    window = LayerWindow(model.blocks.layers, size=size, **window_args) if size is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if window is not None:
        window.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(micro):
            x, y = arithmetic_batch(gen, 8, 16, 32)
            loss = lm_loss(model(x), y) / micro
            if scale is not None:
                loss = loss * scale
            if evict and window is not None:
                window.evict_all()
            loss.backward()
        if scale is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not all(torch.isfinite(g).all() for g in grads):
                opt.zero_grad(set_to_none=True)  # dynamic loss scaling: skip the step
                continue
            for g in grads:
                g.div_(scale)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], window


@pytest.mark.parametrize("size", [1, 2, 3, LAYERS])
def test_training_with_the_window_equals_training_without(size):
    reference, _ = train()
    params, window = train(size)
    assert same(reference, params)
    assert window.size == size
    if size < LAYERS:
        # The window did move blocks: each forward and each backward fetched the blocks outside it.
        assert window.stats["fetches"] > LAYERS and window.stats["grad_offloads"] == 3 * LAYERS


def test_accumulation_clipping_and_loss_scaling_are_exact():
    reference, _ = train(micro=2, clip=0.5, scale=1024.0)
    params, _ = train(2, micro=2, clip=0.5, scale=1024.0)
    assert same(reference, params)


def test_activation_checkpointing_is_exact():
    reference, _ = train()
    params, _ = train(2, ckpt=True)
    assert same(reference, params)


def test_blocks_sent_home_between_forward_and_backward_come_back_right():
    reference, _ = train()
    params, _ = train(2, evict=True)
    assert same(reference, params)


def test_saved_parameter_views_must_follow_their_block(monkeypatch):
    # The check above can fail: without the saved-tensor redirection, a block that comes back
    # into another buffer computes its backward from whatever that buffer held.
    reference, _ = train()
    monkeypatch.setattr(window_module.LayerWindow, "_pack", lambda self, t: t)
    params, _ = train(2, evict=True)
    assert not same(reference, params)


def test_between_iterations_parameters_and_gradients_live_at_home():
    model = make_model()
    window = LayerWindow(model.blocks.layers, size=2)
    gen = torch.Generator().manual_seed(1)
    x, y = arithmetic_batch(gen, 8, 16, 32)
    lm_loss(model(x), y).backward()
    assert window.resident() == []
    for b, layer in enumerate(model.blocks.layers):
        for p in layer.parameters():
            home = window._host[b]
            assert p.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
            assert p.grad is not None and p.grad.untyped_storage().data_ptr() != home.untyped_storage().data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window.attach_optimizer(opt)
    opt.step()
    assert window.resident() == [0, 1]  # the first window of the next forward, fetched after the step


def test_auto_size_profiles_then_chooses_within_the_memory_given():
    model = make_model()
    probe = LayerWindow(model.blocks.layers, size=1)
    slot = probe.slot_bytes
    probe.remove()
    # Profiling takes two blocks, however much memory there is: the activations need the rest.
    probe = LayerWindow(model.blocks.layers, size="auto", available=100 * slot)
    assert probe.size == 2
    probe.remove()
    # Room for 4 buffers (3 blocks and the one coming in) plus gradients of one block.
    params, window = train("auto", steps=4, profile_iterations=2, available=4 * slot + slot)
    reference, _ = train(steps=4)
    assert same(reference, params)
    assert window.chosen is not None and window.chosen["iterations_profiled"] == 2
    assert 1 <= window.size <= 3
    profiles = window.profiles()
    assert all(p["forward_ns"] > 0 and p["backward_ns"] > 0 for p in profiles)


def test_bad_arguments_are_named():
    model = make_model()
    layers = model.blocks.layers
    for kwargs, words in [
        (dict(size=0), "size must be a positive int"),
        (dict(size="big"), "size must be a positive int"),
        (dict(size=True), "size must be a positive int"),
        (dict(size=2, profile_iterations=0), "profile_iterations"),
        (dict(size=2, available=-5), "available must be a positive number of bytes"),
        (dict(size="auto", available=1000), "one block and the prefetch of the next need"),
    ]:
        with pytest.raises(ValueError, match=words):
            LayerWindow(layers, **kwargs)
    with pytest.raises(ValueError, match="blocks is empty"):
        LayerWindow([], size=1)
    with pytest.raises(ValueError, match="appears twice"):
        LayerWindow([layers[0], layers[0]], size=1)
    tied = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="shared by blocks 0 and 1"):
        LayerWindow(tied, size=1)
    with pytest.raises(ValueError, match="no parameters"):
        LayerWindow([torch.nn.ReLU()], size=1)


def test_window_model_errors_carry_the_numbers():
    blocks = [dict(forward_ns=1e6, backward_ns=2e6, h2d_ns=1e6, d2h_ns=1e6, bytes=100 << 20)] * 4
    with pytest.raises(ValueError, match=r"need 200\.00 MiB .* only 150\.00 MiB"):
        memtide._memtide.choose_window(blocks, 150 << 20)
    with pytest.raises(ValueError, match="unknown key"):
        memtide._memtide.choose_window([dict(forward=1)], 1 << 30)
    assert memtide._memtide.choose_window(blocks, 1 << 30)["blocks"] == 4


def test_remove_gives_every_block_device_memory_of_its_own():
    model = make_model()
    window = LayerWindow(model.blocks.layers, size=2)
    window.remove()
    ptrs = {p.untyped_storage().data_ptr() for p in model.blocks.layers.parameters()}
    assert not ptrs & {h.untyped_storage().data_ptr() for h in window._host}
    gen = torch.Generator().manual_seed(1)
    x, y = arithmetic_batch(gen, 8, 16, 32)
    lm_loss(model(x), y).backward()  # plain training again, no hooks
    assert window.stats["fetches"] == 0


def test_a_change_at_home_after_the_prefetch_reaches_the_next_forward():
    # The first window is copied in after the step; the parameters still point at home until the
    # blocks run, and a change made meanwhile (here an EMA-like scaling) is copied in again.
    def run(size):
        model = make_model()
        window = LayerWindow(model.blocks.layers, size=size) if size else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if window is not None:
            window.attach_optimizer(opt)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = arithmetic_batch(gen, 8, 16, 32)
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if window is not None:
                assert window.resident() == [0, 1]
            with torch.no_grad():
                for p in model.blocks.layers[0].parameters():
                    p.mul_(0.5)
        return [p.detach().clone() for p in model.parameters()]

    assert same(run(None), run(2))


@pytest.mark.parametrize("window_first", [True, False])
def test_tiered_adamw_with_the_window_equals_tiered_adamw_without(window_first):
    # TieredAdamW makes each parameter a view of its flat buffer and writes it in its step; the
    # window takes that buffer as the parameter's home, whichever of the two came first.
    from memtide.optim import TieredAdamW

    def run(size):
        model = make_model()
        make = lambda: TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)  # noqa: E731
        if window_first:
            window = LayerWindow(model.blocks.layers, size=size) if size else None
            opt = make()
        else:
            opt = make()
            window = LayerWindow(model.blocks.layers, size=size) if size else None
        if window is not None:
            window.attach_optimizer(opt)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):
                x, y = arithmetic_batch(gen, 8, 16, 32)
                (lm_loss(model(x), y) / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], window

    reference, _ = run(None)
    params, window = run(2)
    assert same(reference, params)
    assert window.stats["fetches"] > LAYERS
    # Every parameter's home is the optimizer's buffer: the window's own copies were given back.
    assert [h.numel() for h in window._host] == [0] * LAYERS


def _careless(size):
    """Training with what users do between steps: an evaluation pass, a forward whose loss is
    dropped, an edit of the parameters after it, a backward twice through a retained graph, and a
    frozen block."""
    model = make_model()
    for p in model.blocks.layers[2].parameters():
        p.requires_grad_(False)
    window = LayerWindow(model.blocks.layers, size=size) if size else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    evals = []
    for step in range(3):
        x, y = arithmetic_batch(gen, 8, 16, 32)
        loss = lm_loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            evals.append(lm_loss(model(x), y))
        lm_loss(model(x), y)  # dropped: no backward follows
        if step == 1:
            with torch.no_grad():  # edited while the last blocks are in the window's buffers
                for p in model.blocks.layers[-1].parameters():
                    p.mul_(0.5)
    return [p.detach().clone() for p in model.parameters()] + evals, window


def test_careless_use_between_steps_trains_as_without_the_window():
    reference, _ = _careless(None)
    for size in (1, 2):
        got, window = _careless(size)
        assert same(reference, got), size
        with torch.no_grad():  # after an evaluation pass every parameter is at home again
            window.blocks[0](torch.zeros(8, 16, 64))
            for b in range(1, LAYERS):
                window.blocks[b](torch.zeros(8, 16, 64))
        assert all(p.data_ptr() == h.data_ptr() for layout, homes in zip(window.layouts, window._home)
                   for p, h in zip(layout.params, homes))
        with pytest.raises(ValueError, match="already belongs to a LayerWindow"):
            LayerWindow(window.blocks, size=1)


def test_a_parameter_without_a_gradient_does_not_keep_its_block_waiting():
    # An unused parameter (a layer the forward never calls) gets no gradient: its block's other
    # gradients still go home, at the end of backward at the latest.
    def unused(model):
        model.blocks.layers[3].unused = torch.nn.Linear(4, 4)

    reference, _ = train(prepare=unused)
    got, window = train(1, prepare=unused)
    assert same(reference, got)
    assert window.stats["grad_offloads"] == 3 * LAYERS


def test_a_block_called_out_of_order_is_named_and_skipping_one_is_fine():
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x, again=False):
            for i, b in enumerate(self.blocks):
                if i != 2:  # a skipped block (early exit, a routed layer)
                    x = torch.tanh(b(x))
            if again:
                x = self.blocks[1](x)
            return x.sum()

    def run(size, again=False):
        torch.manual_seed(0)
        m = Stack()
        if size:
            LayerWindow(m.blocks, size=size)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(3):
            m(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), again).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in m.parameters()]

    assert same(run(None), run(1))
    with pytest.raises(RuntimeError, match="no buffer is free for block 1.*follows the stack's order"):
        run(1, again=True)
    assert same(run(None, again=True), run(4, again=True))  # every block in the window: any order


def test_the_gpu_window_benchmark_runs_its_code_on_the_cpu(tmp_path):
    # bench/python/bench_window_gpu.py is gpu_check's proof of the window on a GPU; here its code
    # runs on CPU tensors (no cap), so that a broken script is found before a GPU session is spent
    # on it.
    import subprocess
    import sys
    from pathlib import Path

    from memtide_testing import clean_env

    script = Path(__file__).resolve().parents[3] / "bench" / "python" / "bench_window_gpu.py"
    out = tmp_path / "window.md"
    p = subprocess.run([sys.executable, str(script), "--device", "cpu", "--hidden", "64", "--heads", "4", "--layers",
                        "4", "--seq", "16", "--batch", "2", "--vocab", "64", "--steps", "3", "--out", str(out)],
                       env=clean_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    text = out.read_text()
    assert "capped, layer window | all | 2 (" in text and "Losses bit for bit equal: yes" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TieredAdamW's device copy of the model)")
def test_on_a_gpu_the_window_comes_before_tiered_adamw():
    from memtide.optim import TieredAdamW

    model = make_model().to("cuda", torch.bfloat16)
    opt = TieredAdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="Build the LayerWindow before the optimizer"):
        LayerWindow(model.blocks.layers, size=2)
    del opt
    model = make_model().to("cuda", torch.bfloat16)
    window = LayerWindow(model.blocks.layers, size=2)
    opt = TieredAdamW(model.parameters(), lr=1e-3)
    window.attach_optimizer(opt)
    x, y = arithmetic_batch(torch.Generator().manual_seed(1), 8, 16, 32)
    weights = [layer.linear1.weight for layer in model.blocks.layers]
    before = [w.detach().float().cpu().clone() for w in weights]
    for _ in range(2):
        lm_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(not torch.equal(b, w.detach().float().cpu()) for b, w in zip(before, weights))  # every block trained
