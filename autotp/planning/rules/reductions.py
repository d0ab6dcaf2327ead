"""Reductions and normalizations: a kept dim stays split; a summed split dim leaves a partial sum.

A mean over a split dim runs on a rank as its piece's mean divided by the pieces (:func:`local_mean`):
the ranks' local means then sum to the mean."""

from __future__ import annotations

import math
from typing import Any

import torch

from autotp import ops
from autotp.local.site import LocalSite
from autotp.placement import P, R, S
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode


def reduced_dims(node: OpNode) -> set[int]:
    """The dims a sum or mean reduces: its ``dim`` argument, every dim when it has none or it is empty."""
    ndim = node.input_infos[0].ndim
    dims = set(node.args.ints("dim", ndim) or ()) if "dim" in node.args else set()
    return dims or set(range(ndim))


def reduction_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """sum / mean over dims: sharding a kept dim carries over; a sum over a split dim is partial, and
    so is a mean, once each rank divides its local mean by the pieces (:func:`local_mean`: the ranks'
    local means then sum to the mean; DTensor's ``Partial("avg")``)."""
    x = node.input_infos[0]
    dims = reduced_dims(node)
    keepdim = bool(node.args.get("keepdim", False))
    choices: list[AxisChoice] = [((R,), R), ((P,), P)]
    kept = [d for d in range(x.ndim) if d not in dims]
    for d in range(x.ndim):
        if not divisible(x.shape[d], n):
            continue
        if d in dims:
            if node.target.startswith("aten.sum") or node.output.is_float:
                choices.append(((S(d),), P))
        else:
            choices.append(((S(d),), S(d if keepdim else kept.index(d))))
    return choices


def extremum_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """argmax / argmin over a dim (CLIP pools its text at the end token: ``input_ids.argmax(-1)``): a
    kept dim's split carries over; the reduced dim stays whole (an index is the whole dim's). Without
    a dim they read the flattened tensor: whole. (DTensor's registry declines them: its handler
    gathers candidates across ranks; amax/amin come from the registry.)"""
    x = node.input_infos[0]
    if node.args.get("dim") is None:
        return [((R,), R)]
    dims = {node.args.int("dim", x.ndim)}
    keepdim = bool(node.args.get("keepdim", False))
    kept = [d for d in range(x.ndim) if d not in dims]
    return [((R,), R)] + [((S(d),), S(d if keepdim else kept.index(d))) for d in kept if divisible(x.shape[d], n)]


def norm_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """layer_norm / rms_norm: the normalized (trailing) dims stay whole; weight and bias replicated."""
    x = node.input_infos[0]
    k = len(node.args["normalized_shape"])
    choices: list[AxisChoice] = [((R,) * len(node.inputs), R)]
    for d in range(x.ndim - k):
        if divisible(x.shape[d], n):
            choices.append(((S(d),) + (R,) * (len(node.inputs) - 1), S(d)))
    return choices


RULES = {
    "aten.layer_norm.default": norm_choices,
    "aten.rms_norm.default": norm_choices,
    "aten.sum.dim_IntList": reduction_choices,
    "aten.mean.dim": reduction_choices,
    "aten.sum.default": reduction_choices,
    "aten.mean.default": reduction_choices,
    "aten.argmax.default": extremum_choices,
    "aten.argmin.default": extremum_choices,
}


def local_mean(site: LocalSite) -> Any:
    """A mean over a split dim, left a partial sum: this rank's mean of its piece, divided by the
    pieces. None where no split dim is reduced (the op as it is)."""
    strategy = site.strategy
    if not (strategy.output and any(p.is_partial for p in strategy.output)):
        return None
    dims = reduced_dims(site.node)
    pieces = math.prod(n for p, n in zip(strategy.inputs[0], site.mesh_shape) if p.is_shard and p.dim in dims)
    if pieces == 1:
        return None
    mean = site.call(site.target, site.args, site.kwargs)
    return site.call(torch.ops.aten.div.Tensor, (mean, pieces))


LOCAL = {name: local_mean for name in ops.MEAN}
