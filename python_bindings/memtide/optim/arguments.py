"""TieredAdamW's checks of what a user hands it: hyperparameters, NVMe arguments, state dicts.
Each raises ValueError naming the bad value and what is accepted, before anything changes."""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .. import _memtide
from .distributed import is_dtensor, local
from .loss_scale import LossScaler
from .plan import POLICIES


def check_max_grad_norm(max_grad_norm: Any) -> None:
    """max_grad_norm is None or a finite number > 0 (at construction, or set between steps)."""
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                          and not isinstance(max_grad_norm, bool)
                                          and math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"TieredAdamW: max_grad_norm must be None or a finite number > 0, got {max_grad_norm!r}")


def check_options(policy: Any, subgroup_size: Any, gpu_static_fraction: Any, k: Any, max_grad_norm: Any,
                  update_during_backward: Any) -> None:
    """TieredAdamW's own arguments (torch.optim's are checked per group by check_group)."""
    if policy not in POLICIES:
        raise ValueError(f"TieredAdamW: policy {policy!r} is not accepted; accepted: "
                         f"{', '.join(repr(p) for p in POLICIES)}")
    if not (isinstance(subgroup_size, int) and not isinstance(subgroup_size, bool) and subgroup_size > 0):
        raise ValueError(f"TieredAdamW: subgroup_size must be an integer > 0, got {subgroup_size!r}")
    if not (isinstance(gpu_static_fraction, (int, float)) and not isinstance(gpu_static_fraction, bool)
            and 0.0 <= gpu_static_fraction <= 1.0):
        raise ValueError(f"TieredAdamW: gpu_static_fraction must be in [0, 1], got {gpu_static_fraction!r}")
    if k is not None and not (isinstance(k, (int, float)) and not isinstance(k, bool) and math.isfinite(k)
                              and k >= 1):
        raise ValueError(f"TieredAdamW: k must be None or a stride >= 1 (one in every k subgroups on the GPU), "
                         f"got {k!r}")
    if policy == "cpu" and (gpu_static_fraction or k is not None):
        raise ValueError("TieredAdamW: policy 'cpu' updates everything on the CPU; "
                         f"gpu_static_fraction={gpu_static_fraction!r} and k={k!r} would be ignored")
    if policy == "static" and k is not None:
        raise ValueError(f"TieredAdamW: k={k!r} applies to policies 'interleaved' and 'auto', not 'static'")
    check_max_grad_norm(max_grad_norm)
    if not (isinstance(update_during_backward, bool) or (isinstance(update_during_backward, int)
                                                          and update_during_backward >= 1)):
        raise ValueError("TieredAdamW: update_during_backward must be True, False or a number of subgroups >= 1, "
                         f"got {update_during_backward!r}")


def engine_unavailable(numel: int) -> str:
    """Why memtide's engine cannot run on the runtime's device here ("" if it can)."""
    if numel == 0:
        return "no params to update"
    try:
        backend = _memtide.backend()
        if backend == "sim" and _memtide.options().get("sim_phantom") == "true":
            return "the runtime's SimDevice is in phantom mode (MEMTIDE_SIM_PHANTOM=true): it stores no data"
        if _memtide.device_count() < 1:
            return f"the memtide backend {backend} has no device"
    except Exception as e:  # a bad MEMTIDE_* setting must not pass silently
        return f"memtide runtime unavailable: {e}"
    return ""


def device_of(params: List[torch.Tensor]) -> int:
    """The CUDA device the params live on (0 when all are on the CPU); one per optimizer."""
    devices = sorted({p.device.index or 0 for p in params if p.is_cuda})
    if len(devices) > 1:
        raise ValueError(f"TieredAdamW: params live on cuda:{devices[0]} and cuda:{devices[1]}; one device per "
                         "optimizer is supported (make one TieredAdamW per device)")
    return devices[0] if devices else 0


@dataclass(frozen=True)
class NvmeTier:
    """Where and when the optimizer state spills to NVMe (TieredAdamW's nvme_dir and host_budget)."""

    dir: Optional[str]
    host_budget: int
    read_ahead: int


def nvme_tier(nvme_dir: Any, host_budget: Any, nvme_read_ahead: Any) -> Optional[NvmeTier]:
    """Checks TieredAdamW's NVMe arguments; None when no host budget is set."""
    if not (isinstance(nvme_read_ahead, int) and not isinstance(nvme_read_ahead, bool) and nvme_read_ahead >= 1):
        raise ValueError(f"TieredAdamW: nvme_read_ahead must be an integer >= 1, got {nvme_read_ahead!r}")
    if host_budget is None:
        if nvme_dir is not None:
            raise ValueError("TieredAdamW: nvme_dir needs host_budget, the host memory the optimizer state may take "
                             "(e.g. host_budget='64GiB'); the subgroups that do not fit it go to NVMe")
        return None
    if isinstance(host_budget, bool) or not isinstance(host_budget, (int, str)):
        raise ValueError(f"TieredAdamW: host_budget must be bytes (an int) or a size such as '64GiB', "
                         f"got {host_budget!r}")
    budget = _memtide.parse_bytes(host_budget) if isinstance(host_budget, str) else host_budget
    if budget <= 0:
        raise ValueError(f"TieredAdamW: host_budget must be > 0 bytes, got {host_budget!r}")
    if nvme_dir is not None:
        if not isinstance(nvme_dir, (str, os.PathLike)):
            raise ValueError(f"TieredAdamW: nvme_dir must be a path, got {nvme_dir!r}")
        nvme_dir = os.fspath(nvme_dir)
        if not nvme_dir:
            raise ValueError("TieredAdamW: nvme_dir is empty; expected a directory on an NVMe drive")
    return NvmeTier(nvme_dir, int(budget), nvme_read_ahead)


#: The highest step count a checkpoint may hold: the engine counts steps in float32, whose whole
#: numbers are exact up to 2**24 (torch.optim.AdamW's float32 step tensor has the same bound).
MAX_STEP = 2 ** 24


def check_state_dict(state_dict: Any, param_groups: List[Dict[str, Any]], where: str):
    """Checks a whole optimizer state dict against `param_groups` without changing anything.

    Returns the per-param entries to load ((param, exp_avg, exp_avg_sq, step, master or None)),
    each group's hyperparameters, and the loss scaler's state (or None). Raises ValueError naming
    the first problem: structure, counts, shapes, dtypes, a param index or a step that is not a
    whole number in range, a hyperparameter or loss-scaler value outside its range, amsgrad state,
    a checkpoint format other than memtide's, a tensor whose data cannot be read (meta, sparse,
    mkldnn, nested, a subclass, a device other than the CPU or CUDA). Loading then writes nothing
    that can fail: every value it reads was checked here.
    """

    def bad(message: str) -> ValueError:
        return ValueError(f"{where}: {message}")

    # The floating dtypes the engine's float32 buffers can be filled from (torch.optim converts a
    # floating state tensor to its param's dtype on load; memtide converts to its float32 state).
    readable = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
    readable |= {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                             "float8_e8m0fnu") if hasattr(torch, n)}


    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), (list, tuple)) \
            or not isinstance(state_dict.get("state"), dict):
        raise bad("expected a dict with 'state' (a dict) and 'param_groups' (a list)")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise bad(f"the state dict has {len(saved_groups)} param groups, this optimizer has {len(param_groups)}")
    groups = []
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise bad(f"param group {gi} is not a dict with a 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise bad(f"param group {gi} has {len(saved['params'])} params in the state dict, "
                      f"{len(group['params'])} here")
        if saved.get("amsgrad", False):
            raise bad("the state dict comes from amsgrad=True, which TieredAdamW does not support")
        values = {k: v for k, v in saved.items() if k != "params"}
        try:
            check_group({**group, **values})
        except (ValueError, TypeError, RuntimeError) as e:
            raise bad(f"param group {gi}: {str(e).removeprefix('TieredAdamW: ')}") from None
        groups.append(values)
    order = [p for g in param_groups for p in g["params"]]
    group_of = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
    saved_order = []
    for gi, saved in enumerate(saved_groups):
        for k, idx in enumerate(saved["params"]):
            # The keys of 'state': whole numbers >= 0 (torch.optim's own) or names
            # (torch.distributed.checkpoint's set_optimizer_state_dict keys them by the params'
            # qualified names), each once; a bool or 1.0 would find another param's state or none.
            if not (isinstance(idx, str) and idx) and (isinstance(idx, bool) or not isinstance(idx, int) or idx < 0):
                raise bad(f"param_groups[{gi}]['params'][{k}] must be a param index (an int >= 0) or a param name, "
                          f"got {idx!r}")
            saved_order.append(idx)
    if len(set(saved_order)) != len(saved_order):
        twice = next(i for i in saved_order if saved_order.count(i) > 1)
        raise bad(f"param_groups name param index {twice} twice; each param has one index")
    saved_state = state_dict["state"]
    entries = []
    for idx, p, gi in zip(saved_order, order, group_of):
        entry = saved_state.get(idx)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise bad(f"state of param {idx} is not a dict")
        if "max_exp_avg_sq" in entry:
            raise bad("the state dict has max_exp_avg_sq (amsgrad), which TieredAdamW does not support")
        tensors = {}
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            value = entry.get(key)
            if value is None:
                if key == "master_param":
                    continue
                raise bad(f"state of param {idx} has no {key!r}")
            problem = tensor_problem(value)
            if not problem and local(value).dtype not in readable:
                problem = f"a tensor of dtype {local(value).dtype}"
            if problem:
                raise bad(f"{key} of param {idx} must be a floating-point tensor (float32, float64, float16, bfloat16 "
                          "or float8, converted to the optimizer's float32 state as torch.optim converts state to "
                          "its param's dtype), dense (strided), with data on the CPU or a CUDA device; got "
                          f"{problem} (group {gi})")
            if value.numel() != p.numel():
                raise bad(f"{key} of param {idx} has {value.numel()} elements, the param has {p.numel()} (group {gi})")
            if value.shape != p.shape:
                # Same size is not enough: a (3, 4) moment of a (4, 3) param is another layout.
                raise bad(f"{key} of param {idx} has shape {tuple(value.shape)}, the param has {tuple(p.shape)} "
                          f"(group {gi})")
            if is_dtensor(p) and (not is_dtensor(value) or local(value).shape != local(p).shape):
                # FSDP2: each rank loads its own shard (torch.distributed.checkpoint's
                # set_optimizer_state_dict gives DTensors sharded like the params).
                raise bad(f"{key} of param {idx} must be a DTensor sharded as the param (this rank's shard "
                          f"{tuple(local(p).shape)}), got " + (f"a DTensor whose shard is {tuple(local(value).shape)}"
                                                               if is_dtensor(value) else "a whole tensor")
                          + f" (group {gi}); load sharded state with torch.distributed.checkpoint")
            if not is_dtensor(p) and is_dtensor(value) and local(value).shape != p.shape:
                raise bad(f"{key} of param {idx} is a DTensor whose local shard is {tuple(local(value).shape)}, the "
                          f"param (not a DTensor) has {tuple(p.shape)} (group {gi}); accepted: a tensor of the "
                          "param's shape, or a DTensor whose local shard has it")
            tensors[key] = value
        step = entry.get("step", 0)
        problem = number_problem(step)
        if not problem and isinstance(step, torch.Tensor):
            step = step.item()
        elif not problem and not isinstance(step, (int, float)):
            step = float(step)  # another real number type (numpy's)
        if problem or not isinstance(step, (int, float)) or not math.isfinite(step) \
                or step < 0 or step != int(step) or step > MAX_STEP:
            raise bad(f"step of param {idx} must be a whole number >= 0 and <= {MAX_STEP} ({NUMBER}) (group {gi}), "
                      "got " + (f"{problem}: " if problem else "") + f"{entry.get('step')!r}")
        entries.append((p, tensors["exp_avg"], tensors["exp_avg_sq"], int(step), tensors.get("master_param")))
    memtide_state = state_dict.get("memtide") or {}
    if not isinstance(memtide_state, dict):
        raise bad("'memtide' must be a dict")
    fmt = memtide_state.get("format", 1)
    if isinstance(fmt, bool) or fmt != 1 or not isinstance(fmt, int):
        raise bad(f"'memtide'['format'] must be 1, the one checkpoint format this memtide reads; got {fmt!r}")
    scaler_state = memtide_state.get("loss_scaler")
    if scaler_state is not None:
        if not isinstance(scaler_state, dict):
            raise bad(f"the loss scaler's state must be a dict, got a {type(scaler_state).__name__}")
        for key, accepted in (("scale", numbers.Real), ("growth_factor", numbers.Real),
                              ("backoff_factor", numbers.Real), ("dynamic", bool)):
            if key not in scaler_state:
                raise bad(f"the loss scaler's state has no {key!r}")
            value = scaler_state[key]
            if isinstance(value, bool) is not (accepted is bool) or not isinstance(value, accepted):
                raise bad(f"the loss scaler's {key} must be " + ("a bool" if accepted is bool else "a number")
                          + f", got {value!r}")
        try:
            check = LossScaler(init_scale=scaler_state["scale"], growth_factor=scaler_state["growth_factor"],
                               backoff_factor=scaler_state["backoff_factor"],
                               growth_interval=scaler_state["growth_interval"], dynamic=scaler_state["dynamic"])
            tracker = scaler_state["growth_tracker"]
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"the loss scaler's state is not valid: {e}") from None
        if isinstance(tracker, bool) or not isinstance(tracker, int) or not 0 <= tracker < check.growth_interval:
            raise bad(f"the loss scaler's growth_tracker must be an int in [0, growth_interval), got {tracker!r}")
    return entries, groups, scaler_state


#: What a hyper-parameter (lr, eps, weight_decay, each beta) may be, as torch.optim.AdamW takes it.
NUMBER = "a real number or a one-element real tensor with data on the CPU or a CUDA device"


def tensor_problem(value: Any) -> str:
    """What makes `value` a tensor whose values cannot be read here ("" if it can be)."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    t, plain = local(value), (torch.Tensor, torch.nn.Parameter)
    if not is_dtensor(value) and type(value) not in plain:
        return f"a {type(value).__name__} (a torch.Tensor subclass)"
    if type(t) not in plain:
        return f"a DTensor whose local shard is a {type(t).__name__} (a torch.Tensor subclass)"
    if t.is_nested:
        return "a nested tensor"
    if t.layout != torch.strided:
        return f"a {str(t.layout).replace('torch.', '')} tensor"
    if t.device.type == "meta":
        return "a meta tensor, which holds no data"
    if t.device.type not in ("cpu", "cuda"):
        return f"a tensor on the {t.device} device"
    return ""

def number_problem(value: Any) -> str:
    """Why `value` (a hyper-parameter) is not a real number or a one-element real tensor ("" if it is one)."""
    if isinstance(value, torch.Tensor):
        problem = tensor_problem(value)
        if problem:
            return problem
        if value.numel() != 1:
            return f"a tensor of {value.numel()} elements"
        if value.dtype == torch.bool or value.is_complex() or value.is_quantized:
            return f"a tensor of dtype {value.dtype}"
        return ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "None" if value is None else f"a {type(value).__name__}"
    return ""


@functools.lru_cache(maxsize=None)
def torch_group_defaults() -> Dict[str, Any]:
    """Every key of a torch.optim.AdamW param group on the installed torch, with its default
    (``maximize``, ``foreach``, ``fused``, ``capturable``, ``differentiable`` and, since torch 2.7,
    ``decoupled_weight_decay`` beside the hyper-parameters). TieredAdamW's groups carry each one,
    so its state dicts load into torch.optim.AdamW, directly and through DCP, and torch's into it."""
    return dict(torch.optim.AdamW([torch.zeros(0, requires_grad=True)]).defaults)


def check_group(group: Dict[str, Any]) -> None:
    """Rejects hyperparameters the kernel cannot take, naming the value and what is accepted."""
    if group.get("amsgrad", False):
        raise ValueError("TieredAdamW: amsgrad=True is not supported (accepted: False); "
                         "use torch.optim.AdamW(amsgrad=True) for AMSGrad")
    if group.get("differentiable", False):
        raise ValueError("TieredAdamW: differentiable=True is not supported (accepted: False): memtide's fused step "
                         "updates in place outside autograd; use torch.optim.AdamW(differentiable=True)")
    if group.get("decoupled_weight_decay", True) is not True:
        raise ValueError(f"TieredAdamW: decoupled_weight_decay={group['decoupled_weight_decay']!r} is not supported "
                         "(accepted: True): TieredAdamW is AdamW; Adam's L2 penalty is torch.optim.Adam")
    for key, accepted in (("maximize", (bool,)), ("capturable", (bool,)), ("foreach", (bool, type(None))),
                          ("fused", (bool, type(None)))):
        if not isinstance(group.get(key, False), accepted):
            raise ValueError(f"TieredAdamW: {key} must be " + (" or ".join("None" if t is type(None) else "a bool"
                                                                          for t in accepted))
                             + f", got {group[key]!r}")
    for key in ("lr", "betas", "eps", "weight_decay"):
        value, accepted = group[key], NUMBER
        if key == "betas":
            accepted = f"a pair (a tuple or a list of two), each {NUMBER}"
            problem = (f"a {type(value).__name__}" if not isinstance(value, (tuple, list))
                       else f"{len(value)} value{'s' * (len(value) != 1)}" if len(value) != 2
                       else next((f"{p} in it" for p in map(number_problem, value) if p), ""))
        else:
            problem = number_problem(value)
        if problem:
            raise ValueError(f"TieredAdamW: {key} must be {accepted}; got {problem}: {value!r}")
    lr = group["lr"]
    lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"TieredAdamW: lr must be a finite number >= 0, got {group['lr']!r}")
    try:
        beta1, beta2 = (float(x) for x in group["betas"])
    except (TypeError, ValueError):
        raise ValueError(f"TieredAdamW: betas must be a pair of numbers in [0, 1), got {group['betas']!r}") from None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"TieredAdamW: betas must be a pair of numbers in [0, 1), got {group['betas']!r}")
    eps = float(group["eps"])
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"TieredAdamW: eps must be a finite number >= 0, got {group['eps']!r}")
    wd = float(group["weight_decay"])
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(f"TieredAdamW: weight_decay must be a finite number >= 0, got {group['weight_decay']!r}")


_FLOATS = (float, int)


def _bool_or_none(value: Any) -> bool:
    return value is None or type(value) is bool


def step_params(group: Dict[str, Any]) -> Any:
    """The group's hyper-parameters as the engine takes them (``_memtide.StepParams``), checked as
    check_group checks them. Runs every step: plain Python numbers and torch's default flags are
    checked inline; anything else (a tensor lr, a list of betas, a bad value) goes through
    check_group, which names what is wrong."""
    lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not (type(lr) in _FLOATS and type(eps) in _FLOATS and type(wd) in _FLOATS and type(betas) is tuple
            and len(betas) == 2 and type(betas[0]) in _FLOATS and type(betas[1]) in _FLOATS
            and 0.0 <= lr < math.inf and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0
            and 0.0 <= eps < math.inf and 0.0 <= wd < math.inf
            and not group.get("amsgrad", False) and not group.get("differentiable", False)
            and group.get("decoupled_weight_decay", True) is True
            and type(group.get("maximize", False)) is bool and type(group.get("capturable", False)) is bool
            and _bool_or_none(group.get("foreach")) and _bool_or_none(group.get("fused"))):
        check_group(group)
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    return _memtide.StepParams(float(lr), float(betas[0]), float(betas[1]), float(eps), float(wd))
