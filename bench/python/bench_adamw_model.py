#!/usr/bin/env python3
"""Where users meet the CPU step: a model on CPU tensors trained with TieredAdamW(policy="cpu")
and with torch.optim.AdamW(fused=True), rounds alternating, step() and backward + step timed.

  python bench/python/bench_adamw_model.py [--layers 12] [--width 2048] [--batch 16] [--rounds 9]
      [--dtypes float32,bfloat16] [--out FILE.md]

The model: `layers` Linear(width, width) in a row (12 x 2048 x 2048: 50.4M params), a batch of
`batch` rows, loss = mean of the squared output. Each optimizer trains its own copy of the model
(same seed). A round runs one iteration of each (zero_grad, forward, backward, step), in an order
that alternates every round; medians are over the rounds after the first two (warm-up), and ratios
are taken per round (paired), then the median.

Bytes per param of the step: torch's fused AdamW on an fp32 model reads and writes p, m, v and
reads g (28 B); on a bf16 model it keeps p, m, v and g in bf16 (14 B). TieredAdamW keeps fp32
masters and moments whatever the model's dtype (24 B), reads the gradient where backward left it
(4 B fp32, 2 B bf16) and, for a bf16 model, writes the model's bf16 params in place in the same
pass (2 B): 28 B either way. What a bf16 model's 14 more bytes buy is the last table: the update
each optimizer keeps, against the exact one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_adamw.py


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds after two warm-up rounds")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated")
    ap.add_argument("--out", help="write a Markdown report here")
    ap.add_argument("--shared", action="store_true", help="say in the report that other work ran on the machine")
    args = ap.parse_args()
    for name in ("layers", "width", "batch", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    import torch
    import memtide
    from memtide.optim import TieredAdamW

    dtypes = []
    for d in args.dtypes.split(","):
        if d.strip() not in ("float32", "bfloat16", "float16"):
            ap.error(f"--dtypes: {d!r} is not one of float32, bfloat16, float16")
        dtypes.append(getattr(torch, d.strip()))
    torch.set_num_threads(memtide.cpu_threads())

    def model(dtype):
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(dtype)

    lines = [
        "# Where users meet it: a model on CPU tensors, TieredAdamW(policy=\"cpu\") vs torch.optim.AdamW(fused=True)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.date.today().isoformat()}; machine: {cpu_model()}, {os.cpu_count()} CPUs"
        + ("; **shared: other processes (builds) ran at the same time**" if args.shared else ""),
        f"- python {platform.python_version()}, torch {torch.__version__}, memtide {memtide.version()};"
        f" CPU path `{memtide.cpu_isa()}`, threads {torch.get_num_threads()}",
        f"- model: {args.layers} x Linear({args.width}, {args.width}), batch {args.batch};"
        f" {args.rounds} paired rounds after 2 warm-up rounds, order alternating",
        "",
        "| model | params | TieredAdamW step ms | torch step ms | step: memtide / torch speed | "
        "TieredAdamW bwd+step ms | torch bwd+step ms | bwd+step: memtide / torch speed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype in dtypes:
        ma, mb = model(dtype), model(dtype)
        n = sum(p.numel() for p in ma.parameters())
        x = torch.randn(args.batch, args.width, dtype=dtype, generator=torch.Generator().manual_seed(1))
        oa = TieredAdamW(ma.parameters(), lr=1e-3, policy="cpu")
        ob = torch.optim.AdamW(mb.parameters(), lr=1e-3, fused=True)
        t = {k: [] for k in ("m_step", "m_both", "t_step", "t_both")}

        def one(m, o, key):
            o.zero_grad()
            loss = m(x).float().square().mean()
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            o.step()
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1

        for r in range(args.rounds + 2):
            order = [(ma, oa, "m"), (mb, ob, "t")]
            for m, o, key in order if r % 2 else order[::-1]:
                bwd, step = one(m, o, key)
                if r >= 2:
                    t[key + "_step"].append(step)
                    t[key + "_both"].append(bwd + step)
            print(f"{dtype} round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f}" for k, v in t.items() if v), flush=True)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        q_step = [b / a for a, b in zip(t["m_step"], t["t_step"])]
        q_both = [b / a for a, b in zip(t["m_both"], t["t_both"])]
        lines.append(
            f"| {str(dtype).replace('torch.', '')} | {n / 1e6:.1f}M | {med['m_step']:.1f} | {med['t_step']:.1f} |"
            f" **{statistics.median(q_step):.2f}x** [{min(q_step):.2f}-{max(q_step):.2f}] |"
            f" {med['m_both']:.1f} | {med['t_both']:.1f} |"
            f" **{statistics.median(q_both):.2f}x** [{min(q_both):.2f}-{max(q_both):.2f}] |")
        print(lines[-1], flush=True)
        del oa, ob, ma, mb
    lines += ["", "Targets: step >= 1.00x and backward + step >= 1.00x, for fp32 and for a bf16 model."]
    if torch.bfloat16 in dtypes:
        lines += ["", *what_the_bytes_buy(torch, TieredAdamW)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def what_the_bytes_buy(torch, TieredAdamW, n=1 << 20, steps=20, lrs=(1e-3, 1e-4, 1e-5)):
    """For a bf16 model torch's AdamW keeps params and moments in bf16 (14 B/param a step);
    TieredAdamW keeps fp32 masters and moments (30 B). What that buys, with the optimizer alone
    in play: one bf16 param of n elements (init N(0, 0.02), like a transformer's weights), the same
    bf16 gradients fed to both for `steps` steps, against the exact result, torch.optim.AdamW in
    fp32 on the same values. Reported per learning rate: how much of the exact update each keeps."""
    gen = torch.Generator().manual_seed(2)
    init = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    out = ["## What the bytes buy: the update a bf16 model keeps",
           "",
           f"One bf16 param of {n:,} elements (init N(0, 0.02)), {steps} steps of the same bf16 gradients for each"
           " optimizer; the exact update is torch.optim.AdamW in fp32 on the same values. `error` is"
           " |update - exact update| / |exact update| over the whole param (L2); `unmoved` the share of"
           " elements the bf16 param still holds at their initial value.",
           "",
           "| lr | torch AdamW(fused) on bf16: error | unmoved | TieredAdamW on bf16: error | unmoved |"
           " TieredAdamW's fp32 masters: error |",
           "|---:|---:|---:|---:|---:|---:|"]
    for lr in lrs:
        exact = torch.nn.Parameter(init.float())
        plain = torch.nn.Parameter(init.clone())
        tiered = torch.nn.Parameter(init.clone())
        opts = [torch.optim.AdamW([exact], lr=lr), torch.optim.AdamW([plain], lr=lr, fused=True),
                TieredAdamW([tiered], lr=lr, policy="cpu")]
        for g in grads:
            exact.grad, plain.grad, tiered.grad = g.float(), g.clone(), g.clone()
            for o in opts:
                o.step()
        want = exact.detach() - init.float()

        def error(p):
            return ((p.detach().float() - init.float()) - want).norm().item() / want.norm().item()

        def unmoved(p):
            return (p.detach() == init).float().mean().item()

        masters = opts[2].state_dict()["state"][0]["master_param"]
        out.append(f"| {lr:g} | {error(plain):.1%} | {unmoved(plain):.1%} | {error(tiered):.1%} |"
                   f" {unmoved(tiered):.1%} | {error(masters):.2e} |")
        del opts
    return out


if __name__ == "__main__":
    sys.exit(main())
