#!/usr/bin/env python3
"""How long `memtide timeline` takes on a large trace.

--source observe (default): a trace that memtide itself writes. A small C program allocates and
frees through a stand-in CUDA runtime (a libcudart built here from malloc: no GPU needed) under
`memtide observe --timeline`, which turns the observer's log into a trace of N events (each
cudaMalloc and cudaFree is an alloc/free event and a memory sample). Then `memtide timeline
TRACE -o REPORT.html` renders it, as a user would run it (progress line on, all four outputs).

--source synthetic: a trace written through TraceWriter (ops on every engine, memory samples,
phase marks), rendered with render() and write_chrome() in-process.

--source tiers: the same with every tier: device memory samples, PCIe and compute ops, host
samples (arena, staging, resident memory) and NVMe reads, write-backs and waits in each update
phase, in equal shares; the HTML report rendered with render() in-process (target: 1e6 events in
under 10 s).

    python bench/python/bench_timeline.py [--source observe|synthetic|tiers] [--events N] [--out bench/results/timeline/DATE-MACHINE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date

import memtide
from memtide import _timeline as timeline

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

FAKE_CUDART = r"""
#include <stdlib.h>
int cudaMalloc(void** p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaFree(void* p) { free(p); return 0; }
"""

# Allocates PAIRS blocks of 1-64 KiB in a sliding window of 64 live blocks, freeing the oldest.
PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
int cudaMalloc(void** p, size_t n);
int cudaFree(void* p);
int main(int argc, char** argv) {
  long pairs = atol(argv[1]);
  void* live[64] = {0};
  for (long i = 0; i < pairs; ++i) {
    if (live[i % 64]) cudaFree(live[i % 64]);
    if (cudaMalloc(&live[i % 64], (size_t)(1 + i % 64) << 10) != 0) return 1;
  }
  for (int k = 0; k < 64; ++k) if (live[k]) cudaFree(live[k]);
  return 0;
}
"""




def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _memtide(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memtide.cli", *args], capture_output=True, text=True, **kw)


def bench_observe(events: int, d: str) -> tuple:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_timeline: --source observe needs a C compiler (cc) for the stand-in CUDA runtime")
    with open(os.path.join(d, "fake.c"), "w") as f:
        f.write(FAKE_CUDART)
    with open(os.path.join(d, "prog.c"), "w") as f:
        f.write(PROGRAM)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", os.path.join(d, "libcudart.so"), os.path.join(d, "fake.c")],
                   check=True)
    subprocess.run([cc, "-O2", "-o", os.path.join(d, "prog"), os.path.join(d, "prog.c"), "-L", d, "-lcudart",
                    f"-Wl,-rpath,{d}"], check=True)
    # Each cudaMalloc or cudaFree is two trace events (alloc/free and a memory sample).
    pairs = events // 4
    t0 = time.perf_counter()
    p = _memtide("observe", "--log", os.path.join(d, "obs.jsonl"), "--timeline", os.path.join(d, "obs.html"), "--",
                 os.path.join(d, "prog"), str(pairs), cwd=d)
    observe_s = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"memtide observe failed ({p.returncode}): {p.stderr[-2000:]}")
    trace = os.path.join(d, "obs.trace.jsonl")
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    q = _memtide("timeline", trace, "-o", os.path.join(d, "r.html"))
    render_s, render_cpu_s = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if q.returncode != 0:
        raise SystemExit(f"memtide timeline failed ({q.returncode}): {q.stderr[-2000:]}")
    png = "and the PNG" if os.path.exists(os.path.join(d, "r.png")) else "(no PNG: matplotlib is not installed)"
    header, evs = timeline.read_trace(trace)
    n = sum(1 for _ in evs)
    progress = [line for line in q.stderr.splitlines() if line.startswith("timeline: read")]
    line = (f"{n:,} events ({os.path.getsize(trace) / 2**20:.0f} MiB of trace) written by `memtide observe "
            f"--timeline` around a program making {2 * pairs:,} cudaMalloc/cudaFree calls, in {observe_s:.1f} s "
            f"(run, trace and its report); `memtide timeline TRACE -o REPORT.html` then wrote the HTML report "
            f"({os.path.getsize(os.path.join(d, 'r.html')) / 2**10:.0f} KiB), the Chrome trace, the memory_viz pickle "
            f"{png} in {render_s:.1f} s ({render_cpu_s:.1f} s of CPU time: the machine is shared), printing {len(progress)} progress lines "
            f"(last: \"{progress[-1] if progress else ''}\")")
    command = f"python bench/python/bench_timeline.py --source observe --events {events}"
    return line, command


def bench_synthetic(events: int, d: str) -> tuple:
    engines = ("compute", "link", "h2d", "d2h", "host")
    trace = os.path.join(d, "big.trace.jsonl")
    t0 = time.perf_counter()
    with timeline.TraceWriter(trace, source="bench", clock="virtual", capacity_bytes=80 << 30) as w:
        n, t = 0, 0.0
        while n < events:
            if n % 100_000 == 0:
                w.phase(t, ("forward", "backward", "update")[(n // 100_000) % 3])
                n += 1
            w.op(engines[n % 5], t, t + 2e-6, 1 << 20)
            w.memory(t, (20 << 30) + (n % 1000) * (1 << 20), 40 << 30)
            n += 2
            t += 1e-6
    write_s = time.perf_counter() - t0
    size = os.path.getsize(trace)
    t0 = time.perf_counter()
    out = timeline.render(trace, os.path.join(d, "r.html"))
    render_s = time.perf_counter() - t0
    html_size = os.path.getsize(os.path.join(d, "r.html"))
    t0 = time.perf_counter()
    header, evs = timeline.read_trace(trace)
    chrome_n = timeline.write_chrome(header, evs, os.path.join(d, "r.json"))
    chrome_s = time.perf_counter() - t0
    line = (f"{out['events']:,} events ({size / 2**20:.0f} MiB of trace): written in {write_s:.1f} s; the HTML "
            f"report ({html_size / 2**10:.0f} KiB) rendered in {render_s:.1f} s; the Chrome trace ({chrome_n:,} "
            f"events) in {chrome_s:.1f} s more")
    return line, f"python bench/python/bench_timeline.py --source synthetic --events {events}"


def bench_tiers(events: int, d: str) -> tuple:
    trace = os.path.join(d, "tiers.trace.jsonl")
    t0 = time.perf_counter()
    kinds = {}
    with timeline.TraceWriter(trace, source="bench", clock="virtual", capacity_bytes=80 << 30,
                              host_capacity_bytes=512 << 30, nvme_capacity_bytes=2 << 40) as w:
        n, t, sg = 0, 0.0, 0
        w.event(type="spill", t=0.0, bytes=1 << 40)
        while n < events:
            if n % 100_000 == 0:
                phase = ("forward", "backward", "update")[(n // 100_000) % 3]
                w.phase(t, phase)
                n += 1
            k = n % 6
            if k == 0:
                w.memory(t, (20 << 30) + (n % 1000) * (1 << 20), 40 << 30)
            elif k == 1:
                w.op(("compute", "h2d", "d2h")[n % 3], t, t + 2e-6, 1 << 20)
            elif k == 2:
                w.event(type="host", t=t, reserved=300 << 30, allocated=(200 << 30) + (n % 997) * (1 << 20),
                        staging=4 << 30, rss=(310 << 30) + (n % 991) * (1 << 20))
            else:
                what = ("read", "wait", "write")[k - 3]
                sg += what == "read"
                w.event(type="nvme", what=what, subgroup=sg, queued=t, start=t, end=t + 3e-6, bytes=64 << 20)
            kinds[k] = kinds.get(k, 0) + 1
            n += 1
            t += 1e-6
    write_s = time.perf_counter() - t0
    size = os.path.getsize(trace)
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = timeline.render(trace, os.path.join(d, "r.html"))
    render_s, render_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    html_size = os.path.getsize(os.path.join(d, "r.html"))
    line = (f"{out['events']:,} events ({size / 2**20:.0f} MiB of trace; device memory {kinds.get(0, 0):,}, ops "
            f"{kinds.get(1, 0):,}, host samples {kinds.get(2, 0):,}, NVMe reads, waits and write-backs "
            f"{kinds.get(3, 0) + kinds.get(4, 0) + kinds.get(5, 0):,}): written in {write_s:.1f} s; the HTML report "
            f"with every tier ({html_size / 2**10:.0f} KiB) rendered in {render_s:.1f} s, {render_cpu_s:.1f} s of CPU time "
            f"(target: under 10 s; the machine is shared)")
    return line, f"python bench/python/bench_timeline.py --source tiers --events {events}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("observe", "synthetic", "tiers"), default="observe")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--out")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        bench = {"observe": bench_observe, "synthetic": bench_synthetic, "tiers": bench_tiers}[args.source]
        line, command = bench(args.events, d)
    print(line)
    if args.out:
        gpu = "no GPU" if memtide.cuda_status()["device_count"] == 0 else "a GPU present (not used)"
        with open(args.out, "w") as f:
            f.write(f"# memtide timeline on a large trace ({date.today()})\n\n")
            f.write(f"Command: `{command} --out {args.out}`\n\n")
            f.write(f"Machine: {cpu_model()}, {os.cpu_count()} cores, {gpu}; {platform.system()} {platform.release()}, "
                    f"memtide {memtide.__version__}, Python {platform.python_version()}; load average "
                    f"{os.getloadavg()[0]:.1f} at the end (other work shares the cores: wall times vary, CPU time "
                    f"less).\n\n{line}.\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
