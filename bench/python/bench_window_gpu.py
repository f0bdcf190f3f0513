#!/usr/bin/env python3
"""The layer window on a real GPU: a GPT model whose parameters and gradients do not fit a capped
GPU memory trains with memtide.window.LayerWindow, and its throughput is compared with the same
model trained without the window on the uncapped GPU.

    python bench/python/bench_window_gpu.py --out bench/results/window/DATE-GPU.md [--hidden 2048 --layers 16]

Each run is its own process (a cap set with torch.cuda.set_per_process_memory_fraction must not
outlive it): first the model uncapped and without a window (its peak sets the cap: --cap-fraction
of the model's parameter and gradient bytes), then capped with the window. Both train the same
steps on the same data with TieredAdamW (policy auto); the report gives step times, tokens per
second, peaks, the window's copies and whether the losses agree bit for bit. `--device cpu` runs
the same code on CPU tensors (no cap; a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date

# What the bench scripts share lies one folder up, in bench/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plotting import write_report  # noqa: E402


def run_phase(args: argparse.Namespace) -> dict:
    import torch

    import memtide
    from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss
    from memtide.optim import TieredAdamW
    from memtide.window import LayerWindow

    cuda = args.device == "cuda"
    if cuda and args.allocator == "memtide":
        memtide.use_with_torch()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.layers.parameters())
    if cuda and args.cap_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_bytes / total)
    window = None
    if args.window != "none":
        # The blocks stay in host memory (they would not fit the cap), the rest goes to the device.
        for name, module in model.named_children():
            if name != "blocks":
                module.to(dev)
    else:
        model.to(dev)
    # The window before the optimizer: the blocks' params have their homes in host memory, so
    # TieredAdamW keeps no device copy of them (its host buffer becomes their home), and its
    # gradient hook still runs first (the window registers its own at the first forward).
    if args.window != "none":
        size = args.window if args.window == "auto" else int(args.window)
        avail = int(args.cap_bytes * 0.5) if size == "auto" and args.cap_bytes else None
        window = LayerWindow(model.blocks.layers, size=size, device=dev, available=avail, profile_iterations=2)
    opt = TieredAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, policy="auto")
    if window is not None:
        window.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    data = [arithmetic_batch(gen, args.batch, args.seq, args.vocab, dev) for _ in range(2)]
    losses, times = [], []
    for step in range(args.steps):
        x, y = data[step % 2]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"  step {step + 1}/{args.steps}: loss {losses[-1]:.6f}, {times[-1] * 1e3:.1f} ms", file=sys.stderr,
              flush=True)
    timed = times[2:] if len(times) > 3 else times
    step_s = statistics.median(timed)
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "CPU",
        "params": params,
        "param_grad_bytes": 2 * params * (2 if cuda else 4),
        "block_bytes": block_bytes,
        "cap_bytes": args.cap_bytes,
        "window": None if window is None else {"size": window.size, "requested": window.requested,
                                               "chosen": window.chosen, **window.stats},
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "losses": losses,
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
        "allocator": args.allocator if cuda else "cpu",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="Markdown results file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--window", default="2", help="blocks in the window, or auto (default 2); none: no window")
    ap.add_argument("--cap-fraction", type=float, default=0.6,
                    help="the capped run's GPU memory, as a fraction of the model's parameter and gradient bytes")
    ap.add_argument("--allocator", choices=("torch", "memtide"), default="torch",
                    help="torch's caching allocator (default) or memtide through the torch bridge")
    ap.add_argument("--phase", choices=("uncapped", "capped"), help=argparse.SUPPRESS)
    ap.add_argument("--cap-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args)))
        return 0
    if not args.out:
        ap.error("--out is required")
    t0 = time.perf_counter()
    common = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--hidden", str(args.hidden),
              "--heads", str(args.heads), "--layers", str(args.layers), "--seq", str(args.seq),
              "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps", str(args.steps),
              "--allocator", args.allocator]

    def phase(*extra: str) -> dict:
        p = subprocess.run(common + list(extra), capture_output=True, text=True)
        sys.stderr.write(p.stderr)
        if p.returncode != 0:
            raise SystemExit(f"bench_window_gpu: the {extra[1]} run failed (exit {p.returncode})")
        return json.loads(p.stdout.strip().splitlines()[-1])

    print("uncapped, no window ...", file=sys.stderr, flush=True)
    base = phase("--phase", "uncapped", "--window", "none")
    cap = int(base["param_grad_bytes"] * args.cap_fraction) if args.device == "cuda" else 0
    print(f"capped at {cap / 2**30:.2f} GiB, window {args.window} ...", file=sys.stderr, flush=True)
    capped = phase("--phase", "capped", "--window", args.window, "--cap-bytes", str(cap))

    gib = 2**30
    lines = [f"# The layer window on {base['device']} ({date.today()})", "",
             f"Command: `python bench/python/bench_window_gpu.py --out {args.out} --hidden {args.hidden} --layers {args.layers} "
             f"--seq {args.seq} --batch {args.batch} --window {args.window}` ({platform.machine()}, {os.cpu_count()} cores); "
             f"{time.perf_counter() - t0:.0f} s, {args.allocator} allocator. TinyGPT with {base['params'] / 1e9:.2f}B "
             f"params ({base['param_grad_bytes'] / gib:.2f} GiB of parameters and gradients on the device without "
             f"a window), TieredAdamW (policy auto), {args.steps} steps, the median of the steps after the second.",
             "", "| run | GPU memory | window | peak allocated | step | tokens/s |", "|---|---|---|---|---|---|"]
    for name, r in (("uncapped, no window", base), ("capped, layer window", capped)):
        w = r["window"]
        lines.append(f"| {name} | {'%.2f GiB' % (r['cap_bytes'] / gib) if r['cap_bytes'] else 'all'} | "
                     f"{'-' if w is None else '%d (%s fetches)' % (w['size'], w['fetches'])} | "
                     f"{'-' if r['peak_bytes'] is None else '%.2f GiB' % (r['peak_bytes'] / gib)} | "
                     f"{r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:.0f} |")
    same = base["losses"] == capped["losses"]
    lines += ["", f"Throughput with the window: {capped['tokens_per_s'] / base['tokens_per_s'] * 100:.0f}% of the "
              f"uncapped run. The model's parameters and gradients "
              f"({base['param_grad_bytes'] / gib:.2f} GiB) exceed the cap "
              f"({capped['cap_bytes'] / gib:.2f} GiB): {base['param_grad_bytes'] > capped['cap_bytes'] > 0}. "
              f"Losses bit for bit equal: {'yes' if same else 'no'} ({base['losses'][-1]:.6f} and "
              f"{capped['losses'][-1]:.6f} at the last step).", ""]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
