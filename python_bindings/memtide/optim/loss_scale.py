"""Loss scaling with torch.amp.GradScaler's rules, for TieredAdamW."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Union


class LossScaler:
    """Loss scale with torch.amp.GradScaler's rules.

    Dynamic: an overflowing step (a non-finite gradient after unscaling) is skipped and the scale
    multiplied by ``backoff_factor``; after ``growth_interval`` consecutive good steps the scale is
    multiplied by ``growth_factor``. Static (``dynamic=False``): the scale never changes, an
    overflowing step is still skipped.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True) -> None:
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"LossScaler: init_scale must be a finite number > 0, got {init_scale!r}")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1.0 and math.isfinite(growth_factor)):
            raise ValueError(f"LossScaler: growth_factor must be a finite number > 1, got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval > 0):
            raise ValueError(f"LossScaler: growth_interval must be an integer > 0, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.dynamic = bool(dynamic)
        self.growth_tracker = 0

    def update(self, found_nonfinite: bool) -> None:
        """Applies one step's outcome to the scale."""
        if not self.dynamic:
            return
        if found_nonfinite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "dynamic": self.dynamic,
            "growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.dynamic = bool(state["dynamic"])
        self.growth_tracker = int(state["growth_tracker"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, growth_interval={self.growth_interval})"


def make_scaler(loss_scale: Union[None, str, float, LossScaler]) -> Optional[LossScaler]:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"TieredAdamW: loss_scale {loss_scale!r} is not accepted; "
                             "accepted: None, 'dynamic', a finite number > 0, or a LossScaler")
        return LossScaler()
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"TieredAdamW: loss_scale must be a finite number > 0, got {loss_scale!r}")
        return LossScaler(init_scale=float(loss_scale), dynamic=False)
    raise ValueError(f"TieredAdamW: loss_scale {loss_scale!r} is not accepted; "
                     "accepted: None, 'dynamic', a finite number > 0, or a LossScaler")
