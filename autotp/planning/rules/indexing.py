"""``index_put`` (``x[mask] = v``, ``x[idx] = v``) with a boolean mask among its indices.

A boolean mask at entry ``i`` of ``indices`` stands for as many dims of ``x`` as it has (from dim
``i`` on, after the dims earlier masks stood for), not one as an integer index does. So ``x`` may
be split along a dim the mask covers only where the mask is split the same way (each rank writes
the elements of its piece that its piece of the mask selects), and along a dim the mask does not
cover with the mask whole. The values must be one value (broadcast to every selected element):
otherwise the k-th selected element takes the k-th value, and a rank cannot tell which are its
own. Partial sums of ``x`` and the values together give partial sums. Integer indices alone are
left to DTensor's rule (:mod:`autotp.planning.choices.dtensor_rules`); a mask beside integer indices or another
mask runs whole (each index becomes a list of positions, and the lists pair up element by element:
a rank's share of one list does not pair with another's).
"""

from __future__ import annotations

import math
from typing import Optional

from autotp.placement import P, R, S
from autotp.planning.rules.common import AxisChoice, divisible
from autotp.tracing.graph import OpNode, TensorArg


def index_put_choices(node: OpNode, n: int) -> Optional[list[AxisChoice]]:
    """The choices for a boolean mask (module doc); None where no index is a boolean mask."""
    indices = node.args.get("indices")
    values = node.args.get("values")
    if not isinstance(indices, (list, tuple)) or not isinstance(values, TensorArg):
        return None
    infos = node.input_infos
    covered: dict[int, tuple[int, int]] = {}  # dim of x -> (input index of the mask, dim of the mask)
    dim, masks, integers = 0, 0, False
    for entry in indices:
        if isinstance(entry, TensorArg) and infos[entry.index].dtype == "bool":
            masks += 1
            for j in range(infos[entry.index].ndim):
                covered[dim + j] = (entry.index, j)
            dim += infos[entry.index].ndim
        elif entry is None or isinstance(entry, TensorArg):
            integers = integers or entry is not None
            dim += 1
        else:
            return None
    if not masks:
        return None
    k = len(node.inputs)
    choices: list[AxisChoice] = [((R,) * k, R)]
    if node.output.is_float:  # linear in x and the values together: summands of both, a summand out
        choices.append((tuple(P if i in (0, values.index) else R for i in range(k)), P))
    if integers or masks > 1 or math.prod(infos[values.index].shape) != 1:
        return choices  # masks beside integer indices or other masks (their positions pair up): whole
    x = infos[0]
    for d in range(x.ndim):
        if not divisible(x.shape[d], n):
            continue
        placements = [R] * k
        placements[0] = S(d)
        if d in covered:
            mask, j = covered[d]
            placements[mask] = S(j)
        choices.append((tuple(placements), S(d)))
    return choices


RULES = {"aten.index_put_.default": index_put_choices, "aten.index_put.default": index_put_choices}
