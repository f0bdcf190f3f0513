#!/usr/bin/env python3
"""CPU AdamW step throughput: memtide's fused kernel vs torch.optim.AdamW vs a STREAM-like probe.

  python bench/bench_adamw.py [--n 67108864] [--threads T] [--repeats 5] [--out results.md]

Every contender runs with the same thread count: torch.set_num_threads(memtide.cpu_threads()), the
size of memtide's process pool (hardware_concurrency). --threads overrides torch's count only.
Bytes/s count the bytes each step must move at least: memtide with fp32 state, a 2-byte gradient
and a 2-byte param copy moves 28 B/param (p, m, v read and written = 24, grad 2, copy 2).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time


def best_time(fn, repeats):
    fn()  # warm-up (page faults, first-touch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), sorted(times)[len(times) // 2]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64 * 1024 * 1024, help="parameters (default 64M)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: memtide's pool size)")
    ap.add_argument("--out", help="write a Markdown table here")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeedCPUAdam attempt")
    args = ap.parse_args()

    import torch
    import memtide

    n = args.n
    threads = args.threads or memtide.cpu_threads()
    torch.set_num_threads(threads)
    rows = []  # (name, seconds best, seconds median, bytes per param, note)

    def add(name, fn, bytes_per_param, note=""):
        best, med = best_time(fn, args.repeats)
        rows.append((name, best, med, bytes_per_param, note))
        print(f"{name:48s} {best * 1e3:9.1f} ms  {n / best / 1e9:6.2f} G params/s  "
              f"{n * bytes_per_param / best / 1e9:6.1f} GB/s  {note}", flush=True)

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    exp_avg = torch.zeros(n)
    exp_avg_sq = torch.zeros(n)
    grad32 = torch.randn(n, generator=gen) * 1e-2
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    step = [0]

    for gname, gdtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        g = grad32.to(gdtype)
        out = torch.empty(n, dtype=torch.float16)

        def run(g=g, out=out):
            step[0] += 1
            memtide.adamw_step_cpu(param, g, exp_avg, exp_avg_sq, step=step[0], out=out, **kw)

        add(f"memtide fused ({gname} grad, fp16 copy)", run, 28)

    def run32():
        step[0] += 1
        memtide.adamw_step_cpu(param, grad32, exp_avg, exp_avg_sq, step=step[0], **kw)

    add("memtide fused (fp32 grad, no copy)", run32, 28)
    del exp_avg, exp_avg_sq

    # torch.optim.AdamW on fp32 params with fp32 grads (it has no mixed-dtype CPU path); the fp16
    # copy for the GPU would be one more pass (param.half()).
    for label, opts in (("foreach=False", dict(foreach=False)), ("foreach=True", dict(foreach=True)),
                        ("fused=True", dict(fused=True))):
        p = torch.nn.Parameter(param.clone())
        p.grad = grad32.clone()
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **opts)
            opt.step()
        except Exception as e:  # noqa: BLE001 - report whatever stops it
            rows.append((f"torch AdamW {label}", None, None, 32, f"not run: {type(e).__name__}: {e}"))
            print(f"torch AdamW {label}: not run: {e}", flush=True)
            continue
        add(f"torch AdamW {label} (fp32 grad)", opt.step, 32, "p,g,m,v fp32")
        del opt, p

    # STREAM-like in-place probe: a += s*b over fp32 arrays (read a, read b, write a).
    a = torch.randn(n)
    b = torch.randn(n)
    add("stream probe a += s*b (torch, fp32)", lambda: a.add_(b, alpha=1e-3), 12, "generic STREAM-like")
    del a, b

    # The step's own roof: p, m, v (fp32) read and written, a bf16 gradient read, a bf16 copy
    # written (28 B/param), nearly no arithmetic, same tiles and pool as the step.
    from memtide import _memtide
    pp, mm, vv = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    gg, oo = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    add("memtide stream probe (the step's streams)", lambda: _memtide.stream_probe_cpu(pp, mm, vv, gg, oo), 28,
        "memory roof")
    del pp, mm, vv, gg, oo

    ds_note = ""
    if not args.no_deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            p = torch.nn.Parameter(param.clone())
            p.grad = grad32.clone()
            opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
            half = torch.empty(n, dtype=torch.float16)

            def ds():
                opt.step()
                half.copy_(p.detach())

            add("DeepSpeedCPUAdam + separate fp16 copy", ds, 34, "fp32 p,g,m,v + copy pass")
        except Exception as e:  # noqa: BLE001
            ds_note = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            print(f"DeepSpeedCPUAdam: not run: {ds_note}", flush=True)

    lines = [
        "# CPU AdamW step",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs; python {platform.python_version()}, torch {torch.__version__},"
        f" memtide {memtide.version()}",
        f"- build: memtide CPU path `{memtide.cpu_isa()}`, pool of {memtide.cpu_threads()} thread(s);"
        f" torch threads {threads}",
        f"- inputs: {n:,} params, fp32 state; best (median) of {args.repeats} steps after a warm-up",
        "",
        "| contender | best ms | median ms | G params/s | GB/s (B/param) | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, best, med, bpp, note in rows:
        if best is None:
            lines.append(f"| {name} | - | - | - | - | {note} |")
        else:
            lines.append(f"| {name} | {best * 1e3:.1f} | {med * 1e3:.1f} | {n / best / 1e9:.2f} |"
                         f" {n * bpp / best / 1e9:.1f} ({bpp}) | {note} |")
    if ds_note:
        lines.append(f"| DeepSpeedCPUAdam | - | - | - | - | not run: {ds_note} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
