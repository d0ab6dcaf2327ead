"""Ops that join tensors: ``cat`` along a dim, ``stack`` along a new one; other dims stay split.
``repeat`` joins copies of one tensor: a dim repeated once keeps its split, and a dim repeated a
multiple of ``n`` times may be split from a whole input (each rank makes its share of the copies)."""

from __future__ import annotations

from typing import Optional

from autotp.local.site import Call, LocalSite
from autotp.placement import P, R, S, dim_pieces
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode


def cat_choices(node: OpNode, n: int) -> list[AxisChoice]:
    out = node.output
    dim = node.args.int("dim", out.ndim)
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R), ((P,) * k, P)]
    if not all(i.ndim == out.ndim for i in node.input_infos):  # cat skips empty 1-D tensors: keep it whole
        return choices
    for d in range(out.ndim):
        if d != dim and divisible(out.shape[d], n):
            choices.append(((S(d),) * k, S(d)))
    return choices


def stack_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """stack: input dim ``d`` is output dim ``d`` before the new dim, ``d + 1`` after it."""
    out = node.output
    new = node.args.int("dim", out.ndim)
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    if out.is_float:
        choices.append(((P,) * k, P))
    for d in range(out.ndim - 1):
        o = d if d < new else d + 1
        if divisible(out.shape[o], n):
            choices.append(((S(d),) * k, S(o)))
    return choices


def repeat_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """``repeat(x, reps)``: ``reps`` may have more entries than ``x`` has dims (new leading dims). A
    split input dim repeated once stays split; an output dim repeated ``k * n`` times from a whole
    input is split into whole copies: each rank repeats ``k`` times (repeat counts known when traced)."""
    out = node.output
    reps = node.args.get("repeats")
    choices: list[AxisChoice] = [((R,), R)]
    if out.is_float:
        choices.append(((P,), P))  # linear: the copies of partial sums sum to the copies
    if not isinstance(reps, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in reps):
        return choices
    lead = len(reps) - node.input_infos[0].ndim
    for d in range(out.ndim):
        if reps[d] == 1 and d >= lead and divisible(out.shape[d], n):
            choices.append(((S(d - lead),), S(d)))
        elif reps[d] % n == 0 and reps[d] >= n:
            choices.append(((R,), S(d)))
    return choices


RULES = {"aten.cat.default": cat_choices, "aten.stack.default": stack_choices,
         "aten.repeat.default": repeat_choices}


def local_repeat(site: LocalSite) -> Optional[Call]:
    """``repeat`` into a dim split from a whole input (:func:`repeat_choices`): this rank's copies,
    the count divided by the pieces where the input dim is whole here."""
    strategy, args = site.strategy, site.args
    if not any(p.is_shard for p in strategy.output):
        return None
    lead = len(args[1]) - site.node.input_infos[0].ndim
    read = strategy.inputs[0] or ()
    reps = [r if d >= lead and dim_pieces(read, site.mesh_shape, d - lead) > 1
            else r // dim_pieces(strategy.output, site.mesh_shape, d) for d, r in enumerate(args[1])]
    return site.called(args=(args[0], reps, *args[2:]))


LOCAL = {"aten.repeat.default": local_repeat}
