"""memtide's optimizer for torch: TieredAdamW, a thin adapter over the C++ engine that owns the
step (memtide._memtide.UpdateEngine), and what it shows of it."""

from .arguments import engine_unavailable
from .checkpoint import AsyncSave
from .checkpoint import read as read_checkpoint
from .loss_scale import LossScaler
from .plan import POLICIES, UpdatePlan
from .tiered_adamw import TieredAdamW, UpdateStats

__all__ = ["POLICIES", "AsyncSave", "CheckpointReader", "LossScaler", "StateWriter", "TieredAdamW", "UpdatePlan", "UpdateStats",
           "engine_unavailable", "read_checkpoint"]


def __getattr__(name: str):
    # On first use: they import torch.distributed.checkpoint, which plain training does not need.
    if name == "CheckpointReader":
        from .dcp_reader import CheckpointReader

        return CheckpointReader
    if name == "StateWriter":
        from .dcp_writer import StateWriter

        return StateWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

