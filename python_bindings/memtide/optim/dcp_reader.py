"""torch.distributed.checkpoint reads a checkpoint of TieredAdamW.save_checkpoint: a StorageReader
over its parts, so that ``dcp.load`` reshards it onto any ranks and into any optimizer with
torch.optim.AdamW's state (torch's own AdamW too), as it does its own checkpoints."""

from __future__ import annotations

import io
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType

from .checkpoint import _Saved

_MOMENTS = {"exp_avg": 1, "exp_avg_sq": 2}


class CheckpointReader(StorageReader):
    """``torch.distributed.checkpoint.load(state, storage_reader=CheckpointReader(path, state["optim"]))``.

    `optim_state_dict` is the optimizer state dict the load fills, as
    ``get_optimizer_state_dict(model, optimizer)`` gives it: its param groups name the params (by
    their fully qualified names) in the order of the optimizer that saved, which is how the saved
    params are named here. The checkpoint offers, under `optim_key`, each param's ``step``,
    ``exp_avg`` and ``exp_avg_sq`` and the param groups; with `model_key`, the model's params too
    (the saved fp32 params, cast to the model's dtype by the load). Each rank reads only the boxes
    of its own shards, from whichever parts hold them.
    """

    def __init__(self, path: Any, optim_state_dict: Dict[str, Any], optim_key: str = "optim",
                 model_key: Optional[str] = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        groups = optim_state_dict.get("param_groups") if isinstance(optim_state_dict, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
            raise ValueError("CheckpointReader: optim_state_dict must be an optimizer state dict with param groups "
                             "naming their params (get_optimizer_state_dict(model, optimizer))")
        self.fqns: List[str] = [str(p) for g in groups for p in g["params"]]
        self.optim_key, self.model_key = optim_key, model_key
        self._saved: Optional[_Saved] = None
        self._tensors: Dict[str, Tuple[int, int]] = {}  # key: (param, array: 0 params, 1 exp_avg, 2 exp_avg_sq)
        self._steps: Dict[str, float] = {}
        self._bytes: Dict[str, Any] = {}

    # ---- StorageReader ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._saved = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        folder = os.fspath(checkpoint_id)
        return any(os.path.isfile(os.path.join(folder, f)) for f in ("parts.manifest", "state.manifest"))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        saved = self._saved = _Saved(self.path)  # each part's checksums are checked before it is read
        if len(self.fqns) != saved.count:
            raise ValueError(f"CheckpointReader: {self.path} holds {saved.count} param tensors, the optimizer state dict "
                             f"names {len(self.fqns)}")
        md: Dict[str, Any] = {}
        for idx, fqn in enumerate(self.fqns):
            shape = torch.Size(saved.shapes[idx])
            chunks = [ChunkStorageMetadata(offsets=torch.Size(meta["places"][idx][4]),
                                           sizes=torch.Size(meta["places"][idx][2])) for meta, _ in saved.parts]
            props = TensorProperties(dtype=torch.float32)
            if idx in saved.state:
                for name, which in _MOMENTS.items():
                    key = f"{self.optim_key}.state.{fqn}.{name}"
                    md[key] = TensorStorageMetadata(properties=props, size=shape, chunks=chunks)
                    self._tensors[key] = (idx, which)
                key = f"{self.optim_key}.state.{fqn}.step"
                md[key] = TensorStorageMetadata(properties=props, size=torch.Size([]),
                                                chunks=[ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))])
                self._steps[key] = float(saved.state[idx]["step"])
            if self.model_key is not None:
                key = f"{self.model_key}.{fqn}"
                md[key] = TensorStorageMetadata(properties=props, size=shape, chunks=chunks)
                self._tensors[key] = (idx, 0)
        groups = []
        first = 0
        for g in saved.param_groups:
            count = len(g["params"])
            groups.append(dict(g, params=self.fqns[first:first + count]))
            first += count
        key = f"{self.optim_key}.param_groups"
        md[key] = BytesStorageMetadata()
        self._bytes[key] = groups
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._saved is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: List[Any]) -> List[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        saved = self._saved
        # The checksums of every part this rank reads, before any value goes into the state dict.
        saved.verify(sorted({item.storage_index.index for item in plan.items
                             if item.type != LoadItemType.BYTE_IO and item.storage_index.fqn in self._tensors}))
        for item in plan.items:
            key = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self._bytes[key], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            if key in self._steps:
                src = torch.tensor(self._steps[key], dtype=torch.float32)
            else:
                idx, which = self._tensors[key]
                meta, arrays = saved.parts[item.storage_index.index]
                lo, hi, lshape, _, loff = meta["places"][idx]
                if tuple(loff) != tuple(item.storage_index.offset):
                    raise OSError(f"CheckpointReader: part {item.storage_index.index} of {self.path} does not start "
                                  f"{key} at {tuple(item.storage_index.offset)}")
                src = arrays[which][lo:hi].view(tuple(lshape))
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    src = src.narrow(dim, int(start), int(length))
            target = planner.resolve_tensor(item).detach()
            target.copy_(src)
            planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done
