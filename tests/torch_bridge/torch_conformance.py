"""One process's half of the allocator conformance suite (test_torch_conformance.py).

    python torch_conformance.py native|memtide [--only CHECK ...]

Runs the same tensor operations on the allocator named, then prints one JSON object: check name
-> what it observed. The test runs it once per allocator, each in a fresh process (an allocator
is chosen before CUDA starts), and compares. `--ddp-rank R --port P` is the per-rank child of the
DDP check. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable, Dict

MiB = 1 << 20


def stats_meaning(torch) -> Dict[str, Any]:
    """The stats keys, and what known tensors do to the counters torch users read."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(5000, dtype=torch.uint8, device="cuda")
    during = torch.cuda.memory_stats()
    del x, y
    after = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    reset = torch.cuda.memory_stats()

    def delta(stats, key):
        return stats[key] - before[key]

    return {
        "keys": sorted(during),
        "allocated": delta(during, "allocated_bytes.all.current"),
        "requested": delta(during, "requested_bytes.all.current"),
        "allocations": delta(during, "allocation.all.current"),
        "small_pool_allocated": delta(during, "allocated_bytes.small_pool.current"),
        "allocated_after_free": delta(after, "allocated_bytes.all.current"),
        "peak_is_current_after_reset": reset["allocated_bytes.all.peak"] == reset["allocated_bytes.all.current"],
        "memory_allocated_agrees": torch.cuda.memory_allocated() == reset["allocated_bytes.all.current"],
        "max_reserved_agrees": torch.cuda.max_memory_reserved() == reset["reserved_bytes.all.peak"],
    }


def out_of_memory(torch) -> Dict[str, Any]:
    """The exception a too-large tensor raises, and that the allocator works after it."""
    total = torch.cuda.get_device_properties(0).total_memory
    is_oom = False
    try:
        torch.empty(total * 2, dtype=torch.uint8, device="cuda")
        raised = None
    except Exception as e:  # noqa: BLE001 - the type is the observation
        raised = type(e).__name__
        is_oom = isinstance(e, torch.OutOfMemoryError)
    works = float(torch.ones(10, device="cuda").sum())
    return {"raised": raised, "is_torch_oom": is_oom, "works_after": works,
            "num_ooms": torch.cuda.memory_stats()["num_ooms"]}


def record_stream(torch) -> Dict[str, Any]:
    """A block used on a side stream is not handed out again while that stream still uses it."""
    side = torch.cuda.Stream()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(5e8))  # keeps the side stream busy for a good fraction of a second
        x.fill_(7)
    x.record_stream(side)
    del x
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    reused_while_busy = y.data_ptr() == ptr
    busy_at_check = not side.query()
    side.synchronize()
    del y
    return {"reused_while_busy": reused_while_busy, "side_stream_was_busy": busy_at_check}


def empty_cache(torch) -> Dict[str, Any]:
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del x
    cached = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return {"released_at_least_256MiB": cached - torch.cuda.memory_reserved() >= 256 * MiB}


def cuda_graph(torch) -> Dict[str, Any]:
    """Capture into a private pool, replay with new input, release the pool."""
    static_in = torch.zeros(4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            static_in * 2 + 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = static_in * 2 + 1
    pools = {tuple(s["segment_pool_id"]) for s in torch.cuda.memory._snapshot()["segments"]}
    static_in.copy_(torch.arange(4096.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ok = bool(torch.equal(static_out, torch.arange(4096.0, device="cuda") * 2 + 1))
    del graph, static_out
    return {"replay_correct": ok, "private_pool_segments": any(p != (0, 0) for p in pools)}


def cudnn_benchmark(torch) -> Dict[str, Any]:
    """cudnn's benchmark mode asks the allocator how much it may use (cacheInfo)."""
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    out = conv(torch.randn(8, 16, 64, 64, device="cuda"))
    torch.cuda.synchronize()
    return {"shape": list(out.shape)}


def ddp_step(torch, allocator: str) -> Dict[str, Any]:
    """Two processes, one DDP step each (gloo, both on GPU 0); the ranks must agree."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, allocator, "--ddp-rank", str(r), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        if p.returncode != 0:
            raise RuntimeError(f"DDP rank exited {p.returncode}: {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {"checksums": [o["checksum"] for o in outs], "paths": [o["path"] for o in outs]}


def ddp_rank(allocator: str, rank: int, port: int) -> None:
    torch = start(allocator)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)  # different data per rank: the allreduce must make them agree
    model(torch.randn(32, 64, device="cuda")).pow(2).mean().backward()
    opt.step()
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    dist.destroy_process_group()
    print(json.dumps({"checksum": checksum, "path": PATH}))


CHECKS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "stats": stats_meaning,
    "record_stream": record_stream,
    "empty_cache": empty_cache,
    "cuda_graph": cuda_graph,
    "cudnn_benchmark": cudnn_benchmark,
    "out_of_memory": out_of_memory,  # last but DDP: it leaves the OOM counter raised
}

PATH = "native"


def start(allocator: str):
    global PATH
    import torch

    if allocator == "memtide":
        import memtide

        PATH = memtide.use_with_torch()["path"]
    return torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("allocator", choices=["native", "memtide"])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--ddp-rank", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.ddp_rank is not None:
        ddp_rank(args.allocator, args.ddp_rank, args.port)
        return 0
    torch = start(args.allocator)
    if not torch.cuda.is_available():
        print("torch_conformance: needs a CUDA GPU", file=sys.stderr)
        return 2
    results: Dict[str, Any] = {"path": PATH}
    for name, check in CHECKS.items():
        if args.only is None or name in args.only:
            try:
                results[name] = check(torch)
            except Exception as e:  # noqa: BLE001 - reported, compared, and failed by the test
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if args.only is None or "ddp" in args.only:
        try:
            results["ddp"] = ddp_step(torch, args.allocator)
        except Exception as e:  # noqa: BLE001
            results["ddp"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
