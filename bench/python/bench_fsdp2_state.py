"""TieredAdamW's optimizer state per rank under FSDP2: each rank keeps the state of its own shards
only, so its host bytes fall as 1/N with the ranks. Runs examples/train_gpt_distributed.py's model
under torchrun (gloo, CPU) at 1, 2 and 4 ranks and reads every rank's TieredAdamW buffers.

    python bench/python/bench_fsdp2_state.py --out bench/results/fsdp2-state/<date>-<machine>.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One rank: the example's GPT, fully_shard per block and at the root, one step, its state's size.
RANK = """
import json, sys, runpy
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from memtide.optim import TieredAdamW
GPT = runpy.run_path(sys.argv[1])["GPT"]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = GPT(256, 128, 4, 4, 32)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = TieredAdamW(model.parameters(), policy="cpu", subgroup_size=1 << 16)
tokens = torch.randint(0, 256, (2, 32))
model(tokens).float().square().mean().backward()
opt.step()
mine = {"rank": dist.get_rank(), "params": opt.layout.numel, "host_bytes": opt.buffers.nbytes()}
out = [None] * dist.get_world_size()
dist.all_gather_object(out, mine)
if dist.get_rank() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    ap.add_argument("--out", help="write the Markdown report here (default: print it)")
    args = ap.parse_args()
    try:
        worlds = [int(w) for w in args.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks must be integers separated by commas, got {args.ranks!r}")
    if not worlds or min(worlds) < 1:
        ap.error("--ranks must name world sizes of at least 1")
    example = os.path.join(ROOT, "examples", "train_gpt_distributed.py")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        for world in worlds:
            out = os.path.join(tmp, f"{world}.json")
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={world}", script, example, out], capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"torchrun with {world} rank(s) failed:\n{p.stderr[-3000:]}")
            with open(out) as f:
                ranks = json.load(f)
            print(f"{world} rank(s): " + ", ".join(f"{r['host_bytes']:,} B" for r in ranks), file=sys.stderr)
            rows.append((world, ranks))
    whole = rows[0][1][0]["host_bytes"] if rows[0][0] == 1 else None
    lines = ["# TieredAdamW under FSDP2: optimizer state per rank", "",
             "Command: `python bench/python/bench_fsdp2_state.py --ranks " + args.ranks + "` (torchrun, gloo, CPU; "
             "the GPT of examples/train_gpt_distributed.py: vocab 256, d_model 128, 4 heads, 4 blocks, seq 32)", "",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, no GPU; {time.strftime('%Y-%m-%d')}", "",
             "| ranks | params per rank | host bytes per rank (fp32 params, exp_avg, exp_avg_sq, grads) | of one process |",
             "|---:|---|---|---:|"]
    for world, ranks in rows:
        biggest = max(r["host_bytes"] for r in ranks)
        share = f"{biggest / whole:.3f}" if whole else "-"
        params = ", ".join(f"{r['params']:,}" for r in ranks)
        held = ", ".join(f"{r['host_bytes']:,}" for r in ranks)
        lines.append(f"| {world} | {params} | {held} | {share} (largest rank) |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
