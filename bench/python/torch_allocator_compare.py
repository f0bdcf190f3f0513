"""A small GPT-style training loop run twice, once on torch's native CUDA allocator and once on
memtide's, each in a fresh process (an allocator can only be swapped before CUDA starts).
Reports median step time and peak reserved memory for both and writes Markdown with --out.

Needs a CUDA GPU; without one it says so and exits 2.

    python bench/python/torch_allocator_compare.py --out bench/results/torch-allocator/DATE-GPU.md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import date

CHILD = r"""
import json, statistics, sys, time
import torch
use_memtide = sys.argv[1] == "memtide"
layers, hidden, seq, batch, steps = map(int, sys.argv[2:7])
if use_memtide:
    import memtide
    path = memtide.use_with_torch()["path"]
    phase = memtide.mark_phase
else:
    phase = lambda name: None
    path = "native"
torch.manual_seed(0)
dev = "cuda"
block = lambda: torch.nn.TransformerEncoderLayer(hidden, hidden // 64, 4 * hidden, batch_first=True, device=dev)
model = torch.nn.Sequential(*[block() for _ in range(layers)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randn(batch, seq, hidden, device=dev)
times = []
for step in range(steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    phase("forward")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    phase("backward")
    loss.backward()
    phase("update")
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
if use_memtide:
    s = memtide.stats()
    peak_reserved, peak_allocated = s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]
    headroom = memtide.headroom(0, "forward")["bytes"]
else:
    peak_reserved, peak_allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    headroom = None
print(json.dumps({"path": path, "step_ms": statistics.median(times[2:]) * 1e3, "peak_reserved": peak_reserved,
                  "peak_allocated": peak_allocated, "update_headroom": headroom,
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="Markdown file to write")
    args = ap.parse_args()
    for name in ("layers", "hidden", "seq", "batch", "steps"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    if args.steps < 4:
        ap.error("--steps must be at least 4 (the first two are warm-up)")
    import torch
    if not torch.cuda.is_available():
        print("torch_allocator_compare: no CUDA GPU is available; nothing to compare", file=sys.stderr)
        return 2
    shape = [str(v) for v in (args.layers, args.hidden, args.seq, args.batch, args.steps)]
    results = {}
    for which in ("native", "memtide"):
        print(f"running {args.steps} steps with the {which} allocator ...", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, "-c", CHILD, which, *shape], capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr, file=sys.stderr)
            return 1
        results[which] = json.loads(p.stdout.strip().splitlines()[-1])
    gib = 1024 ** 3
    n, m = results["native"], results["memtide"]
    lines = [f"# torch native allocator vs memtide, {date.today().isoformat()}", "",
             f"Command: `python bench/python/torch_allocator_compare.py {' '.join(sys.argv[1:])}`", "",
             f"GPU {n['gpu']}, torch {n['torch']}; model: {args.layers} x TransformerEncoderLayer(hidden "
             f"{args.hidden}), seq {args.seq}, batch {args.batch}, bf16 autocast, fused AdamW; "
             f"median of steps 3..{args.steps}.", "",
             "| allocator (path) | step (ms) | peak reserved (GiB) | peak allocated (GiB) | reserved/allocated |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} ({r['path']}) | {r['step_ms']:.2f} | {r['peak_reserved'] / gib:.2f} | "
                     f"{r['peak_allocated'] / gib:.2f} | {r['peak_reserved'] / r['peak_allocated']:.3f} |")
    lines += ["", f"memtide step time / native: {m['step_ms'] / n['step_ms']:.3f}; "
                  f"update-phase headroom until forward (memtide): {m['update_headroom'] / gib:.2f} GiB"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        open(args.out, "w").write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
