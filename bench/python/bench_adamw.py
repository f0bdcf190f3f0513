#!/usr/bin/env python3
"""CPU AdamW step throughput: memtide's fused kernel vs torch.optim.AdamW vs a STREAM-like probe.

  python bench/python/bench_adamw.py [--n 67108864] [--threads T] [--rounds 15] [--out bench/results/adamw/DATE-MACHINE.md]

Every contender runs with the same thread count: torch.set_num_threads(memtide.cpu_threads()), the
size of memtide's process pool (hardware_concurrency). --threads overrides torch's count only.
Bytes/s count the bytes each step must move at least: memtide with fp32 state, a 2-byte gradient
and a 2-byte param copy moves 28 B/param (p, m, v read and written = 24, grad 2, copy 2).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

# torch's OpenMP threads (libgomp) spin for a while after every parallel region; on a machine with
# as many cores as threads they steal the cores memtide's pool (and DeepSpeed's) is about to use,
# which made memtide's in-cache (1M) step 1.6x slower here. Passive waiting must be chosen before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

class Contender:
    """One timed step: `fn` runs it once; `bpp` is the bytes per param it must move at least."""

    def __init__(self, name, fn, bpp, note=""):
        self.name, self.fn, self.bpp, self.note = name, fn, bpp, note
        self.times = []

    def best(self):
        return min(self.times)

    def median(self):
        return statistics.median(self.times)


def run_rounds(contenders, rounds):
    """Times every contender once per round, in an order rotated each round.

    The shared VM's bandwidth drifts by +-20% over seconds, so timing one contender's repeats back
    to back and then the next one's compares different machines. Round-robin puts every
    contender's i-th sample in the same few hundred milliseconds; ratios are then taken per round
    (paired) and summarized by their median.
    """
    for c in contenders:
        c.fn()  # warm-up: page faults, first touch, lazy state
    for r in range(rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            t0 = time.perf_counter()
            c.fn()
            c.times.append(time.perf_counter() - t0)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{c.times[-1] * 1e3:.0f}" for c in contenders) + " ms",
              flush=True)


def paired(num, den):
    """Per-round ratios num.time / den.time: (median, min, max)."""
    q = [a / b for a, b in zip(num.times, den.times)]
    return statistics.median(q), min(q), max(q)




def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64 * 1024 * 1024, help="parameters (default 64M)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds; each times every contender once")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: memtide's pool size)")
    ap.add_argument("--out", help="write a Markdown report here")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeedCPUAdam attempt")
    ap.add_argument("--no-slow", action="store_true", help="skip torch's foreach=False/foreach=True loops")
    args = ap.parse_args()
    if args.n < 1 or args.rounds < 1:
        ap.error(f"--n and --rounds must be >= 1 (got --n {args.n}, --rounds {args.rounds})")

    import torch
    import memtide
    from memtide import _memtide

    n = args.n
    threads = args.threads or memtide.cpu_threads()
    torch.set_num_threads(threads)
    contenders = []
    skipped = []  # (name, why)

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    grad32 = torch.randn(n, generator=gen) * 1e-2
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    # memtide: one set of fp32 state per contender, so rounds do not share a step counter.
    def memtide_step(g, out):
        p, m, v = param.clone(), torch.zeros(n), torch.zeros(n)
        step = [0]

        def run():
            step[0] += 1
            memtide.adamw_step_cpu(p, g, m, v, step=step[0], out=out, **kw)

        return run

    half_out = torch.empty(n, dtype=torch.float16)
    main_c = Contender("memtide fused (bf16 grad, fp16 copy)", memtide_step(grad32.to(torch.bfloat16), half_out), 28)
    contenders.append(main_c)
    contenders.append(Contender("memtide fused (fp16 grad, fp16 copy)",
                                memtide_step(grad32.to(torch.float16), half_out), 28))
    contenders.append(Contender("memtide fused (fp32 grad, no copy)", memtide_step(grad32, None), 28))

    # torch.optim.AdamW on fp32 params with fp32 grads (it has no mixed-dtype CPU path); the fp16
    # copy for the GPU would be one more pass (param.half()).
    variants = [("fused=True", dict(fused=True))]
    if not args.no_slow:
        variants = [("foreach=False", dict(foreach=False)), ("foreach=True", dict(foreach=True))] + variants
    for label, opts in variants:
        p = torch.nn.Parameter(param.clone())
        p.grad = grad32.clone()
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **opts)
            opt.step()
        except Exception as e:  # noqa: BLE001 - report whatever stops it
            skipped.append((f"torch AdamW {label}", f"{type(e).__name__}: {e}"))
            continue
        contenders.append(Contender(f"torch AdamW {label} (fp32 grad)", opt.step, 32, "p,g,m,v fp32"))

    # STREAM-like in-place probe: a += s*b over fp32 arrays (read a, read b, write a).
    a, b = torch.randn(n), torch.randn(n)
    contenders.append(Contender("stream probe a += s*b (torch, fp32)", lambda: a.add_(b, alpha=1e-3), 12,
                                "generic STREAM-like"))

    # The step's own roof: p, m, v (fp32) read and written, a bf16 gradient read, a bf16 copy
    # written (28 B/param), nearly no arithmetic, same tiles and pool as the step.
    pp, mm, vv = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    gg, oo = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    roof = Contender("memtide stream probe (the step's streams)",
                     lambda: _memtide.stream_probe_cpu(pp, mm, vv, gg, oo), 28, "memory roof")
    contenders.append(roof)

    ds_c = None
    if not args.no_deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            p = torch.nn.Parameter(param.clone())
            p.grad = grad32.clone()
            ds_opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
            half = torch.empty(n, dtype=torch.float16)

            def ds(opt=ds_opt, p=p, half=half):
                opt.step()
                half.copy_(p.detach())

            ds()
            ds_c = Contender("DeepSpeedCPUAdam + separate fp16 copy", ds, 34, "fp32 p,g,m,v + copy pass")
            contenders.append(ds_c)
        except Exception as e:  # noqa: BLE001
            why = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            skipped.append(("DeepSpeedCPUAdam", f"{type(e).__name__}: {why}"))
    for name, why in skipped:
        print(f"{name}: not run: {why}", flush=True)

    run_rounds(contenders, args.rounds)

    lines = [
        "# CPU AdamW step",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs; python {platform.python_version()}, torch {torch.__version__},"
        f" memtide {memtide.version()}",
        f"- build: memtide CPU path `{memtide.cpu_isa()}`, pool of {memtide.cpu_threads()} thread(s);"
        f" torch threads {threads}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}",
        f"- inputs: {n:,} params, fp32 state; {args.rounds} rounds after a warm-up, each round timing every"
        " contender once (order rotated per round)",
        "",
        "| contender | best ms | median ms | G params/s (median) | GB/s (B/param) | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for c in contenders:
        med = c.median()
        lines.append(f"| {c.name} | {c.best() * 1e3:.1f} | {med * 1e3:.1f} | {n / med / 1e9:.2f} |"
                     f" {n * c.bpp / med / 1e9:.1f} ({c.bpp}) | {c.note} |")
    for name, why in skipped:
        lines.append(f"| {name} | - | - | - | - | not run: {why} |")

    lines += ["", "## Paired ratios (per round, then the median; min-max in brackets)", ""]
    q = paired(roof, main_c)
    lines.append(f"- {main_c.name} vs the step's roof: **{q[0]:.0%}** of its bandwidth [{q[1]:.0%}-{q[2]:.0%}]"
                 " (target >= 90%)")
    if ds_c is not None:
        q = paired(ds_c, main_c)
        lines.append(f"- {main_c.name} vs {ds_c.name}: **{q[0]:.2f}x** [{q[1]:.2f}-{q[2]:.2f}] (target >= 1.25x)")
    for c in contenders:
        if c.name.startswith("torch AdamW fused"):
            q = paired(c, main_c)
            lines.append(f"- {main_c.name} vs {c.name}: {q[0]:.2f}x [{q[1]:.2f}-{q[2]:.2f}]")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
