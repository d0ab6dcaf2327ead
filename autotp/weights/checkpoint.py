"""Checkpoints of a parallel module: sharded save/load with ``torch.distributed.checkpoint``, with its
optimizer's state where given, and the full (unsharded) state dict gathered on one rank.

>>> # on every rank:
>>> # autotp.checkpoint.save(pmodel, "ckpt/", optimizer=opt)     # each rank writes its shards
>>> # autotp.checkpoint.load(fresh_pmodel, "ckpt/", optimizer=fresh_opt)  # any plan, mesh, or a plain model
>>> # full = autotp.checkpoint.full_state_dict(pmodel)  # rank 0: plain tensors, keys of the model

The optimizer's state is PyTorch's ``get_optimizer_state_dict``: each parameter's state (AdamW's
moments: DTensors split as their parameter) under the parameter's name, and the param groups,
saved under ``optimizer.`` beside the model's keys. So it loads into another plan or mesh, or a
plain model in one process, as the weights do (DCP reshards each moment by its parameter's
placements there), and a checkpoint with an optimizer's state still loads as weights alone.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

__all__ = ["save", "load", "full_state_dict", "full_tensor", "OPTIMIZER_KEY"]

# the optimizer's state in a checkpoint: under this key, beside the model's
OPTIMIZER_KEY = "optimizer"


def save(module: nn.Module, path: str | os.PathLike, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Write the module's state dict (DTensor shards) with ``torch.distributed.checkpoint``, and, with
    ``optimizer`` (over the module's parameters), the optimizer's state beside it."""
    _check_sizable(module)
    _check_optimizer(module, optimizer)
    own = _placements(module)
    state, _ = _for_dcp(module.state_dict(), own)
    if optimizer is not None:
        state[OPTIMIZER_KEY], _ = _optimizer_for_dcp(module, optimizer, own)
    dcp.save(state, checkpoint_id=os.fspath(path))


def load(module: nn.Module, path: str | os.PathLike, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load a checkpoint written by :func:`save` into ``module`` (same plan and mesh, or any plan:
    DCP reshards by the placements of the module's own DTensors), and with ``optimizer`` (over the
    module's parameters, built as for training) the optimizer's state saved with it."""
    _check_sizable(module)
    _check_optimizer(module, optimizer)
    if optimizer is not None:
        _check_holds_optimizer(path)
    own = _placements(module)
    state, changed = _for_dcp(module.state_dict(), own)
    everything = dict(state)
    if optimizer is not None:
        everything[OPTIMIZER_KEY], moments = _optimizer_for_dcp(module, optimizer, own)
    dcp.load(everything, checkpoint_id=os.fspath(path))
    _restore(state, changed, own)  # back to the split the module computes with
    module.load_state_dict(state)
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        loaded = everything[OPTIMIZER_KEY]
        for name, entries in moments.items():
            _restore(loaded["state"][name], entries, {key: own[name] for key in entries})
        set_optimizer_state_dict(module, optimizer, loaded)


def _restore(state: dict, changed: dict, own: dict) -> None:
    """Each entry :func:`_for_dcp` handed DCP as a plain split, cut again as the module computes with it."""
    for name, original in changed.items():
        state[name] = _placed(state[name].full_tensor(), original.device_mesh, original.placements, own.get(name))


def _check_optimizer(module: nn.Module, optimizer: Any) -> None:
    """Refuse what is not an optimizer over the module's parameters (one built over the model's own
    parameters, before autotp.parallelize, most likely), before anything is read or written."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer is a {type(optimizer).__name__}; expected a torch.optim.Optimizer over the "
                        f"module's parameters, e.g. torch.optim.AdamW(pmodel.parameters())")
    mine = {id(p) for p in module.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    others = [p for p in held if id(p) not in mine]
    if others:
        shapes = ", ".join(str(list(p.shape)) for p in others[:3]) + (" ..." if len(others) > 3 else "")
        raise ValueError(f"the optimizer holds {len(others)} of its {len(held)} parameters that are not this "
                         f"module's (shapes {shapes}); build it over the module's own parameters, "
                         f"torch.optim.AdamW(pmodel.parameters()) after autotp.parallelize, not the model's")
    if any(k == OPTIMIZER_KEY or k.startswith(OPTIMIZER_KEY + ".") for k in module.state_dict()):
        raise ValueError(f"the module's state dict has keys under {OPTIMIZER_KEY!r}, where a checkpoint keeps the "
                         f"optimizer's state; save the optimizer's state apart")


def _check_holds_optimizer(path: str | os.PathLike) -> None:
    """A checkpoint saved without ``optimizer=`` cannot restore one: said before anything loads."""
    keys = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    if not any(k.startswith(OPTIMIZER_KEY + ".") for k in keys):
        raise ValueError(f"the checkpoint at {os.fspath(path)} holds no optimizer state (it was saved without "
                         f"optimizer=); load it without optimizer=, or save with autotp.checkpoint.save(module, "
                         f"path, optimizer=opt)")


def _optimizer_for_dcp(module: nn.Module, optimizer: torch.optim.Optimizer, own: dict) -> tuple[dict, dict]:
    """The optimizer's state dict by parameter name (PyTorch's ``get_optimizer_state_dict``; an
    optimizer that has taken no step yet gets its state made first, from zero gradients, the gradients
    the parameters hold kept), each parameter's state as :func:`_for_dcp` hands it to DCP, and per
    parameter the entries changed for it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    held = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in held] if not optimizer.state else None
    if grads is not None:  # PyTorch makes the state only where no parameter has a gradient
        for p in held:
            p.grad = None
    try:
        osd = get_optimizer_state_dict(module, optimizer)
    finally:
        if grads is not None:
            for p, g in zip(held, grads):
                p.grad = g
    changed = {}
    for name, entries in osd["state"].items():
        placements = {key: own[name] for key, v in entries.items() if name in own and hasattr(v, "placements")}
        osd["state"][name], changed[name] = _for_dcp(entries, placements)
    return osd, {name: entries for name, entries in changed.items() if entries}


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
    from autotp.placement import piece_sizes
    from autotp.local.collectives import _gather_uneven
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
            f"tensor axis that divides the heads (docs/pipelines.md#what-the-runtime-does-not-do)")


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

    The tensors are gathered one at a time, each copied to the CPU (the result is on the CPU, a copy
    of the module's own tensors) and let go before the next is gathered: on a GPU the device holds
    at most one whole tensor beyond its shards (and the gather's own pieces while it runs), never
    the whole model.

    A pipeline module (:class:`autotp.runtime.pipeline.module.PipelineModule`) holds its stages' part of the
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
        if pp_group is not None or rank is None or me == rank:
            out[name] = full.detach().to("cpu", copy=True)
        del full  # the whole tensor let go before the next is gathered
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
