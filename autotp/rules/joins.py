"""Ops that join tensors: ``cat`` along a dim, ``stack`` along a new one; other dims stay split."""

from __future__ import annotations

from autotp.graph import OpNode
from autotp.placement import P, R, S
from autotp.rules.common import AxisChoice, divisible


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


RULES = {"aten.cat.default": cat_choices, "aten.stack.default": stack_choices}
