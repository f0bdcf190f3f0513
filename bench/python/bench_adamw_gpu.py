#!/usr/bin/env python3
"""GPU optimizer kernels: memtide's fused AdamW step vs torch.optim.AdamW(fused=True), and the
fp16/bf16 <-> fp32 conversions vs a measured HBM copy.

  python bench/python/bench_adamw_gpu.py [--n 268435456] [--repeats 20] [--out bench/results/adamw-gpu/DATE-GPU.md]

Needs a CUDA GPU and memtide's runtime on it (MEMTIDE_DEVICE=auto or cuda); exits 2 with the
reason otherwise. Times are CUDA-event times of back-to-back launches on one stream, best and
median of --repeats. Bytes/s count the bytes each kernel must move: memtide's step with fp32
state, a bf16 gradient and a bf16 param copy moves 28 B/param; torch's fused step with fp32
params, grads and state moves 32 B/param (it has no low-precision output).
Targets: AdamW >= 1.0x torch fused; the step >= 90% of a device-to-device copy of the same bytes
(its HBM roof); conversions >= 80% of the HBM copy's bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def timed(torch, fn, repeats):
    fn()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times), statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256 * 1024 * 1024, help="parameters (default 256M)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write a Markdown table here")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench_adamw_gpu: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import memtide
    from memtide import _memtide

    if memtide.backend() != "cuda":
        print(f"bench_adamw_gpu: memtide's runtime uses the {memtide.backend()} backend, not cuda "
              f"(status: {memtide.cuda_status()})", file=sys.stderr)
        return 2

    n, dev = args.n, torch.device("cuda", 0)
    stream = torch.cuda.current_stream().cuda_stream
    rows = []  # (name, best s, median s, bytes per element, elements)

    def add(name, fn, bytes_per_elem, elems=n):
        best, med = timed(torch, fn, args.repeats)
        rows.append((name, best, med, bytes_per_elem, elems))
        print(f"{name:<48} {best * 1e3:8.3f} ms  {elems / best / 1e9:8.2f} G/s  "
              f"{elems * bytes_per_elem / best / 1e9:8.1f} GB/s", flush=True)

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    p, m, v = torch.randn(n, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    g16 = torch.randn(n, device=dev).to(torch.bfloat16)
    out16 = torch.empty(n, device=dev, dtype=torch.bfloat16)
    step = [0]

    def memtide_step():
        step[0] += 1
        _memtide.adamw_step_device(p, g16, m, v, step=step[0], out=out16, stream=stream, **hyper)

    add("memtide fused AdamW (bf16 grad, bf16 copy)", memtide_step, 28)
    del p, m, v, g16, out16
    # The step's HBM roof: a device-to-device copy that moves the same 28 B per param (14 read, 14 written).
    src = torch.empty(n * 14, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    add("HBM copy at the step's bytes (14 B/param each way)", lambda: dst.copy_(src), 28)
    del src, dst

    tp = torch.nn.Parameter(torch.randn(n, device=dev))
    tp.grad = torch.randn(n, device=dev)
    opt = torch.optim.AdamW([tp], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    add("torch AdamW fused=True (fp32 p, g, m, v)", opt.step, 32)
    del tp, opt

    a = torch.randn(n, device=dev)
    b = torch.empty_like(a)
    add("HBM copy fp32 (torch copy_)", lambda: b.copy_(a), 8)
    h = torch.empty(n, device=dev, dtype=torch.bfloat16)
    add("downcast fp32 -> bf16 (memtide)", lambda: _memtide.convert_device(h, a, 1.0, stream), 6)
    add("upcast bf16 -> fp32, x 1/1024 (memtide)", lambda: _memtide.convert_device(b, h, 1 / 1024, stream), 6)
    del a, b, h

    name = torch.cuda.get_device_name(0)
    by = {r[0]: r for r in rows}
    mt, tt = by["memtide fused AdamW (bf16 grad, bf16 copy)"], by["torch AdamW fused=True (fp32 p, g, m, v)"]
    copy_bw = n * 8 / by["HBM copy fp32 (torch copy_)"][1]
    roof = by["HBM copy at the step's bytes (14 B/param each way)"]
    lines = [
        "# GPU optimizer kernels",
        "",
        f"- machine: {name}; torch {torch.__version__}; memtide {memtide.version()}",
        f"- inputs: {n:,} elements; best (median) of {args.repeats} launches, CUDA events",
        "",
        "| kernel | best ms | median ms | G elem/s | GB/s (B/elem) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1] * 1e3:.3f} | {r[2] * 1e3:.3f} | {r[4] / r[1] / 1e9:.2f} | "
                     f"{r[4] * r[3] / r[1] / 1e9:.1f} ({r[3]}) |")
    lines += [
        "",
        f"- AdamW params/s, memtide / torch fused: {tt[1] / mt[1]:.2f}x (target >= 1.0x)",
        f"- memtide fused AdamW against the HBM copy of the same bytes: "
        f"{roof[1] / mt[1]:.0%} (target >= 90%)",
    ]
    for label in ("downcast fp32 -> bf16 (memtide)", "upcast bf16 -> fp32, x 1/1024 (memtide)"):
        bw = n * 6 / by[label][1]
        lines.append(f"- {label}: {bw / copy_bw:.0%} of the HBM copy's {copy_bw / 1e9:.0f} GB/s (target >= 80%)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
