#!/usr/bin/env python3
"""Where users meet the CPU step: a model on CPU tensors trained with TieredAdamW(policy="cpu")
and with torch.optim.AdamW(fused=True), rounds alternating; step(), backward + step and the whole
iteration (zero_grad, forward, backward, step) timed.

  python bench/python/bench_adamw_model.py [--layers 12] [--width 2048] [--batch 16] [--rounds 9]
      [--runs 1] [--dtypes float32,bfloat16] [--before-after] [--out FILE.md]

As users run it: torch imported before memtide, no thread variables set by the script
(OMP_WAIT_POLICY, GOMP_SPINCOUNT and OMP_NUM_THREADS are whatever the environment has, and the
page says which), torch's default thread count. Each run is a fresh interpreter.

The model: `layers` Linear(width, width) in a row (12 x 2048 x 2048: 50.4M params), a batch of
`batch` rows, loss = mean of the squared output. Each optimizer trains its own copy of the model
(same seed). A round runs one iteration of each, in an order that rotates every round; medians are
over the rounds after the first two (warm-up), and ratios are taken per round (paired), then the
median. With --before-after a third copy trains with TieredAdamW whose CPU step runs on memtide's
own thread pool ("before"), the others' on torch's intra-op threads ("after",
memtide.torch_bridge.use_torch_threads): the same build, the same rounds.

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
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
METRICS = (("step", "step"), ("both", "bwd+step"), ("iter", "iteration"))


def one_run(args):
    """One run in this interpreter: {dtype: {arm: {metric: [seconds per round]}}} and the setup."""
    import torch
    import memtide
    from memtide import torch_bridge
    from memtide.optim import TieredAdamW

    def model(dtype):
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(dtype)

    arms = ["before", "after", "torch"] if args.before_after else ["after", "torch"]
    result = {"torch": torch.__version__, "memtide": memtide.version(), "isa": memtide.cpu_isa(),
              "torch_threads": torch.get_num_threads(), "memtide_threads": memtide.cpu_threads(), "dtypes": {}}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        models = {arm: model(dtype) for arm in arms}
        n = sum(p.numel() for p in models["torch"].parameters())
        x = torch.randn(args.batch, args.width, dtype=dtype, generator=torch.Generator().manual_seed(1))
        opts = {arm: TieredAdamW(models[arm].parameters(), lr=1e-3, policy="cpu") for arm in arms if arm != "torch"}
        opts["torch"] = torch.optim.AdamW(models["torch"].parameters(), lr=1e-3, fused=True)
        result["executor"] = memtide._memtide.cpu_executor()
        t = {arm: {m: [] for m, _ in METRICS} for arm in arms}

        def one(arm):
            if arm != "torch":
                torch_bridge.use_torch_threads(arm == "after")
            m, o = models[arm], opts[arm]
            t0 = time.perf_counter()
            o.zero_grad()
            loss = m(x).float().square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if args.pause_ms:  # untimed: torch's OpenMP workers stop spinning in the meantime
                time.sleep(args.pause_ms / 1e3)
                t1 += time.perf_counter() - t2
                t0 += time.perf_counter() - t2
                t2 = time.perf_counter()
            o.step()
            t3 = time.perf_counter()
            return {"step": t3 - t2, "both": t3 - t1, "iter": t3 - t0}

        for r in range(args.rounds + 2):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                got = one(arm)
                if r >= 2:
                    for k, v in got.items():
                        t[arm][k].append(v)
        torch_bridge.use_torch_threads(True)
        result["dtypes"][name] = {"params": n, "times": t}
        del opts, models
    return result


def ratios(times, arm):
    """{metric: [torch time / arm time per round]}: > 1 is memtide faster."""
    return {m: [b / a for a, b in zip(times[arm][m], times["torch"][m])] for m, _ in METRICS}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds after two warm-up rounds")
    ap.add_argument("--runs", type=int, default=1, help="runs, each a fresh interpreter")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated")
    ap.add_argument("--before-after", action="store_true",
                    help="also train with TieredAdamW's CPU step on memtide's own pool (before) beside torch's threads (after)")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="sleep this long (untimed) between backward and step: whether the step suffers from what "
                         "backward leaves running (torch's spinning OpenMP workers)")
    ap.add_argument("--out", help="write a Markdown report here")
    ap.add_argument("--shared", action="store_true", help="say in the report that other work ran on the machine")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name in ("layers", "width", "batch", "rounds", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in args.dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            ap.error(f"--dtypes: {d!r} is not one of float32, bfloat16, float16")
    if args.child:
        print(json.dumps(one_run(args)))
        return 0

    child = [sys.executable, os.path.abspath(__file__), "--child", "--layers", str(args.layers), "--width",
             str(args.width), "--batch", str(args.batch), "--rounds", str(args.rounds), "--dtypes", ",".join(args.dtypes),
             "--pause-ms", str(args.pause_ms)]
    if args.before_after:
        child.append("--before-after")
    runs = []
    for i in range(args.runs):
        p = subprocess.run(child, capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr)
            return 1
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        for d, r in runs[-1]["dtypes"].items():
            q = {arm: ratios(r["times"], arm) for arm in r["times"] if arm != "torch"}
            print(f"run {i + 1} {d}: " + "; ".join(
                f"{arm} " + " ".join(f"{label} {statistics.median(q[arm][m]):.3f}x" for m, label in METRICS)
                for arm in q), flush=True)
    first = runs[0]
    env = ", ".join(f"{v}={os.environ[v]}" for v in THREAD_VARIABLES if v in os.environ) or "none set"
    arms = ["before", "after"] if args.before_after else ["after"]
    lines = [
        "# Where users meet it: a model on CPU tensors, TieredAdamW(policy=\"cpu\") vs torch.optim.AdamW(fused=True)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.date.today().isoformat()}; machine: {cpu_model()}, {os.cpu_count()} CPUs"
        + ("; **shared: other processes ran at the same time**" if args.shared else ""),
        f"- python {platform.python_version()}, torch {first['torch']}, memtide {first['memtide']};"
        f" CPU path `{first['isa']}`; torch threads {first['torch_threads']}, memtide pool {first['memtide_threads']};"
        f" thread variables: {env}; torch imported before memtide",
        f"- model: {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}; {args.runs} run(s), each a"
        f" fresh interpreter of {args.rounds} paired rounds after 2 warm-up rounds, order rotating"
        + (f"; {args.pause_ms:g} ms pause (untimed) between backward and step" if args.pause_ms else ""),
        "- TieredAdamW's CPU step: " + ("\"before\" on memtide's own thread pool, \"after\" on torch's intra-op "
                                        "threads, the same build in the same rounds" if args.before_after else
                                        f"on {first['executor'] or 'memtide'}'s threads"),
        "- ratios: torch's time / TieredAdamW's, per round, then the median [min-max over the rounds]: > 1 is memtide"
        " faster",
        "",
        "| run | model | code | step | bwd+step | iteration (zero_grad + fwd + bwd + step) |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for i, run in enumerate(runs):
        for d, r in run["dtypes"].items():
            for arm in arms:
                q = ratios(r["times"], arm)
                cells = [f"**{statistics.median(q[m]):.2f}x** [{min(q[m]):.2f}-{max(q[m]):.2f}]" for m, _ in METRICS]
                lines.append(f"| {i + 1} | {d} | {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Median ms over every timed round of every run:", "",
              "| model | params | code | step ms | bwd+step ms | iteration ms |", "|---|---:|---|---:|---:|---:|"]
    for d in args.dtypes:
        for arm in arms + ["torch"]:
            cells = [statistics.median([v for run in runs for v in run["dtypes"][d]["times"][arm][m]]) * 1e3
                     for m, _ in METRICS]
            label = "torch AdamW(fused=True)" if arm == "torch" else f"TieredAdamW ({arm})"
            lines.append(f"| {d} | {first['dtypes'][d]['params'] / 1e6:.1f}M | {label} | "
                         + " | ".join(f"{c:.1f}" for c in cells) + " |")
    lines += ["", "Target: step, backward + step and the whole iteration >= 1.00x, in every run."]
    if "bfloat16" in args.dtypes:
        import torch
        from memtide.optim import TieredAdamW

        lines += ["", *what_the_bytes_buy(torch, TieredAdamW)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


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
