"""The kernels on their own: the CPU memory roof and the device-side step and conversions.

On the simulated device the device-side ops run the CPU kernels in place of the CUDA ones, so
what those tests compare is the device path (arguments, dtypes, the stream) around the CPU kernel,
never a CUDA kernel's arithmetic. Whether the CUDA kernels give the CPU kernel's bits is checked
only where a CUDA GPU and memtide's cuda backend are present (the `cuda` tests below, and
tests/tiering/kernels/test_adamw_cuda.cpp); until one has run, that equality is unproven."""

from __future__ import annotations

import os

import pytest

import memtide
from memtide import _memtide
from memtide_testing import clean_env, run_python

torch = pytest.importorskip("torch")

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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


def steps_on_the_cpu_and_the_device(device):
    """Three AdamW steps (fp16 gradient, bf16 copy out) by the CPU kernel and by the runtime's
    device op on `device` tensors; both results, on the CPU."""
    n = 10_007
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.float16)
    a = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    b = [t.to(device, copy=True) for t in a]
    out_a, out_b = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device=device)
    g_b = g.to(device)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    for step in (1, 2, 3):
        memtide.adamw_step_cpu(a[0], g, a[1], a[2], step=step, out=out_a, **HYPER)
        _memtide.adamw_step_device(b[0], g_b, b[1], b[2], step=step, out=out_b, stream=stream, **HYPER)
    if device == "cuda":
        torch.cuda.synchronize()
    return a + [out_a], [t.cpu() for t in b + [out_b]]


on_sim = pytest.mark.skipif(memtide.backend() != "sim", reason="CPU arrays reach the device ops only through SimDevice")
on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or memtide.backend() != "cuda",
                             reason="needs a CUDA GPU and memtide's cuda backend: the CUDA kernels' bits are unproven "
                             "until this runs")


@on_sim
def test_the_device_step_on_the_simulated_device_is_the_cpu_kernel_behind_the_device_path():
    cpu, device = steps_on_the_cpu_and_the_device("cpu")
    for x, y in zip(cpu, device):
        assert torch.equal(x, y)


@on_cuda
def test_cuda_step_matches_the_cpu_step_bit_for_bit():
    cpu, gpu = steps_on_the_cpu_and_the_device("cuda")
    for what, x, y in zip(("param", "exp_avg", "exp_avg_sq", "bf16 out"), cpu, gpu):
        assert torch.equal(x, y), f"{what}: {(x != y).sum().item()} of {x.numel()} differ"


def check_convert(device):
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    x = torch.randn(1000) * 100
    h = torch.empty(1000, dtype=torch.bfloat16, device=device)
    _memtide.convert_device(h, x.to(device), 1.0, stream)
    back = torch.empty(1000, device=device)
    _memtide.convert_device(back, h, 0.5, stream)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(h.cpu(), x.to(torch.bfloat16))
    assert torch.equal(back.cpu(), h.cpu().float() * 0.5)
    with pytest.raises(ValueError, match="one size"):
        _memtide.convert_device(torch.empty(3, device=device), h, 1.0, stream)


@on_sim
def test_device_convert_upcasts_with_scale_and_downcasts():
    check_convert("cpu")


@on_cuda
def test_cuda_convert_upcasts_with_scale_and_downcasts():
    check_convert("cuda")


def test_gpu_benchmark_says_why_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    r = run_python([os.path.join(ROOT, "bench", "python", "bench_adamw_gpu.py"), "--n", "1024"], env=clean_env())
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr
