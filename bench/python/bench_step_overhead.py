#!/usr/bin/env python3
"""What TieredAdamW.step() costs in Python: the step's wall time less the time spent inside calls
of the native engine.

  python bench/python/bench_step_overhead.py [--python NAME=INTERPRETER ...] [--rounds 5] [--out FILE.md]

Each model (about 1M and 100M fp32 parameters, and 0.4M in 400 tensors: stacks of Linear +
LayerNorm on CPU tensors, so one large and three small tensors per block) trains with a real backward; each step() is
timed whole, and every call of the native engine's methods (and of its step protocol's, where
there is one) is timed by a proxy put around the native object, so the difference is everything the torch adapter does around the engine (gathering
gradients, building the step's segments, checks, write-back, bookkeeping); the check that
follows params a framework moved after the optimizer was built is timed on its own too, and so is
each backward, in which the optimizer's gradient hooks run. Without a GPU the
engine runs on the simulated device, whose "GPU" updates run on the host: the engine's own time
is real work either way, and the Python-side cost is what this page is about.

With several --python interpreters (for example an install of the code before a change and one
after), each (interpreter, model) runs in its own child process, the children alternating round
by round, so that both see the same machine: the shared VM's speed drifts over minutes.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: plotting
from plotting import cpu_model  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODELS = {
    # name: (blocks, width, subgroup size, steps per round)
    "1M": (4, 512, 262_144, 40),
    "100M": (24, 2048, 8_388_608, 4),
    # Many small tensors (0.4M params in 400): the per-tensor cost, which on a GPU-resident step
    # (fast there) is what the Python side is made of.
    "400 tensors": (100, 64, 262_144, 40),
}


def _native_holder(opt):
    """(object, attribute) holding the native engine whose calls are timed: the optimizer's
    engine wrapper before the engine owned the step, the optimizer itself after."""
    engine = getattr(opt, "engine", None)
    if engine is not None and hasattr(engine, "native"):
        return engine, "native"
    if type(engine).__name__ == "UpdateEngine":
        return opt, "engine"
    raise RuntimeError("bench_step_overhead: cannot find TieredAdamW's native engine")


class _Timed:
    """Forwards every attribute to the native engine and times every call of its methods (step,
    and whatever else the adapter asks of it: gradients, syncs): all of it is the engine's own."""

    def __init__(self, native):
        object.__setattr__(self, "_native", native)
        object.__setattr__(self, "seconds", 0.0)

    def __getattr__(self, name):
        value = getattr(self._native, name)
        if not callable(value):
            return value

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                object.__setattr__(self, "seconds", self.seconds + time.perf_counter() - t0)

        return timed


class _TimedMethods:
    """Times the calls of some of an object's own methods (outermost calls only, so a method that
    calls another of them is counted once): what the adapter's follow of moved params costs."""

    def __init__(self, obj, names):
        self.seconds = 0.0
        self._depth = 0
        for name in names:
            if hasattr(obj, name):
                setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, method):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0

        return timed


def child(model: str, policy: str, steps: int) -> dict:
    import torch

    import memtide.optim

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks, width, subgroup, _ = MODELS[model]
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    net = torch.nn.Sequential(*layers)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:  # under torchrun (--ranks): FSDP2 over gloo, each block a unit, the params DTensors
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in layers:
            fully_shard(layer)
        fully_shard(net)
    opt = memtide.optim.TieredAdamW(net.parameters(), lr=1e-4, policy=policy, subgroup_size=subgroup)
    holder, attr = _native_holder(opt)
    timed = [_Timed(getattr(holder, attr))]
    setattr(holder, attr, timed[0])
    if getattr(opt, "protocol", None) is not None:  # the step protocol's calls are native too (after it existed)
        timed.append(_Timed(opt.protocol))
        opt.protocol = timed[-1]
    # The per-step check that follows params a framework moved (absent before it existed: 0).
    check = _TimedMethods(opt, ("_follow_params", "_bindings"))
    x = torch.randn(2, width)
    rows = []
    for i in range(steps + 2):  # two warm-up steps
        loss = net(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()  # the optimizer's gradient hooks run in it
        backward = time.perf_counter() - t0
        before, checked = sum(t.seconds for t in timed), check.seconds
        t0 = time.perf_counter()
        opt.step()
        wall = time.perf_counter() - t0
        engine = sum(t.seconds for t in timed) - before
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            rows.append((wall, engine, check.seconds - checked, backward))
    params = sum(p.numel() for p in net.parameters())
    out = {"params": params, "tensors": len(list(net.parameters())), "rows": rows}
    if ranks > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out




def torch_reads(count: int = 96, repeats: int = 2000) -> dict:
    """What torch charges Python for one read of what the step must check per param (warm, in
    this process: the floor under the cold reads a step makes): ns per read over `count`
    Parameters with gradients, each read in one C-level pass (map), as TieredAdamW reads them."""
    import operator

    import torch

    params = [torch.nn.Parameter(torch.zeros(8)) for _ in range(count)]
    for p in params:
        p.grad = torch.zeros(8)
    grads = [p.grad for p in params]
    reads = {"p.grad": (operator.attrgetter("grad"), params),
             "p.data_ptr()": (torch.Tensor.data_ptr, params),
             "p._version": (operator.attrgetter("_version"), params),
             "grad.data_ptr()": (torch.Tensor.data_ptr, grads),
             "grad._version": (operator.attrgetter("_version"), grads)}
    out = {}
    for name, (read, tensors) in reads.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats // 5):
                list(map(read, tensors))
            best = min(best, (time.perf_counter() - t0) / (repeats // 5) / count)
        out[name] = best
    try:
        from memtide.optim import torch_reads as native
    except ImportError:  # a memtide before the native reads
        return out
    reader = native.for_params(params)
    if reader is not None:  # all five of a param's reads, and its gradient's, in one call
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats // 5):
                reader.read()
            best = min(best, (time.perf_counter() - t0) / (repeats // 5) / count)
        out["all five, natively (memtide.optim.torch_reads)"] = best
    return out


def _shown(argv):
    """The command line as the page shows it: interpreters by name only and the page's own path
    from the repository's root (both paths are this machine's)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = []
    for arg in argv:
        name, sep, path = arg.partition("=")
        if sep and os.path.sep in path:
            out.append(f"{name}=INTERPRETER")
        elif os.path.isabs(arg):
            out.append(os.path.relpath(arg, root) if arg.startswith(root + os.path.sep) else os.path.basename(arg))
        else:
            out.append(arg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", action="append", default=[], metavar="NAME=INTERPRETER",
                    help="an interpreter with memtide installed (default: this one, named 'this')")
    ap.add_argument("--models", default="1M,100M,400 tensors")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=1,
                    help="> 1: each child is that many processes (torchrun, gloo) training the model under FSDP2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, steps = args.child.split(":")
        out = child(model, args.policy, int(steps))
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for all
            print(json.dumps(out))
        return

    pythons = []
    for spec in args.python or [f"this={sys.executable}"]:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--python {spec!r}: expected NAME=INTERPRETER")
        pythons.append((name, path))
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    samples = {(n, m): [] for n, _ in pythons for m in models}
    meta = {}
    for r in range(args.rounds):
        order = pythons[r % len(pythons):] + pythons[:r % len(pythons)]
        for m in models:
            for name, path in order:
                launch = ([path] if args.ranks == 1 else
                          [path, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"])
                out = subprocess.run(launch + [__file__, "--child", f"{m}:{MODELS[m][3]}", "--policy", args.policy],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"{name} {m}: child failed:\n{out.stderr}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                meta[m] = (result["params"], result["tensors"])
                samples[(name, m)] += result["rows"]
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    lines = [
        "# TieredAdamW.step(): the Python side",
        "",
        "`python bench/python/bench_step_overhead.py " + " ".join(_shown(sys.argv[1:])) + "`",
        "",
        f"- {time.strftime('%Y-%m-%d')}: {cpu_model()}, {os.cpu_count()} cores, no GPU used, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        f"- policy {args.policy}; CPU tensors, so the engine runs on the simulated device (its 'GPU' updates run on "
        "the host); torch intra-op threads 1; medians over every timed step of every round"
        + (f"; FSDP2 on {args.ranks} ranks (torchrun, gloo; rank 0's steps), so every param is a DTensor"
           if args.ranks > 1 else ""),
        "",
        "| code | model | params (tensors) | step() ms | engine ms | Python side ms | param check us | backward ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        params, tensors = meta[m]
        for name, _ in pythons:
            rows = samples[(name, m)]
            wall = statistics.median(r[0] for r in rows)
            engine = statistics.median(r[1] for r in rows)
            side = statistics.median(r[0] - r[1] for r in rows)
            checked = statistics.median(r[2] if len(r) > 2 else 0.0 for r in rows)
            backward = statistics.median(r[3] for r in rows) if all(len(r) > 3 for r in rows) else float("nan")
            lines.append(f"| {name} | {m} | {params / 1e6:.2f}M ({tensors}) | {wall * 1e3:.3f} | {engine * 1e3:.3f} | "
                         f"{side * 1e3:.3f} | {checked * 1e6:.1f} | {backward * 1e3:.3f} |")
    lines.append("")
    reads = torch_reads()
    lines += ["What torch charges Python per tensor for the reads the step's checks make (warm: 96 Parameters "
              "with gradients, one C-level pass each, best of 5; this interpreter):", "",
              "| read | ns per tensor |", "|---|---:|"]
    lines += [f"| `{name}` | {ns * 1e9:.0f} |" if "natively" not in name else f"| {name} | {ns * 1e9:.0f} |"
              for name, ns in reads.items()]
    lines.append("")
    text = "\n".join(lines)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
