#!/usr/bin/env python3
"""Checkpoints that do not stop training: TieredAdamW.save_checkpoint against torch.save and
torch.distributed.checkpoint.async_save of the same optimizer, on CPU tensors.

  python bench/python/bench_async_checkpoint.py [--params 300e6] [--layers 18] [--batch 8]
      [--rounds 3] [--dir FOLDER] [--out FILE.md]

The model: `layers` Linear(width, width) without bias, width chosen so that the model has about
`params` params, trained with TieredAdamW(policy="cpu"); the optimizer's state is 16 B/param (fp32
params, moments, gradients), of which a checkpoint holds 12 B/param.

A round trains `iters` iterations (zero_grad, forward, backward, step) without a save, then asks
for a save and trains until it is committed and two iterations more. The iterations that began
while the save ran are "during the save"; the ratio of their median to the median without a save
is the round's cost; the medians of the rounds are reported. A save's time (and rate) runs until
the checkpoint is in place; removing the checkpoint it replaced follows and is shown in brackets. The extra host memory is the process's
resident size, sampled every 2 ms, above its level just before the first save: memory a save keeps
for the next one (its copy-on-write buffers) counts in every round. The disk's own rate is
measured in the same folder: the faster of buffered writes and O_DIRECT writes, as the save
writes (whole blocks with O_DIRECT, straight from the optimizer's arrays).

torch.save(optimizer.state_dict()) stops training for its whole length; DCP's async_save first
stages a copy of the whole state dict in host memory, unless its storage writer is memtide's
StateWriter, which freezes the state instead. Each is timed once, in the same run, into the same
folder, training going on while an async save runs, and their peak extra memory sampled the same
way.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

import memtide  # noqa: F401 - after torch, as users import it
from memtide.optim import TieredAdamW

GiB = float(1 << 30)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The largest resident size while inside the `with` block, sampled every 2 ms."""

    def __init__(self) -> None:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def disk_rate(folder: str, nbytes: int) -> float:
    """Bytes/s the disk sustains writing `nbytes` into a new file in `folder`: the faster of
    buffered writes (8 MiB pwrites, written back and dropped every 64 MiB) and O_DIRECT writes
    (8 MiB from page-aligned memory), each ending with fdatasync."""
    import mmap

    best = 0.0
    for direct in (False, True):
        buf = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
        buf.write(b"\x01" * (8 << 20))
        path = os.path.join(folder, ".bench-disk-rate")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError:  # a file system without O_DIRECT
            continue
        try:
            os.posix_fallocate(fd, 0, nbytes)
            t0 = time.perf_counter()
            off = 0
            while off < nbytes:
                off += os.pwrite(fd, memoryview(buf)[: min(len(buf), nbytes - off)], off)
                if not direct and (off % (64 << 20) == 0 or off == nbytes):
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, off, os.POSIX_FADV_DONTNEED)
            os.fdatasync(fd)
            best = max(best, nbytes / (time.perf_counter() - t0))
        finally:
            os.close(fd)
            os.unlink(path)
    return best


# A writer with nothing of memtide: the checkpoint's bytes from one page-aligned 8 MiB buffer with
# O_DIRECT, in a process of its own (it spends a syscall per 8 MiB and reads no optimizer memory).
# What the iterations lose beside it is what this machine charges any writer of those bytes.
_BARE_WRITER = """
import mmap, os, sys
path, n = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, 8 << 20)
buf.write(b"\\x01" * (8 << 20))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
try:
    off = 0
    while off < n:
        off += os.pwrite(fd, memoryview(buf)[: min(len(buf), n - off)], off)
    os.fdatasync(fd)
finally:
    os.close(fd)
    os.unlink(path)
"""


def beside_bare_writer(model, opt, x, folder: str, nbytes: int, plain: float) -> dict:
    """The iterations that begin while a bare O_DIRECT writer (_BARE_WRITER) writes `nbytes` into
    `folder`, counted as a save's are: this machine's floor for a writer of the checkpoint."""
    import subprocess

    t0 = time.perf_counter()
    writer = subprocess.Popen([sys.executable, "-c", _BARE_WRITER, os.path.join(folder, ".bench-bare-writer"),
                               str(nbytes)], stderr=subprocess.PIPE)
    during = []
    while writer.poll() is None:
        during.append(iteration(model, opt, x))
    took = time.perf_counter() - t0
    if writer.returncode != 0:
        raise RuntimeError(f"the bare writer failed: {writer.stderr.read().decode().strip()}")
    iteration(model, opt, x)  # the one it ended in is counted; one more to settle
    return {"during": statistics.median(during), "n_during": len(during), "write_s": took,
            "lost_s": sum(during) - len(during) * plain}


def dcp_async_save(model, opt, x, folder: str, writer, buffer_bytes: int, plain: float) -> dict:
    """One dcp.async_save of the optimizer's state dict while training goes on, with DCP's default
    stager (a copy of the whole state) or memtide's StateWriter (the state frozen, no copy)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from memtide.optim import StateWriter

    with warnings.catch_warnings(), PeakRss() as mem:
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        t0 = time.perf_counter()
        storage = StateWriter(folder, opt, buffer_bytes=buffer_bytes) if writer == "memtide" else None
        fut = dcp.async_save({"optim": opt.state_dict()}, checkpoint_id=folder, storage_writer=storage)
        returned = time.perf_counter() - t0
        during = []
        while not fut.done():
            during.append(iteration(model, opt, x))
        fut.result()
        total = time.perf_counter() - t0
    out = {"blocked_s": returned, "extra": mem.extra, "total_s": total, "n_during": len(during),
           "during": statistics.median(during) if during else float("nan"), "plain": plain}
    if storage is not None:
        p = storage.progress()
        out.update(waited_s=p["waited_s"], copied=p["copied_bytes"], buffer_peak=p["peak_buffer_bytes"])
    return out


def build(params: float, layers: int, subgroup_size: int, spill_dir: str = ""):
    width = int((params / layers) ** 0.5) // 64 * 64
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    kw = {}
    if spill_dir:
        # A spilled state needs a 16-bit model: an fp32 one would be a host copy of the very state
        # that spilled (TieredAdamW refuses it).
        model = model.to(torch.bfloat16)
        # Host memory for about half the state: 16 B/param of the half kept, the gradients (4 B)
        # of the half spilled, and the read-ahead's staging (two subgroups of 12 B/param).
        n = layers * width * width
        kw = dict(nvme_dir=spill_dir, host_budget=10 * n + 2 * 12 * subgroup_size)
    opt = TieredAdamW(model.parameters(), lr=1e-4, weight_decay=0.01, policy="cpu", subgroup_size=subgroup_size, **kw)
    return model, opt, width


def iteration(model, opt, x) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=300e6)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=4, help="iterations without a save in each round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffer-bytes", type=float, default=0,
                    help="the copy-on-write bound (0: TieredAdamW's default, two of the largest subgroup)")
    ap.add_argument("--subgroup-size", type=int, default=100_000_000)
    ap.add_argument("--dir", help="folder the checkpoints go to (default: a new one under the temp folder)")
    ap.add_argument("--no-peers", action="store_true", help="skip torch.save and DCP async_save")
    ap.add_argument("--spill", action="store_true",
                    help="about half the state on NVMe (host_budget, nvme_dir: a folder beside the checkpoints)")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the bare O_DIRECT writer of the same bytes beside training in each round")
    ap.add_argument("--out", help="Markdown file to write")
    args = ap.parse_args()

    parent = args.dir or tempfile.mkdtemp(prefix="memtide-bench-ckpt-")
    spill_dir = ""
    if args.spill:
        spill_dir = os.path.join(parent, "spill")
        os.makedirs(spill_dir, exist_ok=True)
    model, opt, width = build(args.params, args.layers, args.subgroup_size, spill_dir)
    n = opt.layout.numel
    spilled = opt.spilled_subgroups
    x = torch.randn(args.batch, width).to(next(model.parameters()).dtype)
    for _ in range(2):
        iteration(model, opt, x)
    state_bytes = 16 * n
    save_bytes = 12 * n
    print(f"model {n / 1e6:.1f}M params ({args.layers} x {width}^2), optimizer state {state_bytes / GiB:.2f} GiB, "
          f"a checkpoint {save_bytes / GiB:.2f} GiB, into {parent}", file=sys.stderr, flush=True)
    rate = disk_rate(parent, min(save_bytes, 4 << 30))
    print(f"disk: {rate / 1e9:.2f} GB/s", file=sys.stderr, flush=True)

    rounds = []
    target = os.path.join(parent, "ckpt")
    before_saves = rss_bytes()
    for r in range(args.rounds):
        plain = [iteration(model, opt, x) for _ in range(args.iters)]
        with PeakRss() as mem:
            t0 = time.perf_counter()
            save = opt.save_checkpoint(target, buffer_bytes=int(args.buffer_bytes))
            asked_s = time.perf_counter() - t0
            during, after = [], 0
            while after < 2:
                running = not save.done()
                dt = iteration(model, opt, x)
                if running:
                    during.append(dt)
                else:
                    after += 1
            save.wait()
        p = save.progress()
        rounds.append({"plain": statistics.median(plain), "during": statistics.median(during), "n_during": len(during),
                       "lost_s": sum(during) - len(during) * statistics.median(plain),
                       "asked_s": asked_s, "save_s": p.get("committed_s") or p["elapsed_s"], "end_s": p["elapsed_s"], "write_s": p["write_s"], "waited_s": p["waited_s"],
                       "copied": p["copied_bytes"], "copy_s": p.get("copy_s", float("nan")),
                       "extra": mem.peak - before_saves, "buffer_peak": p["peak_buffer_bytes"], "bytes": p["bytes_total"],
                       "direct": p["direct_bytes"] / max(1, p["bytes_total"])})
        rr = rounds[-1]
        if not args.no_floor:
            rr["bare"] = beside_bare_writer(model, opt, x, parent, rr["bytes"], rr["plain"])
        print(f"round {r + 1}: iteration {rr['plain'] * 1e3:.0f} ms, during the save {rr['during'] * 1e3:.0f} ms "
              f"({rr['n_during']} iterations, {rr['during'] / rr['plain']:.2f}x); save {rr['save_s']:.2f} s "
              f"({rr['bytes'] / rr['save_s'] / 1e9:.2f} GB/s), training waited {rr['waited_s']:.2f} s; "
              f"extra memory {rr['extra'] / GiB:.3f} GiB"
              + (f"; beside a bare writer of the same bytes {rr['bare']['during'] / rr['plain']:.2f}x"
                 if "bare" in rr else ""), file=sys.stderr, flush=True)

    peers = {}
    if not args.no_peers:
        # torch.save: training stops while it runs.
        path = os.path.join(parent, "torch-save.pt")
        with PeakRss() as mem:
            t0 = time.perf_counter()
            torch.save(opt.state_dict(), path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            peers["torch.save (blocking)"] = {"blocked_s": time.perf_counter() - t0, "extra": mem.extra}
        os.unlink(path)
        plain = rounds[-1]["plain"]
        for name, writer in (("DCP async_save (default stager)", None),
                             ("DCP async_save through memtide.optim.StateWriter", "memtide")):
            try:
                peers[name] = dcp_async_save(model, opt, x, os.path.join(parent, "dcp"), writer,
                                             int(args.buffer_bytes), plain)
            except Exception as e:  # DCP's one-process path differs between torch versions: say why
                peers[name] = {"error": f"{type(e).__name__}: {e}"}
            shutil.rmtree(os.path.join(parent, "dcp"), ignore_errors=True)
    if not args.dir:
        shutil.rmtree(parent, ignore_errors=True)
    else:
        shutil.rmtree(target, ignore_errors=True)

    ratio = statistics.median(r["during"] / r["plain"] for r in rounds)
    lost = statistics.median(r["lost_s"] for r in rounds)
    save_s = statistics.median(r["save_s"] for r in rounds)
    tput = statistics.median(r["bytes"] / r["save_s"] for r in rounds)
    lines = [
        f"# Checkpoints while training goes on, {datetime.date.today().isoformat()}",
        "",
        f"Command: `python bench/python/bench_async_checkpoint.py --params {args.params:g} --layers {args.layers} "
        f"--batch {args.batch} --rounds {args.rounds} --subgroup-size {args.subgroup_size} --buffer-bytes "
        f"{args.buffer_bytes:g}{' --spill' if args.spill else ''}` ({platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}). Model: {n / 1e6:.1f}M params ({args.layers} x Linear({width}, {width})), "
        f"{'a bf16 model (fp32 masters), ' if args.spill else ''}TieredAdamW(policy=\"cpu\", subgroup_size={args.subgroup_size}); optimizer state {state_bytes / GiB:.2f} GiB, a checkpoint "
        f"{save_bytes / GiB:.2f} GiB. Disk (the faster of buffered and O_DIRECT writes): {rate / 1e9:.2f} GB/s."
        + (f" {spilled} of {len(opt.nvme_info()['on_nvme'])} subgroups spilled "
           "to NVMe in the same file system: the save reads them from the spill file while the steps stream "
           "them through it." if args.spill else ""),
        "",
        "| round | iteration, no save | iteration during the save (median) | ratio | iterations during | training "
        "time lost | save (to its end) | save rate | of the disk | steps waited | steps copied aside | extra host memory | "
        "copy-on-write peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {r['plain'] * 1e3:.0f} ms | {r['during'] * 1e3:.0f} ms | {r['during'] / r['plain']:.2f}x | "
            f"{r['n_during']} | {r['lost_s']:.2f} s | {r['save_s']:.2f} s ({r['end_s']:.2f} s) | "
            f"{r['bytes'] / r['save_s'] / 1e9:.2f} GB/s | "
            f"{r['bytes'] / r['save_s'] / rate * 100:.0f}% | {r['waited_s']:.2f} s | "
            f"{r['copied'] / GiB:.3f} GiB in {r['copy_s']:.2f} s | {r['extra'] / GiB:.3f} GiB | "
            f"{r['buffer_peak'] / GiB:.3f} GiB |")
    lines += ["", f"Median ratio of an iteration during the save to one without: **{ratio:.2f}x** (target <= 1.10x). "
              f"Median save rate {tput / 1e9:.2f} GB/s, **{tput / rate * 100:.0f}%** of the disk's "
              f"{rate / 1e9:.2f} GB/s (target >= 80%). Training time lost to the save: {lost:.2f} s of the save's "
              f"{save_s:.2f} s (median). A step that reaches a subgroup the writer has not saved copies it aside "
              "(the part not yet written, when the writer is on it), or waits when the copy-on-write buffer is "
              "full. Written with O_DIRECT (straight from the arrays, not through the page "
              f"cache): {statistics.median(r['direct'] for r in rounds) * 100:.0f}% of the bytes.", ""]
    bare = [r["bare"] for r in rounds if "bare" in r]
    if bare:
        lines += ["What this machine charges any writer of the checkpoint's bytes: in each round, after the save, a "
                  "process of its own wrote the same bytes into the same folder with O_DIRECT from one 8 MiB "
                  "buffer (no hashing, no copy, no optimizer memory read), and the iterations that began while it "
                  "ran were counted as the save's are:", "",
                  "| round | iteration beside the bare writer (median) | ratio | iterations during | training time "
                  "lost | its write | the save's ratio | the save's time lost |", "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(rounds):
            if "bare" not in r:
                continue
            b = r["bare"]
            lines.append(f"| {i + 1} | {b['during'] * 1e3:.0f} ms | {b['during'] / r['plain']:.2f}x | {b['n_during']} | "
                         f"{b['lost_s']:.2f} s | {b['write_s']:.2f} s ({r['bytes'] / b['write_s'] / 1e9:.2f} GB/s) | "
                         f"{r['during'] / r['plain']:.2f}x | {r['lost_s']:.2f} s |")
        floor = statistics.median(r["bare"]["during"] / r["plain"] for r in rounds if "bare" in r)
        lines += ["", f"Median ratio beside the bare writer: **{floor:.2f}x**, against the save's {ratio:.2f}x.", ""]
    if peers:
        lines += ["The same optimizer saved by torch's own ways, once each, into the same folder, training going on "
                  "while an async save ran (its iterations against the last round's without a save):", "",
                  "| how | training blocked | whole save | iterations during (median, ratio) | steps waited | "
                  "steps copied aside | extra host memory |", "|---|---|---|---|---|---|---|"]
        for name, v in peers.items():
            if "error" in v:
                lines.append(f"| {name} | - | - | - | - | - | did not run: {v['error']} |")
            elif "total_s" not in v:
                lines.append(f"| {name} | {v['blocked_s']:.2f} s | {v['blocked_s']:.2f} s | - | - | - | "
                             f"{v['extra'] / GiB:.3f} GiB |")
            else:
                ratio_s = (f"{v['n_during']}, {v['during'] * 1e3:.0f} ms, {v['during'] / v['plain']:.2f}x"
                           if v["n_during"] else "0")
                waited = f"{v['waited_s']:.2f} s" if "waited_s" in v else "-"
                copied = f"{v['copied'] / GiB:.3f} GiB (peak {v['buffer_peak'] / GiB:.3f} GiB)" if "copied" in v else "-"
                lines.append(f"| {name} | {v['blocked_s']:.2f} s | {v['total_s']:.2f} s | {ratio_s} | {waited} | "
                             f"{copied} | {v['extra'] / GiB:.3f} GiB |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
