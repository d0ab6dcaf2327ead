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
    state, _ = _for_dcp(module.state_dict())
    dcp.save(state, checkpoint_id=os.fspath(path))


def load(module: nn.Module, path: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save` into ``module`` (same plan and mesh, or any plan:
    DCP reshards by the placements of the module's own DTensors)."""
    state, blocked = _for_dcp(module.state_dict())
    dcp.load(state, checkpoint_id=os.fspath(path))
    for name, original in blocked.items():  # back to the blocked split the module computes with
        state[name] = _placed(state[name].full_tensor(), original.device_mesh, original.placements)
    module.load_state_dict(state)


def _for_dcp(state: dict) -> tuple[dict, dict]:
    """The state dict as DCP can read and write it, and the entries changed for it.

    DCP describes a rank's shard of a tensor as one run along each dim; a blocked split (a
    ``_StridedShard`` DTensor: the rank's piece of every block) is several, so it is handed to DCP
    as a plain split of the same values (gathered and cut again, one tensor at a time). The
    checkpoint holds each tensor whole and under its own name either way: it loads into any plan."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out, blocked = dict(state), {}
    for name, value in state.items():
        placements = getattr(value, "placements", ())
        if any(isinstance(p, _StridedShard) for p in placements):
            plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]
            out[name] = _placed(value.full_tensor(), value.device_mesh, plain)
            blocked[name] = value
    return out, blocked


def _placed(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """A DTensor of ``full`` with DTensor ``placements`` on ``mesh``: this rank's piece, cut locally."""
    from torch.distributed.tensor import DTensor

    from autotp.rewrite import from_dtensor, local_shard

    local = local_shard(full, from_dtensor(placements), mesh.get_coordinate(), tuple(mesh.mesh.shape))
    return DTensor.from_local(local, mesh, placements, run_check=False)


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
