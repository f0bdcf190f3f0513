"""The default job of `memtide run`: train a small GPT-style model with TieredAdamW.

On a usable GPU the model trains there in bf16 with memtide as torch's CUDA allocator, so the
phase report holds real GPU watermarks. Without one, everything is CPU tensors (memtide's
runtime uses a SimDevice, which these tensors never touch): the phase report then gives wall
times only, and the host-side numbers are measured separately.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import memtide
from .planning import HOST_STATE_BYTES_PER_PARAM

TRAIN_DEFAULTS = {
    "layers": 4,
    "hidden": 256,
    "heads": 4,
    "seq": 128,
    "batch": 4,
    "vocab": 8192,
    "iterations": 8,
}
SUBGROUP_DEFAULT = 1_000_000
LR = 1e-3
POLICY_REPEATS = 3


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _digest(opt: Any) -> str:
    """A short hash of the optimizer's whole state, to compare policies bit for bit."""
    import torch

    opt.sync_state()  # spilled subgroups and GPU residents hold theirs elsewhere until then
    h = hashlib.sha256()
    b = opt.buffers
    for t in (b.params, b.exp_avg, b.exp_avg_sq) + ((b.lowp,) if b.lowp is not None else ()):
        # The low-precision copy lives on the GPU when there is one: hashed from a host copy.
        h.update(t.detach().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def choose_device(requested: str) -> Dict[str, Any]:
    """Where the job trains: {"kind": "cuda"|"cpu", "why": ...}."""
    import torch

    resolved = memtide.resolve_backend(requested)
    if resolved == "cuda":
        if not torch.cuda.is_available():
            if requested == "cuda":
                # Asked for by name, cuda resolves as cuda whether or not a GPU is there: say which is missing.
                status = memtide.cuda_status()
                if not status["usable"]:
                    raise RuntimeError(f"--device cuda: no usable GPU: {status['reason']}")
                raise RuntimeError("--device cuda: memtide sees a usable GPU but this torch build cannot use it "
                                   f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
            return {"kind": "cpu", "why": f"torch {torch.__version__} cannot use the GPU"}
        return {"kind": "cuda", "why": "GPU usable"}
    status = memtide.cuda_status()
    why = "MEMTIDE_DEVICE/--device asks for sim" if requested == "sim" else f"no usable GPU: {status['reason']}"
    return {"kind": "cpu", "why": why}


def train(shape: Dict[str, int], device: Dict[str, Any], policy: str, subgroup_size: int, k: Optional[int],
          gpu_static_fraction: float, progress: Callable[[str], None],
          nvme: Optional[Dict[str, Any]] = None, window: Any = None,
          update_during_backward: bool = False, on_optimizer: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
    """`nvme`: TieredAdamW's host_budget and nvme_dir (the model is then bf16 on the CPU too: the
    fp32 masters that spill must not have a host copy in the model). `window`: a LayerWindow over
    the transformer blocks (a number of blocks or "auto"). `update_during_backward`: TieredAdamW
    updates CPU subgroups while backward goes on. `on_optimizer`: called with the TieredAdamW once
    made (memtide run --timeline records it)."""
    import torch

    from .gpt import TinyGPT, arithmetic_batch
    from ..optim import TieredAdamW

    on_gpu = device["kind"] == "cuda"
    if on_gpu:
        memtide.use_with_torch()  # before the first CUDA allocation of the process
    else:
        # torch's OpenMP workers spin while waiting; on a small shared machine one thread is
        # faster for this model. memtide's update kernel has its own (sleeping) pool.
        torch.set_num_threads(1)
    dev = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu or nvme else torch.float32
    nvme_kw = dict(nvme or {})

    torch.manual_seed(0)
    model = TinyGPT(shape["vocab"], shape["hidden"], shape["heads"], shape["layers"], shape["seq"]).to(dev, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    layer_window = None
    if window is not None:
        # Before the optimizer: the blocks' params go home to host memory first, so TieredAdamW
        # keeps no device copy of them (it would on a GPU), and its gradient hook still runs first.
        from ..window import LayerWindow

        layer_window = LayerWindow(model.blocks.layers, size=window, profile_iterations=2)
        progress(f"layer window: {layer_window!r}")
    opt = TieredAdamW(model.parameters(), lr=LR, weight_decay=0.01, policy=policy, subgroup_size=subgroup_size,
                      k=k, gpu_static_fraction=gpu_static_fraction, update_during_backward=update_during_backward,
                      **nvme_kw)
    if layer_window is not None:
        layer_window.attach_optimizer(opt)
    if on_optimizer is not None:
        on_optimizer(opt)
    if opt.spilled_subgroups:
        info = opt.nvme_info()
        progress(f"nvme: {info['spilled']} of {len(opt.plan.subgroups)} subgroups ({info['spilled_params']:,} params) "
                 f"live on NVMe in {info['file']}")
    hooks = opt.attach(model)
    gen = torch.Generator().manual_seed(1)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    steps: List[Dict[str, Any]] = []
    rss = {"forward": 0, "backward": 0, "update": 0}
    # Two batches, cycled: the model memorizes them, so the loss falls within a few steps.
    data = [arithmetic_batch(gen, shape["batch"], shape["seq"], shape["vocab"], dev) for _ in range(2)]
    interrupted = False
    try:
        _train_steps(shape, model, opt, data, sync, steps, rss, progress)
    except KeyboardInterrupt:
        # Ctrl-C: what ran so far is reported (and its timeline written); the caller exits 130.
        interrupted = True
        progress(f"interrupted (Ctrl-C) after {len(steps)} of {shape['iterations']} steps: stopping, reporting those")
    result = _summarize(shape, device, model, opt, hooks, layer_window, data, sync, steps, rss, on_gpu, dtype, n_params,
                        subgroup_size, interrupted)
    if not interrupted:
        try:
            result["policies"] = _compare_policies(model, opt, subgroup_size, k, gpu_static_fraction, nvme_kw, sync,
                                                   progress)
        except KeyboardInterrupt:
            result["interrupted"] = True
            progress("interrupted (Ctrl-C) while comparing the policies: stopping")
            result["policies"] = []
    result["policies_identical"] = (len({p["digest"] for p in result["policies"]}) == 1 if result["policies"]
                                    else None)
    return result


def _train_steps(shape, model, opt, data, sync, steps, rss, progress) -> None:
    from .gpt import lm_loss

    for step in range(1, shape["iterations"] + 1):
        x, y = data[step % 2]
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        sync()
        t1 = time.perf_counter()
        rss["forward"] = max(rss["forward"], _rss_bytes() or 0)
        opt.zero_grad(set_to_none=True)
        opt.scale_loss(loss).backward()
        sync()
        t2 = time.perf_counter()
        rss["backward"] = max(rss["backward"], _rss_bytes() or 0)
        opt.step()
        sync()
        t3 = time.perf_counter()
        rss["update"] = max(rss["update"], _rss_bytes() or 0)
        row = {"step": step, "loss": loss.item(), "forward_s": t1 - t0, "backward_s": t2 - t1, "update_s": t3 - t2}
        steps.append(row)
        progress(f"step {step:>3}/{shape['iterations']}  loss {row['loss']:.4f}  forward {row['forward_s'] * 1e3:7.1f} ms"
                 f"  backward {row['backward_s'] * 1e3:7.1f} ms  update {row['update_s'] * 1e3:7.2f} ms")


def _summarize(shape, device, model, opt, hooks, layer_window, data, sync, steps, rss, on_gpu, dtype, n_params,
               subgroup_size, interrupted) -> Dict[str, Any]:
    import torch

    from .gpt import lm_loss

    final_loss = None
    if not interrupted:
        # An evaluation forward begins the next iteration, which closes the last training one.
        with torch.no_grad():
            x, y = data[0]
            final_loss = float(lm_loss(model(x), y))
    report = memtide.phase_report()
    headroom = memtide.headroom(until="forward") if on_gpu else None
    memtide.mark_phase("other")
    hooks.remove()

    # Update throughput of the training run, without the first step (it warms caches and pages).
    hist = list(opt.stats.history)
    hist = hist[1:] or hist
    engine_s = statistics.median(h[1] for h in hist) if hist else 0.0
    step_s = statistics.median(h[2] for h in hist) if hist else 0.0
    params_per_step = hist[-1][0] if hist else 0
    predicted = opt.plan.engine_plan.prediction.total_ns * 1e-9
    # The engine's own measure of the update phase (the scheduler's clock: virtual on a SimDevice).
    engine_ns = list(opt.measured_ns)
    engine_ns = engine_ns[1:] or engine_ns
    measured = statistics.median(engine_ns) * 1e-9 if engine_ns else None
    clock = opt.clock
    b = opt.buffers
    return {
        "interrupted": interrupted,
        "device": {"kind": device["kind"], "why": device["why"], "memtide_backend": memtide.backend(),
                   "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "name": torch.cuda.get_device_name(0) if on_gpu else "CPU"},
        "model": dict(shape, params=n_params, dtype=str(dtype).replace("torch.", "")),
        "steps": steps,
        "final_loss": final_loss,
        "phases": report["history"][-1]["phases"] if report["history"] else report["running"]["phases"],
        "iterations_recorded": report["iterations"],
        "headroom": headroom,
        "host_rss_peak": rss if _rss_bytes() is not None else None,
        "optimizer": {
            "numel": b.params.numel(),
            "subgroup_size": subgroup_size,
            "subgroups": len(opt.plan.subgroups),
            "state_bytes": b.nbytes(),
            "pinned": b.pinned,
            "host_arena": _host_arena_report(opt),
            "low_precision": None if b.lowp is None else str(b.lowp.dtype).replace("torch.", ""),
            "engine": "scheduler",
            "cpu_isa": memtide.cpu_isa(),
            "cpu_threads": memtide.cpu_threads(),
        },
        "nvme": None if not opt.spilled_subgroups else {
            k: v for k, v in opt.nvme_info().items() if k != "on_nvme"},
        "plan": {"summary": opt.plan.summary(), "placement": opt.plan.counts(), "reason": opt.plan.reason,
                 "engine_plan": opt.plan.as_dict()},
        "update": {
            "params_per_step": params_per_step,
            "engine_seconds_median": engine_s,
            "step_seconds_median": step_s,
            "engine_params_per_second": params_per_step / engine_s if engine_s > 0 else 0.0,
            "step_params_per_second": params_per_step / step_s if step_s > 0 else 0.0,
            "predicted_seconds": predicted,
            "measured_seconds": measured,
            "measured_clock": clock,
            "steps_measured": len(hist),
        },
        "policies": [],
        "window": None if layer_window is None else {
            "size": layer_window.size, "requested": layer_window.requested, "blocks": layer_window.n,
            "chosen": layer_window.chosen, **layer_window.stats},
        "backward_updates": None if opt.backward_updates is None else dict(opt.backward_updates.stats, choice=dict(opt.backward_updates.last_choice)),
    }


def _compare_policies(model, opt, subgroup_size, k, gpu_static_fraction, nvme_kw, sync, progress) -> List[Dict[str, Any]]:
    """The same update (the trained state and the last gradients) under every policy."""
    import torch

    from ..optim import POLICIES, TieredAdamW

    progress(f"one update of the last gradients under each policy ({POLICY_REPEATS} repeats) ...")
    start_state = opt.state_dict()
    policies = []
    for name in POLICIES:
        knobs = {}
        if name in ("static", "interleaved", "auto"):
            knobs["gpu_static_fraction"] = gpu_static_fraction
        if name in ("interleaved", "auto"):
            knobs["k"] = k if (k is not None or name == "auto") else 2
        if name == "static" and not gpu_static_fraction:
            knobs["gpu_static_fraction"] = 0.25
        copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for c, p in zip(copies, model.parameters()):
            c.grad = p.grad.detach().clone()
        o = TieredAdamW(copies, lr=LR, weight_decay=0.01, policy=name, subgroup_size=subgroup_size, **knobs,
                        **nvme_kw)
        o.load_state_dict(start_state)
        for _ in range(POLICY_REPEATS):
            o.step()
        sync()
        seconds = statistics.median(h[1] for h in o.stats.history)
        engine_ns = o.measured_ns
        policies.append({
            "policy": name,
            "plan": o.plan.summary(),
            "placement": o.plan.counts(),
            "update_seconds": seconds,
            # The scheduler's own measure of the phase (its clock, virtual on a SimDevice), and the
            # PerfModel's prediction.
            "phase_seconds": statistics.median(engine_ns) * 1e-9 if engine_ns else None,
            "phase_clock": o.clock,
            "predicted_seconds": o.plan.engine_plan.prediction.total_ns * 1e-9,
            "params_per_second": o.stats.history[0][0] / seconds if seconds > 0 else 0.0,
            "digest": _digest(o),
        })
        del o, copies
    return policies


def _host_arena_report(opt) -> Optional[Dict[str, Any]]:
    """Where the engine's fp32 state lives: bytes asked for against what the arena reserved."""
    native = opt.engine
    if native is None:
        return None
    stats = memtide.host.stats(device=native.device)
    return {"requested_bytes": HOST_STATE_BYTES_PER_PARAM * opt.buffers.params.numel(), "state_bytes": native.host_bytes,
            "reserved_bytes": stats["reserved_bytes"], "slabs": stats["slabs"],
            "registered_slabs": stats["registered_slabs"], "numa_node": stats["numa_node"],
            "device": native.device_name}
