"""The kernels on their own: the CPU memory roof and the device-side step and conversions
(SimDevice here: it runs the CPU kernels in place of the CUDA ones)."""

from __future__ import annotations

import os

import pytest

import memtide
from memtide import _memtide
from memtide_testing import clean_env, run_python

torch = pytest.importorskip("torch")

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stream_probe_moves_every_stream():
    n = 50_001
    g = torch.randn(n).to(torch.bfloat16)
    p, m, v = torch.ones(n), torch.zeros(n), torch.full((n,), 2.0)
    out = torch.empty(n, dtype=torch.bfloat16)
    _memtide.stream_probe_cpu(p, m, v, g, out)
    s = torch.tensor(1e-3, dtype=torch.float32)
    assert torch.equal(p, 1.0 + s * g.float())
    assert torch.equal(m, torch.full((n,), 1e-3))
    assert torch.equal(v, 2.0 + s.expand(n))
    # out is p's top 16 bits: bf16 by truncation
    assert torch.equal(out.view(torch.int16), (p.view(torch.int32) >> 16).to(torch.int16))


def test_stream_probe_rejects_bad_arrays():
    n = 8
    with pytest.raises(ValueError, match="16-bit"):
        _memtide.stream_probe_cpu(torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n))
    with pytest.raises(ValueError, match="one size"):
        _memtide.stream_probe_cpu(torch.zeros(n), torch.zeros(n + 1), torch.zeros(n),
                                  torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16))


@pytest.mark.skipif(memtide.backend() != "sim", reason="CPU arrays reach the kernels only through SimDevice")
def test_device_step_matches_the_cpu_step_bit_for_bit():
    n = 10_007
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.float16)
    a = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    b = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    out_a, out_b = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        memtide.adamw_step_cpu(a[0], g, a[1], a[2], step=step, out=out_a, **HYPER)
        _memtide.adamw_step_device(b[0], g, b[1], b[2], step=step, out=out_b, **HYPER)
    for x, y in zip(a + [out_a], b + [out_b]):
        assert torch.equal(x, y)


@pytest.mark.skipif(memtide.backend() != "sim", reason="CPU arrays reach the kernels only through SimDevice")
def test_device_convert_upcasts_with_scale_and_downcasts():
    x = torch.randn(1000) * 100
    h = torch.empty(1000, dtype=torch.bfloat16)
    _memtide.convert_device(h, x, 1.0, 0)
    assert torch.equal(h, x.to(torch.bfloat16))
    back = torch.empty(1000)
    _memtide.convert_device(back, h, 0.5, 0)
    assert torch.equal(back, h.float() * 0.5)
    with pytest.raises(ValueError, match="one size"):
        _memtide.convert_device(torch.empty(3), h, 1.0, 0)


def test_gpu_benchmark_says_why_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    r = run_python([os.path.join(ROOT, "bench", "python", "bench_adamw_gpu.py"), "--n", "1024"], env=clean_env())
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr
