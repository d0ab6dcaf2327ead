"""Elementwise ops: split any output dim the inputs share; partial sums where the op is linear.

``one_hot`` is elementwise too, each index becoming a row of ``num_classes`` (a dim added last): any
dim of the indices splits, the classes' dim never (a rank would need the classes of its piece)."""

from __future__ import annotations

from typing import Iterable

from autotp import ops
from autotp.placement import P, R, S
from autotp.planning.rules.common import AxisChoice, broadcast_in, divisible
from autotp.tracing.graph import OpNode


def pointwise_choices(node: OpNode, n: int, no_shard_dims: Iterable[int] = ()) -> list[AxisChoice]:
    out = node.output
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    blocked = set(no_shard_dims)
    for d in range(out.ndim):
        if d in blocked or not divisible(out.shape[d], n):
            continue
        choices.append((tuple(broadcast_in(i, out, d) for i in node.input_infos), S(d)))
    t = node.target
    if t in ops.UNARY_LINEAR or t in ops.SCALAR_SCALE:
        # a cast to an integer or bool dtype truncates each summand: not linear
        if k == 1 and (out.is_float or not node.input_infos[0].is_float):
            choices.append(((P,), P))
    elif t in ops.PAIRWISE_ADD and k == 2 and node.args.is_tensor("other"):  # x + 1 adds 1 on every rank
        choices.append(((P, P), P))
    elif t in ops.SCALE_BY_OTHER and k == 2:
        choices.append(((P, R), P))
        if t == "aten.mul.Tensor":
            choices.append(((R, P), P))
    elif t in ops.SCALE_BY_OTHER and k == 1:  # multiplied or divided by a Python number
        choices.append(((P,), P))
    return choices


def softmax_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """softmax / log_softmax: pointwise except along the normalized dim."""
    return pointwise_choices(node, n, no_shard_dims=(node.args.int("dim", node.output.ndim),))


def one_hot_choices(node: OpNode, n: int) -> list[AxisChoice]:
    """one_hot(ids, num_classes): ``ids``' dims split with the output's; the classes' dim whole."""
    ids = node.input_infos[0]
    return [((R,), R)] + [((S(d),), S(d)) for d in range(ids.ndim) if divisible(ids.shape[d], n)]


RULES = {
    "aten.one_hot.default": one_hot_choices,
    # x[:, 0] = start: each rank fills its piece; never a partial sum (fill_ is in no linear set)
    "aten.fill_.Tensor": pointwise_choices,
    "aten.fill_.Scalar": pointwise_choices,
    "aten.softmax.int": softmax_choices,
    "aten._softmax.default": softmax_choices,
    "aten.log_softmax.int": softmax_choices,
    "aten._log_softmax.default": softmax_choices,
}
