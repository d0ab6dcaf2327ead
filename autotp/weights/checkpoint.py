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

__all__ = ["save", "load", "full_state_dict", "full_tensor"]


def save(module: nn.Module, path: str | os.PathLike) -> None:
    """Write the module's state dict (DTensor shards) with ``torch.distributed.checkpoint``."""
    _check_sizable(module)
    state, _ = _for_dcp(module.state_dict(), _placements(module))
    dcp.save(state, checkpoint_id=os.fspath(path))


def load(module: nn.Module, path: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save` into ``module`` (same plan and mesh, or any plan:
    DCP reshards by the placements of the module's own DTensors)."""
    _check_sizable(module)
    own = _placements(module)
    state, changed = _for_dcp(module.state_dict(), own)
    dcp.load(state, checkpoint_id=os.fspath(path))
    for name, original in changed.items():  # back to the split the module computes with
        state[name] = _placed(state[name].full_tensor(), original.device_mesh, original.placements,
                              own.get(name))
    module.load_state_dict(state)


def full_tensor(value: torch.Tensor, placements=None) -> torch.Tensor:
    """The whole tensor of a parameter (or its gradient) of a parallel module, on every rank.

    ``DTensor.full_tensor()`` is right for every placement but two: a split of whole heads that the
    ranks do not divide (``S(d)~g`` with ``g`` > 1, :mod:`autotp.planning.rules.uneven`) is a ``Shard(d)``
    there, whose pieces DTensor sizes by elements, not heads; and unequal blocks (``S(d)[s1,s2,...]``),
    which DTensor has no placement for (a ``Shard(d)`` there). This gathers by the placements the
    rewrite recorded (``placements``: autotp's, for a gradient pass its parameter's
    :func:`autotp.runtime.shards.placements_of`)."""
    from autotp.runtime.shards import placements_of

    if not hasattr(value, "placements"):
        return value
    own = placements if placements is not None else placements_of(value)
    if not any(_dtensor_cannot_size(p) for p in own):
        return value.full_tensor()
    from autotp.runtime.collectives import _gather_uneven
    from autotp.placement import piece_sizes
    from autotp.runtime.shards import block_index

    mesh = value.device_mesh
    local = value.to_local()
    for axis in reversed(range(len(own))):  # axis 0 split first: gather the innermost first
        p = own[axis]
        if p.is_shard:
            n = mesh.size(axis)
            sizes = piece_sizes(value.shape[p.dim], p, n) if p.is_uneven else (local.shape[p.dim] // p.blocks,) * n
            if p.is_unequal:  # gathered in the ranks' order (block_permutation), then put back in place
                local = _gather_uneven(local, p.dim, mesh.get_group(axis), (local.shape[p.dim],) * n)
                back = block_index(p, n, local.shape[p.dim], inverse=True).to(local.device)
                local = local.index_select(p.dim, back)
            elif p.is_blocked:  # every block's pieces gathered: on the tensor viewed as (blocks, block)
                local = local.unflatten(p.dim, (p.blocks, -1))
                local = _gather_uneven(local, p.dim + 1, mesh.get_group(axis), sizes).flatten(p.dim, p.dim + 1)
            else:
                local = _gather_uneven(local, p.dim, mesh.get_group(axis), sizes)
    return local


def _check_sizable(module: nn.Module) -> None:
    """Refuse a pipeline module under FSDP2 (ZeRO 1 or 3) whose plan splits a weight in a way
    DTensor cannot size (whole heads the axis does not divide, unequal blocks): FSDP2 made its
    parameters anew, without autotp's placements, so their pieces would be gathered and cut wrong."""
    if not getattr(module, "fsdp_units", 0):
        return
    from autotp.placement import parse_placements

    odd = sorted(name for name, text in module.plan.parameter_placements.items()
                 if any(_dtensor_cannot_size(p) for p in parse_placements(text) or ()))
    if odd:
        raise NotImplementedError(
            f"this pipeline module runs under FSDP2 (ZeRO {module.plan.pipeline.chosen.zero}) and its plan splits "
            f"{', '.join(odd[:3])}{' and more' if len(odd) > 3 else ''} unevenly (whole heads the tensor axis does not "
            f"divide, or unequal blocks), which a checkpoint cannot size yet: plan with pipeline={{'zero': 0}}, or a "
            f"tensor axis that divides the heads (docs/limits.md)")


def _dtensor_cannot_size(p) -> bool:
    """An uneven split whose pieces DTensor would size otherwise: whole units of more than one
    element, or units of each block (DTensor's uneven ``Shard`` cuts single elements)."""
    return p.is_unequal or p.is_uneven and (p.grain > 1 or p.is_blocked)


def _placements(module: nn.Module) -> dict:
    """autotp's placements of the module's parameters, by state dict name (as the rewrite recorded
    them on the module: they outlive ``module.to()``)."""
    from autotp.runtime.shards import placements_of

    recorded = getattr(module, "autotp_placements", None) or {}
    return {name: recorded.get(name) or placements_of(value)
            for name, value in module.state_dict(keep_vars=True).items() if hasattr(value, "placements")}


def _for_dcp(state: dict, own: dict) -> tuple[dict, dict]:
    """The state dict as DCP can read and write it, and the entries changed for it.

    DCP describes a rank's shard of a tensor as one run along each dim, of the size DTensor gives
    it. A blocked split (a ``_StridedShard`` DTensor: the rank's piece of every block) is several
    runs, and an uneven split of whole heads has other sizes, so each is handed to DCP as a plain
    split of the same values (gathered and cut again, one tensor at a time). The checkpoint holds
    each tensor whole and under its own name either way: it loads into any plan."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out, changed = dict(state), {}
    for name, value in state.items():
        placements = getattr(value, "placements", ())
        heads = any(_dtensor_cannot_size(p) for p in own.get(name, ()))
        if heads or any(isinstance(p, _StridedShard) for p in placements):
            plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]
            out[name] = _placed(full_tensor(value, own.get(name)), value.device_mesh, plain)
            changed[name] = value
    return out, changed


def _placed(full: torch.Tensor, mesh, placements, own=None) -> torch.Tensor:
    """A DTensor of ``full`` with DTensor ``placements`` on ``mesh`` (autotp's ``own`` where they say
    more): this rank's piece, cut locally."""
    from autotp.runtime.shards import as_dtensor, from_dtensor, local_shard

    own = own if own is not None else from_dtensor(placements)
    local = local_shard(full, own, mesh.get_coordinate(), tuple(mesh.mesh.shape))
    return as_dtensor(local, mesh, own, full.shape, sized=True)


def full_state_dict(module: nn.Module, rank: Optional[int] = 0) -> dict[str, torch.Tensor]:
    """The unsharded state dict: plain tensors under the model's own names.

    Every rank must call it (gathering is collective); the result is returned on ``rank`` (and an
    empty dict elsewhere), or on every rank when ``rank`` is None.

    A pipeline module (:class:`autotp.runtime.pipeline.PipelineModule`) holds its stages' part of the
    model only: each stage's tensors are gathered whole over its own mesh, then sent over the
    pipeline axis to ``rank`` (to every rank when None). The whole model then arrives on the CPU,
    every stage's tensors, under the model's names (a weight two stages hold, once).
    """
    _check_sizable(module)
    out: dict[str, torch.Tensor] = {}
    me = dist.get_rank() if dist.is_initialized() else 0
    own = _placements(module)
    pp_group = getattr(module, "pp_group", None)
    for name, value in module.state_dict().items():
        full = full_tensor(value, own.get(name))
        if pp_group is not None:
            out[name] = full.detach().cpu()
        elif rank is None or me == rank:
            out[name] = full.detach().clone()
    if pp_group is None:
        return out
    return _over_the_stages(out, pp_group, rank, me)


def _over_the_stages(mine: dict[str, torch.Tensor], pp_group, rank: Optional[int], me: int) -> dict[str, torch.Tensor]:
    """Each pipeline rank's whole tensors put together on ``rank`` (every rank when None), the
    pipeline ranks' in turn."""
    ranks = dist.get_process_group_ranks(pp_group)
    parts: list = [None] * len(ranks)
    if rank is None:
        dist.all_gather_object(parts, mine, group=pp_group)
    elif rank in ranks:  # only the pipeline group that holds ``rank`` sends
        dist.gather_object(mine, parts if me == rank else None, dst=rank, group=pp_group)
        if me != rank:
            return {}
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            out.setdefault(name, value)
    return out
