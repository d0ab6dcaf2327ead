"""Checkpoints of a parallel module: sharded save/load with ``torch.distributed.checkpoint``, and the
full (unsharded) state dict gathered on one rank.

>>> # on every rank:
>>> # autotp.checkpoint.save(pmodel, "ckpt/")            # each rank writes its shards
>>> # autotp.checkpoint.load(fresh_pmodel, "ckpt/")      # loads them back in place
>>> # full = autotp.checkpoint.full_state_dict(pmodel)  # rank 0: plain tensors, keys of the model
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

__all__ = ["save", "load", "full_state_dict"]


def save(module: nn.Module, path: str | os.PathLike) -> None:
    """Write the module's state dict (DTensor shards) with ``torch.distributed.checkpoint``."""
    dcp.save(module.state_dict(), checkpoint_id=os.fspath(path))


def load(module: nn.Module, path: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save` into ``module`` (same plan and mesh, or any plan:
    DCP reshards by the placements of the module's own DTensors)."""
    state = module.state_dict()
    dcp.load(state, checkpoint_id=os.fspath(path))
    module.load_state_dict(state)


def full_state_dict(module: nn.Module, rank: Optional[int] = 0) -> dict[str, torch.Tensor]:
    """The unsharded state dict: plain tensors under the model's own names.

    Every rank must call it (gathering is collective); the result is returned on ``rank`` (and an
    empty dict elsewhere), or on every rank when ``rank`` is None.
    """
    out: dict[str, torch.Tensor] = {}
    me = dist.get_rank() if dist.is_initialized() else 0
    for name, value in module.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if rank is None or me == rank:
            out[name] = full.detach().clone()
    return out
